"""The interface front ends (CLI, TUI, bench, server) generate through: a local ``Pipeline`` and a
remote OpenAI-compatible server (``runtime.client.remote.RemoteBackend``) implement it alike.

What a backend can do is stated in its ``capabilities`` record, so callers branch on data instead
of probing attributes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from runtime.config import DecodeOptions, SamplingParams
from runtime.engine import CancelToken
from runtime.engine.events import DecodeEvent


@dataclass(frozen=True)
class Capabilities:
    """What a backend's events and inputs carry.

    Attributes:
        per_token_origin: tokens carry their origin (ACCEPTED / TARGET) and blocks their drafts;
            False for servers that stream plain text (vLLM, SGLang): one TARGET token per chunk.
        tokenizer: text prompts and text output; False: token ids only (``stream_ids``).
        chat_template: conversations (``stream_messages``) go through a chat template.
        tree: drafts are verified as a tree (several candidates per step).
    """

    per_token_origin: bool = True
    tokenizer: bool = True
    chat_template: bool = True
    tree: bool = False


@runtime_checkable
class Backend(Protocol):
    """Something that streams typed decode events for text, token ids or conversations."""

    @property
    def capabilities(self) -> Capabilities:
        """What this backend's events and inputs carry."""
        ...

    def describe(self) -> Mapping[str, object]:
        """Names of the models, device, dtype, block size (whatever is known), for display."""
        ...

    def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        opts: DecodeOptions | None = None,
        cancel: CancelToken | None = None,
        *,
        chat: bool | None = None,
        system: str | None = None,
    ) -> Iterator[DecodeEvent]:
        """Complete a text prompt (chat template when ``chat``, or None and the model has one) or
        token ids (as ``stream_ids``).

        Yields:
            ``PrefillDone``, then ``BlockVerified`` per verify step, then ``Finished``.
        """
        ...

    def stream_ids(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        opts: DecodeOptions | None = None,
        cancel: CancelToken | None = None,
    ) -> Iterator[DecodeEvent]:
        """Complete token ids as they are (no template)."""
        ...

    def stream_messages(
        self,
        messages: Sequence[Mapping[str, str]],
        params: SamplingParams,
        opts: DecodeOptions | None = None,
        cancel: CancelToken | None = None,
    ) -> Iterator[DecodeEvent]:
        """Answer a conversation (``{"role", "content"}`` items) through the chat template."""
        ...
