"""Live statistics of one generation and totals of a chat session, computed from runtime events.

Pure Python (no Textual): the stats bar renders what these objects say. While a generation runs,
values come from the events seen so far (device-synchronised seconds carried by the events);
when ``Finished`` arrives, the runtime's own ``GenerationStats`` replace the live estimates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.engine.acceptance import AcceptanceCounter, AcceptanceCounts
from runtime.engine.events import BlockVerified, DecodeEvent, Finished, GenerationStats, PrefillDone

BARS = " ▁▂▃▄▅▆▇█"


def bar(value: float) -> str:
    """One cell whose height shows ``value`` in [0, 1] (blank for 0, full block for 1)."""
    value = min(max(value, 0.0), 1.0)
    return BARS[round(value * (len(BARS) - 1))]


def bars(values: Sequence[float]) -> str:
    """One cell per value in [0, 1]."""
    return "".join(bar(v) for v in values)


def histogram_bars(counts: Sequence[int]) -> str:
    """One cell per count, scaled to the largest count (a count > 0 is never blank)."""
    top = max(counts, default=0)
    if top <= 0:
        return " " * len(counts)
    lowest = 1 / (len(BARS) - 1)
    return "".join(" " if c <= 0 else bar(max(c / top, lowest)) for c in counts)


@dataclass
class GenerationTracker:
    """Statistics of one generation, updated per event (the counting itself is
    ``runtime.engine.acceptance``'s).

    Attributes:
        slots: draft slots per block (block size - 1) the bars show; grows if a block drafts more.
        origin: the events say what was drafted and accepted (False for servers that stream plain
            text: their blocks are text chunks, and the speculative counts come from the final stats).
        prompt_tokens: prompt length (from ``PrefillDone``).
        tokens_cached: leading prompt tokens the prompt cache held (not read again).
        ttft: time to first token in seconds.
        seconds: device time so far (prefill + every verify step).
        generated: committed tokens so far.
        live: acceptance counts of the verify steps seen so far.
        final: the runtime's stats once ``Finished`` arrived (its counts replace the live ones).
        reason: the finish reason once known.
    """

    slots: int = 0
    origin: bool = True
    prompt_tokens: int = 0
    tokens_cached: int = 0
    ttft: float = 0.0
    seconds: float = 0.0
    generated: int = 0
    live: AcceptanceCounter = field(default_factory=AcceptanceCounter)
    final: GenerationStats | None = None
    reason: str | None = None

    def update(self, event: DecodeEvent) -> None:
        """Fold one event in."""
        if isinstance(event, PrefillDone):
            self.prompt_tokens = event.prompt_tokens
            self.tokens_cached = event.tokens_cached
            self.ttft = event.seconds
            self.seconds += event.seconds
            self.generated += len(event.tokens)
        elif isinstance(event, BlockVerified):
            self.seconds += event.seconds
            self.generated += len(event.tokens)
            if self.origin:  # else a chunk of text, not a verify step
                self.live.record(len(event.draft), event.accepted, depth=event.depth)  # a tree tests its depth
        elif isinstance(event, Finished):
            self.final = event.stats
            self.reason = event.reason
            self.slots = max(self.slots, event.stats.block_size - 1)

    @property
    def counts(self) -> AcceptanceCounts:
        """Acceptance counts: the runtime's once finished, else those seen so far (padded to ``slots``)."""
        counts = self.final.acceptance if self.final is not None else self.live.counts()
        return counts.padded(self.slots)

    @property
    def done(self) -> bool:
        """True once ``Finished`` arrived."""
        return self.final is not None

    @property
    def drafted(self) -> int:
        """Drafts proposed so far."""
        return self.counts.drafted

    @property
    def tokens_per_second(self) -> float:
        """End-to-end tokens per second (the runtime's figure once finished)."""
        if self.final is not None:
            return self.final.tokens_per_second
        return self.generated / self.seconds if self.seconds > 0 else 0.0

    @property
    def ttft_seconds(self) -> float:
        """Time to first token."""
        return self.final.ttft_seconds if self.final is not None else self.ttft

    @property
    def copied(self) -> int:
        """Accepted tokens that only the context lookup proposed (known once finished; 0 without it)."""
        return int(getattr(self.final, "copied_tokens", 0) or 0)

    @property
    def tau_known(self) -> bool:
        """True when there are verify steps to count (a server without statistics reports none)."""
        return self.counts.steps > 0

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify step, bonus included (0.0 before the first step)."""
        counts = self.counts
        return counts.tau if counts.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens."""
        return self.counts.acceptance_rate

    @property
    def per_position(self) -> list[float]:
        """Per draft slot, the share of steps that verified it in which it was accepted."""
        return list(self.counts.per_position)

    @property
    def histogram(self) -> list[int]:
        """Steps per acceptance length (0..slots)."""
        return list(self.counts.histogram)

    @property
    def generated_tokens(self) -> int:
        """Committed tokens."""
        return self.final.generated_tokens if self.final is not None else self.generated

    @property
    def total_seconds(self) -> float:
        """Wall time of the generation (device time so far while running)."""
        return self.final.total_seconds if self.final is not None else self.seconds

    def to_json(self) -> dict[str, Any]:
        """What the session store keeps: the runtime's stats (with their raw ``acceptance``
        counts) plus the reason and, for stores written before the counts, their old keys."""
        out: dict[str, Any] = self.final.to_json() if self.final is not None else {}
        counts = self.counts
        out.update(
            {
                "reason": self.reason,
                "acceptance": counts.to_json(),
                "pos_tried": list(counts.slot_tried),
                "pos_ok": list(counts.slot_accepted),
                "hist": list(counts.histogram),
                "steps": counts.steps,
                "drafted": counts.drafted,
                "accepted": counts.accepted,
            }
        )
        return out


def record_counts(rec: Mapping[str, Any]) -> AcceptanceCounts:
    """The acceptance counts of a stored record (``GenerationTracker.to_json``; older records
    kept per-slot counts under ``pos_tried``/``pos_ok``/``hist``)."""
    if isinstance(rec.get("acceptance"), Mapping):
        return AcceptanceCounts.from_json(rec["acceptance"])
    steps = int(rec.get("steps", rec.get("verify_steps", 0)) or 0)
    accepted = int(rec.get("accepted", rec.get("accepted_tokens", 0)) or 0)
    return AcceptanceCounts(
        steps=steps,
        drafted=int(rec.get("drafted", rec.get("drafted_tokens", 0)) or 0),
        accepted=accepted,
        committed=accepted + steps,
        slot_tried=tuple(int(x) for x in rec.get("pos_tried") or ()),
        slot_accepted=tuple(int(x) for x in rec.get("pos_ok") or ()),
        histogram=tuple(int(x) for x in rec.get("hist") or ()),
    )


@dataclass
class SessionTotals:
    """Totals over the finished generations of a chat session."""

    generations: int = 0
    generated: int = 0
    seconds: float = 0.0
    ttft_sum: float = 0.0
    counts: AcceptanceCounts = AcceptanceCounts()

    def add(self, gen: GenerationTracker) -> None:
        """Fold a finished generation in."""
        self.add_record(gen.to_json())

    def add_record(self, rec: Mapping[str, Any]) -> None:
        """Fold a stored record (``GenerationTracker.to_json``) in."""
        self.generations += 1
        self.generated += int(rec.get("generated_tokens", 0))
        self.seconds += float(rec.get("total_seconds", 0.0))
        self.ttft_sum += float(rec.get("ttft_seconds", 0.0))
        self.counts = self.counts + record_counts(rec)

    @property
    def steps(self) -> int:
        """Verify steps over the session."""
        return self.counts.steps

    @property
    def drafted(self) -> int:
        """Drafts over the session."""
        return self.counts.drafted

    @property
    def tokens_per_second(self) -> float:
        """All generated tokens / all generation time."""
        return self.generated / self.seconds if self.seconds > 0 else 0.0

    @property
    def ttft_seconds(self) -> float:
        """Mean time to first token."""
        return self.ttft_sum / self.generations if self.generations else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify step over the session (0.0 before the first step)."""
        return self.counts.tau if self.counts.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted over the session."""
        return self.counts.acceptance_rate

    @property
    def per_position(self) -> list[float]:
        """Per draft slot acceptance over the session."""
        return list(self.counts.per_position)

    @property
    def histogram(self) -> list[int]:
        """Steps per acceptance length over the session."""
        return list(self.counts.histogram)
