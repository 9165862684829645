"""The decoder protocol shared by plain autoregressive decoding and DFlash, plus the statistics
accumulator both use.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Protocol

from runtime.config import SamplingParams
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

    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, cancel: CancelToken | None = None
    ) -> Iterator[DecodeEvent]:
        """Generate from ``prompt_ids``.

        Yields:
            ``PrefillDone``, then ``BlockVerified`` per verify step, then ``Finished``.
        """
        ...


class StatsRecorder:
    """Accumulates per-step acceptance and timings into ``GenerationStats``."""

    def __init__(self, prompt_tokens: int, block_size: int, decoder: str, tree_budget: int = 0) -> None:
        self.t0 = time.perf_counter()
        self.tree_budget = tree_budget
        self.prompt_tokens = prompt_tokens
        self.block_size = block_size
        self.decoder = decoder
        self.ttft = 0.0
        self.generated = 0
        self.steps = 0
        self.drafted = 0
        self.accepted = 0
        self.committed_in_steps = 0
        self.verify_length = 0
        slots = max(block_size - 1, 0)
        self.pos_tried = [0] * slots
        self.pos_ok = [0] * slots
        self.hist = [0] * (slots + 1)

    def prefill(self, seconds: float, committed: int) -> None:
        """Record time to first token and the first token(s)."""
        self.ttft = seconds
        self.generated += committed

    def step(self, drafted: int, accepted: int, committed: int, planned: int, depth: int | None = None) -> None:
        """Record one verify step: ``drafted`` proposals, ``accepted`` of them, ``committed`` new tokens;
        ``planned`` is the verify length the policy chose (before the length limit cut it). For a
        draft tree, ``drafted`` counts its nodes, ``depth`` is its deepest level (the slots it tested)
        and ``accepted`` the accepted depth."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.generated += committed
        self.committed_in_steps += accepted + 1
        self.verify_length = planned
        for k in range(drafted if depth is None else depth):
            if k < len(self.pos_tried):
                self.pos_tried[k] += 1
                self.pos_ok[k] += int(k < accepted)
        if accepted < len(self.hist):
            self.hist[accepted] += 1

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
            verify_steps=self.steps,
            drafted_tokens=self.drafted,
            accepted_tokens=self.accepted,
            tau=self.committed_in_steps / self.steps if self.steps else 1.0,
            acceptance_rate=self.accepted / self.drafted if self.drafted else 0.0,
            per_position_acceptance=tuple(
                ok / tried if tried else 0.0 for ok, tried in zip(self.pos_ok, self.pos_tried, strict=True)
            ),
            acceptance_histogram=tuple(self.hist),
            block_size=self.block_size,
            verify_length=self.verify_length,
            decoder=self.decoder,
            tree_budget=self.tree_budget,
        )
