"""A run folder's own records: the commands that made it (``commands.txt``, quoted by the model
card), the dataset folders it trains on (``data-sources.json``, for ``--resume``) and the
portable form of the paths it shows."""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runtime.errors import ModelLoadError

COMMANDS_FILE = "commands.txt"
DATA_REPORT = "data-report.json"
DATA_SOURCES = "data-sources.json"


def portable_arg(arg: str, base: Path) -> str:
    """An absolute path in a recorded command, made relative to the run folder's parent (else its
    last two parts), so that no machine-specific path reaches a shipped model card."""
    if not arg.startswith("/"):
        return arg
    p = Path(arg)
    try:
        return str(p.resolve().relative_to(base.resolve().parent)) or "."
    except ValueError:
        return str(Path(*p.parts[-2:]))


def recorded_out(cmds: list[str]) -> str | None:
    """The run folder as the last recorded command names it (``--out X``, ``-o X`` or ``--out=X``), so that
    the card's continue line runs from the same folder as the commands above it."""
    for c in reversed(cmds):
        args = shlex.split(c)
        for i, a in enumerate(args):
            if a in ("--out", "-o") and i + 1 < len(args):
                return args[i + 1]
            if a.startswith("--out="):
                return a.split("=", 1)[1]
    return None


def command_line(argv: Sequence[str]) -> str:
    """The invocation as one shell line (``dflash`` and its arguments, quoted)."""
    return "dflash " + " ".join(shlex.quote(a) for a in argv[1:])


def record_sources(out: Path, data: Path, extra: Sequence[Path], corpus: Sequence[Path]) -> None:
    """Keep the run's dataset folders (absolute) in OUT/data-sources.json, for --resume."""
    doc = {
        "data": str(data.resolve()),
        "extra_data": [str(f.resolve()) for f in extra],
        "corpus_data": [str(f.resolve()) for f in corpus],
    }
    (out / DATA_SOURCES).write_text(json.dumps(doc, indent=2) + "\n")


def recorded_sources(out: Path) -> dict[str, Any]:
    """The dataset folders a run trained on: OUT/data-sources.json, or for runs older than that
    file the last training command in OUT/commands.txt (its relative paths taken from here)."""
    path = out / DATA_SOURCES
    if path.exists():
        return read_sources(path)
    lines = (out / COMMANDS_FILE).read_text().splitlines() if (out / COMMANDS_FILE).is_file() else []
    for line in reversed(lines):
        args = shlex.split(line)
        if "--resume" in args or "--eval-only" in args or "--data-only" in args:
            continue
        found: dict[str, Any] = {"extra_data": [], "corpus_data": []}
        for flag, value in zip(args, args[1:], strict=False):
            if flag == "--data":
                found["data"] = value
            elif flag in ("--extra-data", "--corpus-data"):
                found[flag[2:].replace("-", "_")].append(value)
        return found
    return {}


def read_sources(path: Path) -> dict[str, Any]:
    """OUT/data-sources.json as ``record_sources`` wrote it.

    Raises:
        ModelLoadError: the file is not JSON, not an object, or a field has another type (names the file).
    """
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(f"{path} is damaged (not readable JSON: {e}); fix or delete it, or give --data") from None
    if not isinstance(doc, dict):
        raise ModelLoadError(f"{path} is damaged: a JSON object was expected, not {type(doc).__name__}")
    data = doc.get("data")
    if data is not None and not (isinstance(data, str) and data):
        raise ModelLoadError(f"{path} is damaged: 'data' must be a folder name, got {data!r}")
    for key in ("extra_data", "corpus_data"):
        value = doc.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ModelLoadError(f"{path} is damaged: {key!r} must be a list of folder names, got {value!r}")
    return dict(doc)


def record_command(out: Path, argv: Sequence[str]) -> None:
    """Append this invocation to OUT/commands.txt, which the model card quotes (training and
    evaluation may span several runs: --resume, --extend, --eval-only)."""
    with (out / COMMANDS_FILE).open("a") as f:
        f.write(command_line(argv) + "\n")
