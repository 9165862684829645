"""The decoder protocol shared by plain autoregressive decoding and DFlash, plus the statistics
accumulator both use.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Protocol

from runtime.config import SamplingParams
from runtime.engine.acceptance import AcceptanceCounter
from runtime.engine.events import DecodeEvent, GenerationStats


class CancelToken:
    """Thread-safe flag a consumer sets to stop a generation between verify steps."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        """Ask the running generation to stop; it finishes with reason "cancelled"."""
        self._event.set()

    @property
    def cancelled(self) -> bool:
        """True once ``cancel`` was called."""
        return self._event.is_set()


class Decoder(Protocol):
    """Anything that turns prompt ids into a typed event stream."""

    name: str
    block_size: int  # drafts per block plus one (1 for plain decoding)

    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, cancel: CancelToken | None = None
    ) -> Iterator[DecodeEvent]:
        """Generate from ``prompt_ids``.

        Yields:
            ``PrefillDone``, then ``BlockVerified`` per verify step, then ``Finished``.
        """
        ...


class StatsRecorder:
    """Accumulates per-step acceptance (``AcceptanceCounter``) and timings into ``GenerationStats``."""

    def __init__(
        self, prompt_tokens: int, block_size: int, decoder: str, tree_budget: int = 0, lookup: int = 0
    ) -> None:
        self.t0 = time.perf_counter()
        self.tree_budget = tree_budget
        self.lookup = lookup
        self.copied = 0
        self.cached = 0  # prompt tokens taken from the prompt cache
        self.prompt_tokens = prompt_tokens
        self.block_size = block_size
        self.decoder = decoder
        self.ttft = 0.0
        self.generated = 0
        self.verify_length = 0
        self.acceptance = AcceptanceCounter(slots=max(block_size - 1, 0))

    def prefill(self, seconds: float, committed: int) -> None:
        """Record time to first token and the first token(s)."""
        self.ttft = seconds
        self.generated += committed

    def step(self, drafted: int, accepted: int, committed: int, planned: int, depth: int | None = None) -> None:
        """Record one verify step: ``drafted`` proposals, ``accepted`` of them, ``committed`` new tokens;
        ``planned`` is the verify length the policy chose (before the length limit cut it). For a
        draft tree, ``drafted`` counts its nodes, ``depth`` is its deepest level (the slots it tested)
        and ``accepted`` the accepted depth."""
        self.acceptance.record(drafted, accepted, depth=depth)
        self.generated += committed
        self.verify_length = planned

    def finish(self) -> GenerationStats:
        """Freeze the totals."""
        total = time.perf_counter() - self.t0
        decode_time = max(total - self.ttft, 1e-9)
        return GenerationStats(
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated,
            ttft_seconds=self.ttft,
            total_seconds=total,
            tokens_per_second=self.generated / max(total, 1e-9),
            decode_tokens_per_second=max(self.generated - 1, 0) / decode_time,
            acceptance=self.acceptance.counts(),
            block_size=self.block_size,
            verify_length=self.verify_length,
            decoder=self.decoder,
            tree_budget=self.tree_budget,
            lookup=self.lookup,
            copied_tokens=self.copied,
            tokens_cached=self.cached,
        )
