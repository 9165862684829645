"""What `dflash bench` and `dflash bench --dataset fim` (dflash_cli.commands.bench_fim) share: the
--format values, the parsing of sweeps (``4,8,16``, ``0,8,auto``), stderr lines and the progress bar."""

from __future__ import annotations

import sys
from collections.abc import Callable
from enum import Enum
from typing import Any


class BenchFormat(str, Enum):
    """--format values of `dflash bench` (stdout)."""

    json = "json"
    md = "md"
    csv = "csv"


def _split(value: str | None, what: str) -> list[str]:
    return [p.strip() for p in (value or "").replace(" ", ",").split(",") if p.strip()]


def _block_sizes(value: str | None) -> tuple[int, ...]:
    from runtime.errors import ConfigError

    try:
        return tuple(int(p) for p in _split(value, "--block-size"))
    except ValueError:
        raise ConfigError(f"--block-size expects block sizes like 4,8,16, got {value!r}") from None


def _ints_or_auto(value: str | None, flag: str, example: str) -> tuple[int | None, ...]:
    """A sweep like ``0,4,auto``: integers, ``auto`` (None: the runtime's choice)."""
    from runtime.errors import ConfigError

    try:
        return tuple(None if p.lower() == "auto" else int(p) for p in _split(value, flag))
    except ValueError:
        raise ConfigError(f"{flag} expects {example}, got {value!r}") from None


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _run_with_progress(job: Callable[[Any], Any]) -> Any:
    """Run the bench (``job(progress)``) with a progress bar on stderr when it is a terminal."""
    if not sys.stderr.isatty():
        return job(None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (
        TextColumn("bench"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.description}"),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("loading", total=None)

        def progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what)

        return job(progress)
