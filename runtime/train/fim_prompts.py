"""Fill-in-the-middle training prompts: holes cut from real source files as editors cut them.

An editor plugin (llama.vim, llama.vscode, Continue, Tabby) sends the text before the cursor, the
text after it and asks for the middle. A drafter trained only on chat answers has never seen a
middle; this generator ("fim", ``dflash train --fim-from``) makes prompts in the target's own FIM
layout (``runtime.fim``) from files under the given folders, or from the code blocks of the
target's own answers in an earlier dataset (application-style code in every language the chat
prompts asked for: a machine's own sources are mostly library code in a few languages), and the
dataset builder then has the target answer them greedily, so every label is the target's own middle.

Holes are cut the four ways the held-out cases of ``dflash bench --dataset fim`` are
(``runtime.bench.fim_cases.CUTS``):

- ``line``: the cursor inside a line (after its indentation and at least one typed character),
  the rest of the line cut;
- ``lines``: the cursor at the start of a line, 2-4 lines cut;
- ``block``: the lines indented under a line that opens a block (``:`` or ``{``), at most 12;
- ``body``: a function's whole body (a ``def`` in Python, a top-level ``...) {`` elsewhere), at most 25
  lines.

The prefix keeps at most ``prefix_chars`` before the cursor (cut at a line start) and the suffix
at most ``suffix_chars`` after the hole (cut at a line end), as editors send a window around the
cursor. Files whose text holds a control-token spelling (``<|...|>``) are skipped: the raw prompt is
tokenised with the control tokens parsed. Prompts that duplicate an evaluation prompt (the FIM cases
included, ``runtime.train.dedupe``) are dropped.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runtime.train.prompt_list import TrainPrompt

CUTS = ("line", "lines", "block", "body")
CUT_MIX = (0.35, 0.25, 0.2, 0.2)  # line, lines, block, body
_BRACE_FN = re.compile(r"^[A-Za-z_].*\)\s*(const\s*)?\{\s*$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def _block_end(lines: Sequence[str], head: int, limit: int) -> int | None:
    """Index after the last line indented deeper than ``lines[head]`` (blank lines inside kept),
    or None when the block is empty or longer than ``limit`` lines."""
    base = _indent(lines[head])
    end = head + 1
    last = None
    while end < len(lines):
        line = lines[end]
        if line.strip():
            if _indent(line) <= base:
                break
            last = end
        end += 1
    if last is None or last - head > limit:
        return None
    return last + 1


def _hole(lines: list[str], cut: str, rng: random.Random, lang: str) -> tuple[int, int, int, int] | None:
    """(first line, column, end line, end column) of a hole of kind ``cut``; the hole ends at the
    start of ``end line`` when ``end column`` is 0."""
    n = len(lines)
    if cut == "line":
        cands = [i for i, s in enumerate(lines) if len(s.strip()) >= 12]
        if not cands:
            return None
        i = rng.choice(cands)
        lo = _indent(lines[i]) + 1
        hi = len(lines[i].rstrip()) - 4
        if hi <= lo:
            return None
        return i, rng.randint(lo, hi), i, len(lines[i])
    if cut == "lines":
        cands = [i for i in range(1, n - 2) if lines[i].strip()]
        if not cands:
            return None
        i = rng.choice(cands)
        k = rng.randint(2, 4)
        if i + k > n:
            return None
        return i, _indent(lines[i]), i + k, 0
    if cut in ("block", "body"):
        if cut == "body":
            pat = re.compile(r"^\s*(async\s+)?def \w") if lang == "python" else _BRACE_FN
            limit = 25
        else:
            pat = re.compile(r".*[:{]\s*$")
            limit = 12
        heads = [i for i, s in enumerate(lines[:-1]) if pat.match(s) and not s.lstrip().startswith(("#", "//", "*"))]
        rng.shuffle(heads)
        for h in heads[:8]:
            end = _block_end(lines, h, limit)
            if end is None:
                continue
            first = h + 1
            if lang == "python" and cut == "body":  # keep a docstring: editors complete below it
                first = _after_docstring(lines, first, end)
            if first >= end:
                continue
            return first, _indent(lines[first]), end, 0
        return None
    raise ValueError(f"unknown cut {cut!r}")


def _after_docstring(lines: Sequence[str], first: int, end: int) -> int:
    s = lines[first].strip()
    for quote in ('"""', "'''"):
        if s.startswith(quote):
            if s.count(quote) >= 2 and len(s) > 3:
                return first + 1
            for j in range(first + 1, end):
                if quote in lines[j]:
                    return j + 1
    return first


