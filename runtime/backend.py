"""The interface front ends (CLI, TUI, bench, server) use to generate: a local ``Pipeline`` or a
remote OpenAI-compatible server implement it alike.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from runtime.config import DecodeOptions, SamplingParams
from runtime.engine import CancelToken
from runtime.engine.events import DecodeEvent


class Backend(Protocol):
    """Something that streams typed decode events for text prompts or conversations."""

    def describe(self) -> dict[str, Any]:
        """Names of the models, device, dtype, block size (whatever is known)."""
        ...

    def stream_prompt(
        self,
        text: str,
        params: SamplingParams,
        opts: DecodeOptions | None = None,
        cancel: CancelToken | None = None,
        chat: bool | None = None,
        system: str | None = None,
    ) -> Iterator[DecodeEvent]:
        """Complete ``text`` (chat template when ``chat`` or the model is a chat model)."""
        ...

    def stream_messages(
        self,
        messages: Sequence[dict[str, str]],
        params: SamplingParams,
        opts: DecodeOptions | None = None,
        cancel: CancelToken | None = None,
    ) -> Iterator[DecodeEvent]:
        """Answer a conversation (list of ``{"role", "content"}``) through the chat template."""
        ...
