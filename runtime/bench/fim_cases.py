"""The cases of ``dflash bench --dataset fim``: ``runtime/assets/prompts/fim.jsonl`` read and checked.

Each line is one hand-written file with one hole (see the README there): ``prefix``, ``suffix`` and the
``middle`` that was cut out (``cut``: a line, lines, a block or a function body). ``runtime.bench.fim``
runs them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import ConfigError, InputError

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "prompts"
FIM_FILE = ASSETS / "fim.jsonl"
FIELDS = ("id", "language", "filename", "cut", "prefix", "suffix", "middle")
CUTS = ("line", "lines", "block", "body")
DEFAULT_MAX_TOKENS = 64


# -- the cases ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FimCase:
    """One file with a hole.

    Attributes:
        id: stable identifier.
        language: the file's language.
        filename: a plausible path for it.
        cut: how the hole was cut: "line" (rest of a line), "lines", "block" or "body".
        prefix, suffix: the text before and after the hole.
        middle: the reference middle (for information: bench compares DFlash with plain decoding).
    """

    id: str
    language: str
    filename: str
    cut: str
    prefix: str
    suffix: str
    middle: str

    def edited(self) -> tuple[str, str]:
        """The same file one keystroke later: the middle's first character typed at the cursor."""
        return self.prefix + self.middle[:1], self.suffix


def load_fim_cases(path: str | Path = FIM_FILE) -> tuple[FimCase, ...]:
    """The cases of a FIM case file (JSONL, one object with ``FIELDS`` per line).

    Raises:
        InputError: a missing file, invalid JSON, a missing or empty field, an unknown cut, a
            repeated id.
    """
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise InputError(f"cannot read FIM cases {p}: {e}") from None
    cases: list[FimCase] = []
    seen: set[str] = set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{p.name} line {n} is not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise InputError(f"{p.name} line {n}: expected a JSON object")
        missing = [k for k in FIELDS if not isinstance(obj.get(k), str) or (k != "suffix" and not obj[k])]
        if missing:
            raise InputError(f"{p.name} line {n}: missing or empty {', '.join(missing)}")
        if obj["cut"] not in CUTS:
            raise InputError(f"{p.name} line {n}: cut must be one of {', '.join(CUTS)}, got {obj['cut']!r}")
        if obj["id"] in seen:
            raise InputError(f"{p.name} line {n}: id {obj['id']!r} appears twice")
        seen.add(obj["id"])
        cases.append(FimCase(*(str(obj[k]) for k in FIELDS)))
    if not cases:
        raise InputError(f"{p} holds no FIM cases")
    return tuple(cases)


def limit_cases(cases: Sequence[FimCase], n: int | None) -> tuple[FimCase, ...]:
    """The first ``n`` cases (all when None).

    Raises:
        ConfigError: ``n`` < 1.
    """
    if n is None:
        return tuple(cases)
    if n < 1:
        raise ConfigError(f"--limit must be >= 1, got {n}")
    return tuple(cases[:n])