def cut_file(
    text: str, rng: random.Random, lang: str, cut: str, prefix_chars: int = 1500, suffix_chars: int = 500
) -> tuple[str, str, str] | None:
    """(prefix, middle, suffix) of one hole of kind ``cut`` in ``text``, or None where none fits."""
    lines = text.split("\n")
    hole = _hole(lines, cut, rng, lang)
    if hole is None:
        return None
    i, col, j, jcol = hole
    start = sum(len(s) + 1 for s in lines[:i]) + col
    stop = sum(len(s) + 1 for s in lines[:j]) + jcol
    prefix, middle, suffix = text[:start], text[start:stop], text[stop:]
    if len(middle.strip()) < 2:
        return None
    if len(prefix) > prefix_chars:  # a window around the cursor, cut at line boundaries
        cut_at = prefix.find("\n", len(prefix) - prefix_chars)
        prefix = prefix[cut_at + 1 :] if cut_at >= 0 else prefix[-prefix_chars:]
    if len(suffix) > suffix_chars:
        cut_at = suffix.rfind("\n", 0, suffix_chars)
        suffix = suffix[: cut_at + 1] if cut_at > 0 else suffix[:suffix_chars]
    if len(prefix.strip()) < 40:
        return None
    return prefix, middle, suffix


def fim_sources(roots: Sequence[Path], tokenizer: Any) -> dict[str, list[tuple[str, Path | str]]]:
    """language -> (name, file or text) of what holes are cut from: the source files under each root
    (``runtime.train.text.SUFFIXES``), or, where a root is a dataset folder (``dataset.json``), the
    fenced code blocks of the target's own answers in it (``runtime.train.answers``; its held-out
    shard left out), named ``SOURCE#k``: application-style code in every language the prompts asked
    for, where a machine's own sources are mostly library code in few languages."""
    from runtime.train.answers import code_blocks, read_answers
    from runtime.train.text import files_by_language

    files = [r for r in roots if not (r / "dataset.json").is_file()]
    out: dict[str, list[tuple[str, Path | str]]] = {
        lang: [(p.name, p) for p in paths] for lang, paths in files_by_language(files).items()
    }
    for root in roots:
        if root in files:
            continue
        for answer in read_answers(root, tokenizer):
            for k, block in enumerate(code_blocks(answer.reply, min_lines=12, max_lines=200)):
                out.setdefault(block.fence, []).append((f"{answer.source}#{k}", block.code + "\n"))
    return out


def build_fim_prompts(
    roots: Sequence[Path],
    tokenizer: Any,
    seed: int = 0,
    max_prompts: int | None = None,
    prefix_chars: int = 1500,
    suffix_chars: int = 500,
    dedupe: bool = True,
) -> list[TrainPrompt]:
    """FIM prompts cut from the sources under ``roots`` (``fim_sources``: files, or the code of a
    dataset's answers), languages mixed as the text generator mixes them
    (``runtime.train.text.balanced``), cuts by ``CUT_MIX``, at most one hole per file or code block;
    each prompt is the raw text of the target's FIM layout (control tokens spelled out: the dataset
    builder tokenises it with them parsed, to the ids ``runtime.fim.build`` gives). ``source`` is
    ``fim:LANG:CUT:NAME``.

    Raises:
        InputError: the tokenizer declares no FIM tokens.
    """
    from runtime.fim import require
    from runtime.train.generator import drop_evaluation_duplicates
    from runtime.train.text import balanced

    names = require(tokenizer, "the target").names
    rng = random.Random(seed)
    taken: dict[str, int] = {}
    out: list[TrainPrompt] = []
    for lang, (name, where) in balanced(fim_sources(roots, tokenizer), rng, taken):
        if max_prompts is not None and len(out) >= max_prompts:
            break
        if isinstance(where, str):
            text = where
        else:
            try:
                text = where.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
        lines = text.splitlines()
        if len(lines) < 12 or max(len(s) for s in lines) > 200 or "<|" in text or "\r" in text:
            continue
        cut = rng.choices(CUTS, weights=CUT_MIX)[0]
        parts = cut_file(text, rng, lang, cut, prefix_chars, suffix_chars)
        if parts is None:
            continue
        prefix, _, suffix = parts
        taken[lang] += 1
        text = f"{names['prefix']}{prefix}{names['suffix']}{suffix}{names['middle']}"
        out.append(TrainPrompt(text, False, f"fim:{lang}:{cut}:{name}"))
    if dedupe:
        out = drop_evaluation_duplicates({"fim": out})["fim"]
    return out
