"""Live statistics of one generation and totals of a chat session, computed from runtime events.

Pure Python (no Textual): the stats bar renders what these objects say. While a generation runs,
values come from the events seen so far (device-synchronised seconds carried by the events);
when ``Finished`` arrives, the runtime's own ``GenerationStats`` replace the live estimates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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


def _add_into(total: list[int], part: Sequence[int]) -> None:
    if len(part) > len(total):
        total.extend([0] * (len(part) - len(total)))
    for i, v in enumerate(part):
        total[i] += v


@dataclass
class GenerationTracker:
    """Statistics of one generation, updated per event.

    Attributes:
        slots: draft slots per block (block size - 1) the bars show; grows if a block drafts more.
        origin: the events say what was drafted and accepted (False for servers that stream plain
            text: their blocks are text chunks, and the speculative counts come from the final stats).
        prompt_tokens: prompt length (from ``PrefillDone``).
        ttft: time to first token in seconds.
        seconds: device time so far (prefill + every verify step).
        generated: committed tokens so far.
        steps: verify steps so far.
        drafted: drafts proposed so far.
        accepted: drafts accepted so far.
        pos_tried, pos_ok: per draft slot, steps that verified the slot and steps that accepted it.
        hist: entry i counts steps that accepted exactly i drafts.
        final: the runtime's stats once ``Finished`` arrived.
        reason: the finish reason once known.
    """

    slots: int = 0
    origin: bool = True
    prompt_tokens: int = 0
    ttft: float = 0.0
    seconds: float = 0.0
    generated: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    pos_tried: list[int] = field(default_factory=list)
    pos_ok: list[int] = field(default_factory=list)
    hist: list[int] = field(default_factory=list)
    final: GenerationStats | None = None
    reason: str | None = None

    def __post_init__(self) -> None:
        self._grow(self.slots)

    def _grow(self, slots: int) -> None:
        self.slots = max(self.slots, slots)
        for seq, n in ((self.pos_tried, self.slots), (self.pos_ok, self.slots), (self.hist, self.slots + 1)):
            seq.extend([0] * (n - len(seq)))

    def update(self, event: DecodeEvent) -> None:
        """Fold one event in."""
        if isinstance(event, PrefillDone):
            self.prompt_tokens = event.prompt_tokens
            self.ttft = event.seconds
            self.seconds += event.seconds
            self.generated += len(event.tokens)
        elif isinstance(event, BlockVerified):
            self.seconds += event.seconds
            self.generated += len(event.tokens)
            if not self.origin:  # a chunk of text, not a verify step
                return
            k, a = len(event.draft), event.accepted
            depth = event.depth  # a draft tree tests its depth (its nodes are all drafted)
            self._grow(depth)
            self.steps += 1
            self.drafted += k
            self.accepted += a
            self.hist[a] += 1
            for j in range(depth):
                self.pos_tried[j] += 1
                self.pos_ok[j] += int(j < a)
        elif isinstance(event, Finished):
            self.final = event.stats
            self.reason = event.reason
            self._grow(max(event.stats.block_size - 1, 0))
            if not self.origin:
                self._counts_from(event.stats)

    def _counts_from(self, s: GenerationStats) -> None:
        """Per-step counts from a server's final statistics (what the session totals add up)."""
        self.steps, self.drafted, self.accepted = s.verify_steps, s.drafted_tokens, s.accepted_tokens
        self._grow(max(len(s.per_position_acceptance), len(s.acceptance_histogram) - 1, 0))
        self.pos_tried = [s.verify_steps if j < len(s.per_position_acceptance) else 0 for j in range(self.slots)]
        self.pos_ok = [round(p * s.verify_steps) for p in s.per_position_acceptance]
        self.pos_ok += [0] * (self.slots - len(self.pos_ok))
        self.hist = list(s.acceptance_histogram) + [0] * (self.slots + 1 - len(s.acceptance_histogram))

    @property
    def done(self) -> bool:
        """True once ``Finished`` arrived."""
        return self.final is not None

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
    def tau_known(self) -> bool:
        """True when there are verify steps to count (a server without statistics reports none)."""
        return self.steps > 0 or (self.final is not None and self.final.verify_steps > 0)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify step, bonus included."""
        if self.final is not None:
            return self.final.tau
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens."""
        if self.final is not None:
            return self.final.acceptance_rate
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_position(self) -> list[float]:
        """Per draft slot, the share of steps that verified it in which it was accepted."""
        if self.final is not None and self.final.per_position_acceptance:
            values = list(self.final.per_position_acceptance)
            return values + [0.0] * (self.slots - len(values))
        return [o / t if t else 0.0 for o, t in zip(self.pos_ok, self.pos_tried, strict=True)]

    @property
    def histogram(self) -> list[int]:
        """Steps per acceptance length (0..slots)."""
        if self.final is not None and self.final.acceptance_histogram:
            values = list(self.final.acceptance_histogram)
            return values + [0] * (self.slots + 1 - len(values))
        return list(self.hist)

    @property
    def generated_tokens(self) -> int:
        """Committed tokens."""
        return self.final.generated_tokens if self.final is not None else self.generated

    @property
    def total_seconds(self) -> float:
        """Wall time of the generation (device time so far while running)."""
        return self.final.total_seconds if self.final is not None else self.seconds

    def to_json(self) -> dict[str, Any]:
        """What the session store keeps: the runtime's stats plus the per-slot counts."""
        out: dict[str, Any] = self.final.to_json() if self.final is not None else {}
        out.update(
            {
                "reason": self.reason,
                "pos_tried": list(self.pos_tried),
                "pos_ok": list(self.pos_ok),
                "hist": list(self.hist),
                "steps": self.steps,
                "drafted": self.drafted,
                "accepted": self.accepted,
            }
        )
        return out


@dataclass
class SessionTotals:
    """Totals over the finished generations of a chat session."""

    generations: int = 0
    generated: int = 0
    seconds: float = 0.0
    ttft_sum: float = 0.0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    pos_tried: list[int] = field(default_factory=list)
    pos_ok: list[int] = field(default_factory=list)
    hist: list[int] = field(default_factory=list)

    def add(self, gen: GenerationTracker) -> None:
        """Fold a finished generation in."""
        self.add_record(gen.to_json())

    def add_record(self, rec: dict[str, Any]) -> None:
        """Fold a stored record (``GenerationTracker.to_json``) in."""
        self.generations += 1
        self.generated += int(rec.get("generated_tokens", 0))
        self.seconds += float(rec.get("total_seconds", 0.0))
        self.ttft_sum += float(rec.get("ttft_seconds", 0.0))
        self.steps += int(rec.get("steps", rec.get("verify_steps", 0)))
        self.drafted += int(rec.get("drafted", rec.get("drafted_tokens", 0)))
        self.accepted += int(rec.get("accepted", rec.get("accepted_tokens", 0)))
        _add_into(self.pos_tried, rec.get("pos_tried", []))
        _add_into(self.pos_ok, rec.get("pos_ok", []))
        _add_into(self.hist, rec.get("hist", []))

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
        """Mean tokens committed per verify step over the session."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted over the session."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_position(self) -> list[float]:
        """Per draft slot acceptance over the session."""
        return [o / t if t else 0.0 for o, t in zip(self.pos_ok, self.pos_tried, strict=False)]

    @property
    def histogram(self) -> list[int]:
        """Steps per acceptance length over the session."""
        return list(self.hist)
