"""What the chat app is told at start: sampling, decoder, system prompt, where sessions live."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from runtime.backend import Backend
from runtime.config import DecodeOptions, SamplingParams
from runtime.errors import ConfigError

Progress = Callable[[str], None]
BackendFactory = Callable[[Progress], Backend]
"""Builds the backend (e.g. loads a pipeline); called once in a worker thread with a progress callback."""

View = Literal["markdown", "origin"]


@dataclass(frozen=True)
class ChatConfig:
    """Settings of one chat app.

    Attributes:
        params: sampling and stop settings for every answer.
        decode: decoder choice (dflash or ar), block size, verify length.
        system: system prompt (None: none).
        db_path: the SQLite file for sessions and prompt history (None: keep nothing).
        resume: id of a stored session to open (None: start a new one).
        show_ghost: show rejected drafts as struck-through ghost text.
        view: how finished answers show: "markdown" (rendered, code highlighted) or "origin"
            (coloured by token origin, as they streamed).
        model_label: what the header says before the backend has described itself.
    """

    params: SamplingParams = field(default_factory=SamplingParams)
    decode: DecodeOptions = field(default_factory=DecodeOptions)
    system: str | None = None
    db_path: Path | None = None
    resume: int | None = None
    show_ghost: bool = True
    view: View = "markdown"
    model_label: str = ""

    def __post_init__(self) -> None:
        if self.view not in ("markdown", "origin"):
            raise ConfigError(f"unknown view {self.view!r}; use 'markdown' or 'origin'")
        if self.resume is not None and self.db_path is None:
            raise ConfigError("resuming a session needs a session database")
