"""Offline coding prompts for drafter training, built from the local Python standard library.

Two kinds, matching how dflash is used:
- chat requests ("Write a Python function `name(args)` that <docstring summary>.") answered by
  the target through its chat template, and requests for other languages built from a list of
  everyday programming tasks;
- raw completions: the header and docstring of a stdlib function, continued by the target.

The stdlib is parsed with ``ast`` (nothing is imported or executed). The same seed on the same
Python version gives the same prompts. HumanEval and the other bench sets are never used here, so
they stay held out.
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from runtime.train.prompt_list import TrainPrompt

_SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "site-packages",
    "turtledemo",
    "__pycache__",
    "ensurepip",
    "tkinter",
}

CHAT_TEMPLATES = [
    "Write a Python function `{sig}` that {summary}",
    "Implement `{sig}` in Python. It should {summary}",
    "Write a Python function that {summary} Name it `{name}`.",
    "Can you write `{sig}` in Python? It {summary_3p}",
    "Write a Python class `{name}` that {summary}",
]

TASKS = [
    "reverses a string",
    "checks whether a string is a palindrome",
    "returns the n-th Fibonacci number",
    "computes the factorial of n",
    "checks whether a number is prime",
    "finds the greatest common divisor of two integers",
    "merges two sorted arrays",
    "removes duplicates from a list while keeping order",
    "counts word frequencies in a text",
    "parses a CSV line into fields",
    "validates an email address",
    "converts a Roman numeral to an integer",
    "converts an integer to binary",
    "performs binary search on a sorted array",
    "sorts an array with quicksort",
    "sorts an array with merge sort",
    "flattens a nested list",
    "transposes a matrix",
    "multiplies two matrices",
    "finds the longest common prefix of a list of strings",
    "checks whether brackets in a string are balanced",
    "implements a stack with push, pop and peek",
    "implements a queue using two stacks",
    "implements an LRU cache",
    "reads a file and counts its lines",
    "finds the maximum subarray sum",
    "rotates an array by k positions",
    "computes the edit distance between two strings",
    "checks whether two strings are anagrams",
    "returns all permutations of a list",
    "returns all subsets of a set",
    "implements depth-first search on a graph",
    "implements breadth-first search on a graph",
    "finds the shortest path with Dijkstra's algorithm",
    "reverses a linked list",
    "detects a cycle in a linked list",
    "computes the median of a list",
    "groups items by a key",
    "chunks a list into pieces of size n",
    "debounces a function call",
    "retries an operation with exponential backoff",
    "parses command-line arguments",
    "formats a number with thousands separators",
    "converts snake_case to camelCase",
    "computes a moving average",
    "finds the k most frequent elements",
    "checks whether a year is a leap year",
    "computes the number of days between two dates",
    "generates a random password",
    "implements a binary search tree with insert and search",
    "serialises an object to JSON",
    "reads key=value pairs from a config file",
    "implements a simple HTTP GET request",
    "computes the SHA-256 hash of a file",
    "merges two dictionaries",
    "finds duplicate files in a directory",
    "implements a thread-safe counter",
    "implements the producer-consumer pattern",
    "computes prime numbers with the sieve of Eratosthenes",
    "evaluates a postfix expression",
    "tokenises an arithmetic expression",
    "implements a trie with insert and prefix search",
    "validates a Sudoku board",
    "solves the N-Queens problem",
    "finds the longest increasing subsequence",
    "implements a min-heap",
    "computes the power set of a string",
    "converts Celsius to Fahrenheit",
    "computes compound interest",
    "counts vowels in a string",
    "capitalises the first letter of every word",
    "finds the intersection of two lists",
    "zips two lists into a dictionary",
    "implements a simple rate limiter",
    "paginates a list of items",
    "computes the Levenshtein ratio of two strings",
    "parses an ISO 8601 date",
    "checks whether a number is a power of two",
    "swaps two variables without a temporary",
]
LANGUAGES = ["Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C++", "C", "C#", "Bash"]
OTHER_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "How do I write a {lang} program that {task}? Show the code.",
    "Implement a {lang} function that {task}, with a short example of its use.",
    "Write {lang} code that {task}.",
]


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Python files of the standard library, tests and GUI demos excluded, in sorted order."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for p in sorted(base.rglob("*.py")):
        if any(part in _SKIP_DIRS for part in p.relative_to(base).parts):
            continue
        files.append(p)
    return files


def _summary(doc: str) -> str | None:
    first = doc.strip().split("\n\n")[0].replace("\n", " ")
    first = re.sub(r"\s+", " ", first).strip()
    m = re.match(r"(.+?[.!?])(\s|$)", first)
    sentence = m.group(1) if m else first
    if not (15 <= len(sentence) <= 220) or sentence.startswith((">>>", "Usage", "usage", "Return ", ":")):
        return None
    return sentence


def _lower_first(s: str) -> str:
    return s[0].lower() + s[1:] if s and not s[:2].isupper() else s


def _to_infinitive(sentence: str) -> str:
    """'Return the x.' -> 'returns the x.' for "that ..." templates."""
    words = sentence.split(" ", 1)
    verb = words[0]
    if verb.lower().endswith("s") or not verb[:1].isupper():
        return _lower_first(sentence)
    low = verb.lower()
    third = low + ("es" if low.endswith(("sh", "ch", "x", "o", "ss")) else "s")
    if low.endswith("y") and low[-2:-1] not in "aeiou":
        third = low[:-1] + "ies"
    return third + (" " + words[1] if len(words) > 1 else "")


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    args = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
    if node.args.vararg:
        args.append("*" + node.args.vararg.arg)
    args += [a.arg for a in node.args.kwonlyargs]
    if node.args.kwarg:
        args.append("**" + node.args.kwarg.arg)
    return f"{node.name}({', '.join(args)})"


def _defs(path: Path) -> Iterator[tuple[ast.AST, str, list[str]]]:
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if doc:
                yield node, doc, lines


def _raw_prefix(node: ast.AST, lines: list[str]) -> str | None:
    body = getattr(node, "body", None)
    if not body or not isinstance(body[0], ast.Expr):
        return None
    start = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno]) - 1  # type: ignore[attr-defined]
    end = body[0].end_lineno or body[0].lineno
    seg = lines[start:end]
    if not seg or len(seg) > 40:
        return None
    indent = len(seg[0]) - len(seg[0].lstrip())
    text = "\n".join(line[indent:] for line in seg)
    return text + "\n"


def build_prompts_v1(
    seed: int = 0, stdlib_root: Path | None = None, max_prompts: int | None = None
) -> list[TrainPrompt]:
    """The v1 training prompts (stdlib docstrings, raw headers and the task list), shuffled
    deterministically: datasets made before v2 record no generator and are extended with these
    (``runtime.train.prompt_sources.build_prompts`` picks v1 or v2).

    Args:
        seed: shuffle and template seed.
        stdlib_root: stdlib folder (default: this interpreter's).
        max_prompts: cap on the number returned.
    """
    rng = random.Random(seed)
    out: list[TrainPrompt] = []
    seen: set[str] = set()
    for path in stdlib_files(stdlib_root):
        module = path.stem
        for node, doc, lines in _defs(path):
            summary = _summary(doc)
            if summary is None:
                continue
            key = f"{node.name}:{summary}"  # type: ignore[attr-defined]
            if key in seen:
                continue
            seen.add(key)
            is_class = isinstance(node, ast.ClassDef)
            if rng.random() < 0.45:
                raw = _raw_prefix(node, lines)
                if raw:
                    out.append(TrainPrompt(raw, False, f"stdlib-raw:{module}.{node.name}"))  # type: ignore[attr-defined]
                    continue
            sig = node.name if is_class else _signature(node)  # type: ignore[arg-type,attr-defined]
            templates = CHAT_TEMPLATES[4:] if is_class else CHAT_TEMPLATES[:4]
            tpl = rng.choice(templates)
            text = tpl.format(
                sig=sig,
                name=node.name,  # type: ignore[attr-defined]
                summary=_lower_first(summary),
                summary_3p=_to_infinitive(summary),
            )
            out.append(TrainPrompt(text, True, f"stdlib-chat:{module}.{node.name}"))  # type: ignore[attr-defined]
    for task in TASKS:
        for lang in rng.sample(LANGUAGES, 4):
            out.append(TrainPrompt(rng.choice(OTHER_TEMPLATES).format(lang=lang, task=task), True, f"task:{lang}"))
    rng.shuffle(out)
    return out[:max_prompts] if max_prompts else out
