"""Prompt generator "answers": requests built on the code of the target's own earlier answers.

The v2 generator's edit prompts (types, fix, tests, refactor, port, explain) hold real code, but that
code is the standard library's Python; chat users edit code in every language. The target itself
writes such code when it answers the task prompts ("Write a Go function that ..."), so a dataset it
answered holds hundreds of code blocks in Go, Rust, JavaScript, TypeScript, Java, C, C++, C#, Bash,
SQL and Python. This generator reads a dataset's answers, takes their fenced code blocks and asks
for the edits a user would ask for on them, and builds multi-turn follow-ups whose earlier
assistant turn is the target's own answer (the context a chat drafter sees after the first reply).

Kinds (``TrainPrompt.kind``) and their share (``MIX``): ``ans-types``, ``ans-fix`` (one small
mutation injected, or a review request), ``ans-tests``, ``ans-refactor``, ``ans-port``,
``ans-explain``, ``ans-follow-up``. The source dataset's held-out (last) shard is not used, so its
validation stays unseen. Prompts that duplicate an evaluation prompt are dropped, as in v2.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.train.data import encode_prompt, load_shard
from runtime.train.generator import MUTATIONS, drop_evaluation_duplicates, merge_by_mix
from runtime.train.prompt_list import TrainPrompt, read_prompts
from runtime.train.prompts import LANGUAGES

MIX: dict[str, float] = {
    "ans-follow-up": 0.22,
    "ans-fix": 0.14,
    "ans-tests": 0.14,
    "ans-types": 0.12,
    "ans-refactor": 0.12,
    "ans-port": 0.14,
    "ans-explain": 0.12,
}

# fence tag -> (language name in requests, fence tag written in prompts)
FENCES: dict[str, tuple[str, str]] = {
    "python": ("Python", "python"),
    "py": ("Python", "python"),
    "javascript": ("JavaScript", "javascript"),
    "js": ("JavaScript", "javascript"),
    "typescript": ("TypeScript", "typescript"),
    "ts": ("TypeScript", "typescript"),
    "go": ("Go", "go"),
    "golang": ("Go", "go"),
    "rust": ("Rust", "rust"),
    "rs": ("Rust", "rust"),
    "java": ("Java", "java"),
    "cpp": ("C++", "cpp"),
    "c++": ("C++", "cpp"),
    "c": ("C", "c"),
    "csharp": ("C#", "csharp"),
    "cs": ("C#", "csharp"),
    "c#": ("C#", "csharp"),
    "bash": ("Bash", "bash"),
    "sh": ("Bash", "bash"),
    "shell": ("Bash", "bash"),
    "sql": ("SQL", "sql"),
}
TYPES = {
    "Python": "Add type hints to this Python code{extra}:",
    "JavaScript": "Convert this JavaScript to TypeScript with proper types{extra}:",
    "TypeScript": "Make the types in this TypeScript code stricter (no `any`){extra}:",
    "Go": "Add doc comments to this Go code and make its error handling explicit{extra}:",
    "Rust": "Add doc comments (///) to this Rust code and make its types more precise{extra}:",
    "Java": "Add Javadoc comments and use generics or final where it helps in this Java code{extra}:",
    "C++": "Modernise the types in this C++ code (const, references, auto, std types){extra}:",
    "C": "Add const where it belongs and document this C code{extra}:",
    "C#": "Add XML doc comments and nullable annotations to this C# code{extra}:",
    "Bash": "Make this Bash script stricter (set -euo pipefail, quoting, local variables){extra}:",
    "SQL": "Add comments to this SQL and use explicit column lists and JOINs{extra}:",
}
TEST_FRAMEWORKS = {
    "Python": "pytest",
    "JavaScript": "Jest",
    "TypeScript": "Jest",
    "Go": "the testing package (table-driven tests)",
    "Rust": "a #[cfg(test)] module",
    "Java": "JUnit 5",
    "C++": "GoogleTest",
    "C": "plain assert() calls in a main function",
    "C#": "xUnit",
    "Bash": "bats",
    "SQL": "a few example rows and the expected result",
}
FIX = [
    "This {lang} code has a bug. Find it and fix it:",
    "My {lang} code gives wrong results for some inputs. What is wrong, and how do I fix it?",
    "Something is off in this {lang} code. Can you spot the bug and show the corrected version?",
]
REVIEW = "Review this {lang} code, point out bugs or edge cases it misses, and give a fixed version:"
TESTS = [
    "Write unit tests for this {lang} code using {fw}:",
    "Write tests with {fw} covering the edge cases of this code:",
]
REFACTOR = [
    "Refactor this {lang} code to make it easier to read, without changing what it does:",
    "Can you simplify this {lang} code?",
    "Rewrite this {lang} code in a more idiomatic style:",
]
PORT = [
    "Port this {lang} code to {other}:",
    "Translate the following {lang} code into idiomatic {other}:",
]
EXPLAIN = [
    "Explain what this {lang} code does, step by step:",
    "What does this code do? Explain it, then suggest one improvement and show the improved code.",
    "I found this {lang} code in a project. Explain how it works and when I would use it.",
]
FOLLOW_UPS = [
    "Now write unit tests for it.",
    "Can you add error handling for invalid input?",
    "Port it to {other}.",
    "Explain how it works, line by line.",
    "Add comments and rename the variables to be more descriptive.",
    "Can you make it faster?",
    "Show how to use it with a short example.",
    "Make it work without any external libraries.",
    "What edge cases does it miss? Fix them.",
    "Rewrite it as a class (or a struct with methods).",
]
MUTATIONS_EXTRA = [("return true", "return false"), ("&&", "||"), (" != ", " == "), ("> 0", ">= 0")]


@dataclass(frozen=True)
class Answer:
    """One answered prompt of a dataset: the conversation that was asked and the target's reply."""

    messages: tuple[dict[str, str], ...]
    reply: str
    source: str


