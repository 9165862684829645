"""Acceptance in speculative decoding: the acceptance rule (``accept_prefix``) and the one
place where acceptance statistics (per-slot rates, histogram, tau, acceptance rate) are computed,
from raw counts (``AcceptanceCounts``). Events and ``GenerationStats`` carry raw counts; the
decode loop, bench, the TUI, the remote client and the tests all derive from here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def accept_prefix(draft_ids: Sequence[int], posterior_ids: Sequence[int]) -> int:
    """Length of the leading run where the draft equals the target's choice.

    ``draft_ids[i]`` is the proposal for block slot ``i + 1``; ``posterior_ids[i]`` is the
    target's token (argmax or sample) after seeing slots ``0..i``. The draft is accepted while
    ``draft_ids[i] == posterior_ids[i]`` (z-lab's ``cumprod`` rule). With a deterministic draft
    and a sampled posterior this is exact rejection sampling with a one-hot proposal.

    Args:
        draft_ids: K drafted ids.
        posterior_ids: at least K target choices (K + 1 in the decode loop).

    Returns:
        a in [0, K].
    """
    a = 0
    for d, p in zip(draft_ids, posterior_ids, strict=False):
        if d != p:
            break
        a += 1
    return a


@dataclass(frozen=True)
class AcceptanceCounts:
    """Raw acceptance counts of verify steps; every statistic derives from them (one place).

    Attributes:
        steps: target verify steps (or decoding steps of a method that does not draft).
        drafted: drafts proposed to the target.
        accepted: drafts the target accepted.
        committed: tokens those steps committed (accepted drafts plus the target's own token).
        slot_tried: per draft slot k (index k-1), steps that verified slot k.
        slot_accepted: per draft slot k, steps in which drafts 1..k were all accepted.
        histogram: entry i counts steps that accepted exactly i drafts.
    """

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    slot_tried: tuple[int, ...] = ()
    slot_accepted: tuple[int, ...] = ()
    histogram: tuple[int, ...] = ()

    @property
    def tau(self) -> float:
        """Mean tokens committed per step, bonus included (1.0 with no steps)."""
        return self.committed / self.steps if self.steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted (0.0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_position(self) -> tuple[float, ...]:
        """Per draft slot, the share of steps that verified it in which it was accepted."""
        return tuple(
            ok / tried if tried else 0.0 for ok, tried in zip(self.slot_accepted, self.slot_tried, strict=True)
        )

    def __add__(self, other: AcceptanceCounts) -> AcceptanceCounts:
        return AcceptanceCounts(
            self.steps + other.steps,
            self.drafted + other.drafted,
            self.accepted + other.accepted,
            self.committed + other.committed,
            _add(self.slot_tried, other.slot_tried),
            _add(self.slot_accepted, other.slot_accepted),
            _add(self.histogram, other.histogram),
        )

    def padded(self, slots: int) -> AcceptanceCounts:
        """The same counts with at least ``slots`` draft slots (zeros appended)."""
        return self + AcceptanceCounts(
            slot_tried=(0,) * slots, slot_accepted=(0,) * slots, histogram=(0,) * (slots + 1)
        )

    @classmethod
    def from_totals(
        cls,
        steps: int,
        drafted: int,
        accepted: int,
        histogram: Sequence[int] = (),
        slot_accepted: Sequence[int] | None = None,
    ) -> AcceptanceCounts:
        """Counts as a server reports them: totals, maybe a histogram, maybe per-slot acceptance
        counts, from steps that each verified every slot. Without ``slot_accepted``, the per-slot
        counts follow from the histogram (slot k was accepted in the steps that accepted >= k)."""
        hist = tuple(int(h) for h in histogram)
        if slot_accepted is None:
            slot_accepted = [sum(hist[k:]) for k in range(1, len(hist))]
        ok = tuple(int(x) for x in slot_accepted)
        return cls(steps, drafted, accepted, accepted + steps, (steps,) * len(ok), ok, hist)

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form (lists instead of tuples)."""
        return {
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "committed": self.committed,
            "slot_tried": list(self.slot_tried),
            "slot_accepted": list(self.slot_accepted),
            "histogram": list(self.histogram),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> AcceptanceCounts:
        """Inverse of ``to_json`` (missing keys are zero)."""

        def ints(key: str) -> tuple[int, ...]:
            return tuple(int(x) for x in d.get(key) or ())

        return cls(
            steps=int(d.get("steps") or 0),
            drafted=int(d.get("drafted") or 0),
            accepted=int(d.get("accepted") or 0),
            committed=int(d.get("committed") or 0),
            slot_tried=ints("slot_tried"),
            slot_accepted=ints("slot_accepted"),
            histogram=ints("histogram"),
        )


class AcceptanceCounter:
    """Mutable accumulator of ``AcceptanceCounts``, one verify step at a time."""

    def __init__(self, slots: int = 0) -> None:
        self.steps = self.drafted = self.accepted = self.committed = 0
        self.slot_tried = [0] * slots
        self.slot_accepted = [0] * slots
        self.histogram = [0] * (slots + 1)

    def _grow(self, slots: int) -> None:
        for seq, n in ((self.slot_tried, slots), (self.slot_accepted, slots), (self.histogram, slots + 1)):
            seq.extend([0] * (n - len(seq)))

    def record(self, drafted: int, accepted: int, committed: int | None = None, depth: int | None = None) -> None:
        """One verify step: ``drafted`` proposals, ``accepted`` of them kept, ``committed`` tokens
        (default ``accepted + 1``: the accepted drafts and the target's own token). For a draft tree,
        ``drafted`` counts its nodes and ``depth`` its deepest level: the slots that were tested, the
        accepted count being the accepted depth."""
        slots = drafted if depth is None else depth
        self._grow(slots)
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.committed += accepted + 1 if committed is None else committed
        for k in range(slots):
            self.slot_tried[k] += 1
            self.slot_accepted[k] += int(k < accepted)
        self.histogram[accepted] += 1

    def counts(self) -> AcceptanceCounts:
        """The totals so far, frozen."""
        return AcceptanceCounts(
            self.steps,
            self.drafted,
            self.accepted,
            self.committed,
            tuple(self.slot_tried),
            tuple(self.slot_accepted),
            tuple(self.histogram),
        )


def _add(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    n = max(len(a), len(b))
    return tuple((a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n))
