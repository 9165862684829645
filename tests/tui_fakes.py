"""Scripted backends for the chat app tests (no model): they implement runtime.backend.Backend."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from runtime.backend import Capabilities
from runtime.config import DecodeOptions, SamplingParams
from runtime.engine import CancelToken
from runtime.engine.events import DecodeEvent, Finished
from tests.fakes import ScriptedDecoder

# (accepted draft texts, the target's own token, rejected draft texts) per verify step
BLOCKS: list[tuple[list[str], str, list[str]]] = [
    (["def", " add"], "(", ["a"]),
    (["a", ",", " b"], "):", []),
    (["\n    return"], " a", [" -", " b"]),
    ([" +", " b"], "\n", ["\n"]),
]
FIRST = "Here:\n"
ANSWER = FIRST + "".join("".join(acc) + tgt for acc, tgt, _ in BLOCKS)


def scripted_events(
    blocks: Sequence[tuple[Sequence[str], str, Sequence[str]]] = BLOCKS, first: str = FIRST, seconds: float = 0.5
) -> list[DecodeEvent]:
    """The events of a scripted generation, with a fixed total time (deterministic statistics)."""
    events = list(ScriptedDecoder(blocks, first=first).stream([1, 2, 3], SamplingParams(), None))
    last = events[-1]
    assert isinstance(last, Finished)
    stats = dataclasses.replace(
        last.stats, total_seconds=seconds, tokens_per_second=last.stats.generated_tokens / seconds
    )
    return [*events[:-1], Finished(reason=last.reason, stats=stats)]


class ReplayDecoder:
    """Replays fixed events; stops with reason "cancelled" when asked to (like the runtime).

    With a ``gate``, each event waits for one ``release()`` (the test steps the stream).
    """

    name = "replay"

    def __init__(self, events: Sequence[DecodeEvent], gate: threading.Semaphore | None = None) -> None:
        self.events = list(events)
        self.gate = gate

    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, cancel: CancelToken | None = None
    ) -> Iterator[DecodeEvent]:
        for event in self.events:
            if self.gate is not None:
                self.gate.acquire(timeout=10)
            if cancel is not None and cancel.cancelled and not isinstance(event, Finished):
                final = self.events[-1]
                assert isinstance(final, Finished)
                yield Finished(reason="cancelled", stats=final.stats)
                return
            yield event


class FakeBackend:
    """A Backend whose answers come from decoders handed out in order (the last one repeats)."""

    def __init__(self, *decoders: Any, info: dict[str, Any] | None = None) -> None:
        self.decoders = list(decoders) or [ReplayDecoder(scripted_events())]
        self.info = info or {
            "target": "tiny/target",
            "drafter": "tiny/drafter",
            "device": "cpu",
            "dtype": "float32",
            "block_size": 4,
        }
        self.calls: list[tuple[list[dict[str, str]], SamplingParams, DecodeOptions | None]] = []

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(per_token_origin=bool(self.info.get("per_token_status", True)))

    def describe(self) -> dict[str, Any]:
        return dict(self.info)

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
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        return self.stream_messages([{"role": "user", "content": text}], params, opts, cancel)

    def stream_ids(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        opts: DecodeOptions | None = None,
        cancel: CancelToken | None = None,
    ) -> Iterator[DecodeEvent]:
        return self.stream(prompt_ids, params, opts, cancel)

    def stream_messages(
        self,
        messages: Sequence[Mapping[str, str]],
        params: SamplingParams,
        opts: DecodeOptions | None = None,
        cancel: CancelToken | None = None,
    ) -> Iterator[DecodeEvent]:
        self.calls.append(([dict(m) for m in messages], params, opts))
        decoder = self.decoders[min(len(self.calls) - 1, len(self.decoders) - 1)]
        ids = list(range(1, 1 + sum(len(m["content"]) for m in messages)))
        return decoder.stream(ids, params, cancel)