@dataclass(frozen=True)
class CodeBlock:
    """A fenced code block of a reply."""

    lang: str  # language name, e.g. "Go"
    fence: str  # fence tag, e.g. "go"
    code: str


_FENCE = re.compile(r"```([A-Za-z+#]*)[ \t]*\n(.*?)\n```", re.S)


def code_blocks(text: str, min_lines: int = 4, max_lines: int = 40) -> list[CodeBlock]:
    """Fenced code blocks of ``text`` in a known language with ``min_lines``..``max_lines`` lines."""
    out = []
    for m in _FENCE.finditer(text):
        tag = m.group(1).lower()
        if tag not in FENCES:
            continue
        code = m.group(2).rstrip()
        n = len([line for line in code.splitlines() if line.strip()])
        if min_lines <= n <= max_lines:
            lang, fence = FENCES[tag]
            out.append(CodeBlock(lang, fence, code))
    return out


def read_answers(data_dir: Path, tokenizer: Any, skip_last: bool = True) -> list[Answer]:
    """The chat prompts of a dataset with the target's decoded replies, in dataset order.

    A dataset stores its prompt list (``prompts.jsonl``) and shard ``i`` holds the answers to the
    prompts that fitted the prompt-token limit, in order; the shards' recorded sources check the
    alignment (a shard that does not line up is skipped). Raw-completion prompts are left out.
    """
    limit = int(json.loads((data_dir / "dataset.json").read_text()).get("max_prompt_tokens", 512))
    kept = [p for p in read_prompts(data_dir) if 0 < len(encode_prompt(tokenizer, p.text, p.chat, p.messages)) <= limit]
    paths = sorted(data_dir.glob("shard-*.safetensors"))
    held_out = paths[-1] if skip_last and len(paths) > 1 else None  # the held-out shard stays unseen
    out: list[Answer] = []
    pos = 0
    for path in paths:
        shard = load_shard(path)
        batch, pos = kept[pos : pos + shard.num_sequences], pos + shard.num_sequences
        if path == held_out or [p.source for p in batch] != list(shard.sources):
            continue
        for j, p in enumerate(batch):
            if not p.chat and not p.messages:
                continue
            a, b = int(shard.offsets[j]), int(shard.offsets[j + 1])
            reply = tokenizer.decode(shard.tokens[a + int(shard.prompt_len[j]) : b].tolist(), skip_special_tokens=True)
            out.append(Answer(p.messages or ({"role": "user", "content": p.text},), reply, p.source))
    return out


def _mutate(code: str, rng: random.Random) -> str | None:
    """``code`` with one small bug injected (not on its first line), or None when none applies."""
    head, _, body = code.partition("\n")
    muts = [m for m in [*MUTATIONS, *MUTATIONS_EXTRA] if m[0] in body]
    if not muts:
        return None
    old, new = rng.choice(muts)
    spots = [m.start() for m in re.finditer(re.escape(old), body)]
    at = rng.choice(spots)
    return head + "\n" + body[:at] + new + body[at + len(old) :]


def _block(b: CodeBlock, code: str | None = None) -> str:
    return f"```{b.fence}\n{code if code is not None else b.code}\n```"


def _kind_pools(answers: Sequence[Answer], rng: random.Random, python_share: float) -> dict[str, list[TrainPrompt]]:
    pools: dict[str, list[TrainPrompt]] = {k: [] for k in MIX}
    order = list(answers)
    rng.shuffle(order)
    for ans in order:
        blocks = code_blocks(ans.reply)
        if not blocks:
            continue
        b = rng.choice(blocks)
        detail = f"{b.lang}:{ans.source.split(':', 1)[0]}"
        other = rng.choice([x for x in LANGUAGES if x != b.lang])

        def add(kind: str, text: str, detail: str = detail) -> None:
            pools[kind].append(TrainPrompt(text, True, f"{kind}:{detail}"))

        extra = rng.choice(["", " and keep its behaviour", ""])
        add("ans-types", TYPES[b.lang].format(extra=extra) + "\n\n" + _block(b))
        bugged = _mutate(b.code, rng)
        if bugged is not None:
            add("ans-fix", rng.choice(FIX).format(lang=b.lang) + "\n\n" + _block(b, bugged))
        else:
            add("ans-fix", REVIEW.format(lang=b.lang) + "\n\n" + _block(b))
        fw = TEST_FRAMEWORKS[b.lang]
        add("ans-tests", rng.choice(TESTS).format(lang=b.lang, fw=fw) + "\n\n" + _block(b))
        add("ans-refactor", rng.choice(REFACTOR).format(lang=b.lang) + "\n\n" + _block(b))
        if b.lang != "SQL":
            add("ans-port", rng.choice(PORT).format(lang=b.lang, other=other) + "\n\n" + _block(b))
        add("ans-explain", rng.choice(EXPLAIN).format(lang=b.lang) + "\n\n" + _block(b))
        follow = rng.choice(FOLLOW_UPS).format(other=other)
        msgs = (*ans.messages, {"role": "assistant", "content": ans.reply}, {"role": "user", "content": follow})
        pools["ans-follow-up"].append(TrainPrompt(follow, True, f"ans-follow-up:{detail}", msgs))
    for k, pool in pools.items():  # the kinds of one answer must not sit side by side in every prefix
        rng.shuffle(pool)
        pools[k] = _interleave(pool, python_share)
    return pools


def _interleave(pool: list[TrainPrompt], python_share: float) -> list[TrainPrompt]:
    """``pool`` reordered so that every prefix holds at most ``python_share`` Python prompts (while
    prompts in other languages last): most answers' code is Python, most users' is not only."""
    py = [p for p in pool if p.source.split(":")[1] == "Python"]
    other = [p for p in pool if p.source.split(":")[1] != "Python"]
    out: list[TrainPrompt] = []
    i = j = 0
    while i < len(py) or j < len(other):
        take_py = j >= len(other) or (i < len(py) and (i + 1) / (len(out) + 1) <= python_share)
        if take_py:
            out.append(py[i])
            i += 1
        else:
            out.append(other[j])
            j += 1
    return out


def build_prompts_from_answers(
    answers: Iterable[Answer],
    seed: int = 0,
    max_prompts: int | None = None,
    dedupe: bool = True,
    python_share: float = 0.3,
) -> list[TrainPrompt]:
    """Edit, test, port, explain and follow-up requests on the code of ``answers`` (see the module
    docstring), merged by ``MIX`` so any prefix keeps the mix, with at most ``python_share`` of
    each kind's prompts on Python code while code in other languages lasts; deterministic for a
    seed."""
    pools = _kind_pools(list(answers), random.Random(seed), python_share)
    return merge_by_mix(drop_evaluation_duplicates(pools) if dedupe else pools, MIX, max_prompts)
