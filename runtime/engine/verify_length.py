"""How many drafts to verify per step.

On a GPU a 16-token verify costs about as much as one token, so the whole block is verified. On a
CPU the verify cost grows with its length, so the best K maximises expected tokens per second:

    E[tokens per step](K) = 1 + sum_{k=1..K} P(drafts 1..k all accepted)
    cost(K)               = t_draft + t_verify(K + 1)
    K* = argmax_K E(K) / cost(K)

``AdaptiveVerifyLength`` starts from a prior on per-position acceptance (the drafter's recorded
statistics, or a generic curve) and a cost curve (measured, or a default per device class), and
refines the acceptance estimate from the running statistics.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Relative cost of verifying n tokens vs one, by device class (n = 1..16). CPU figures are the
# measured ratios on a 2-core AVX-512 machine (TRAINING-NOTES.md: 16 tokens ~1.55x of one);
# GPUs are flat over this range.
DEFAULT_COST = {
    "cpu": [1.0, 1.08, 1.16, 1.24, 1.31, 1.38, 1.45, 1.52, 1.58, 1.64, 1.70, 1.76, 1.82, 1.88, 1.94, 2.0],
    "cuda": [1.0] * 8 + [1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 1.08, 1.1],
    "mps": [1.0, 1.03, 1.06, 1.09, 1.12, 1.15, 1.18, 1.21, 1.24, 1.27, 1.3, 1.33, 1.36, 1.39, 1.42, 1.45],
}
# Generic prior P(draft k accepted | drafts 1..k-1 accepted) when a drafter records nothing.
GENERIC_CONDITIONAL = 0.7


class VerifyLengthPolicy(Protocol):
    """Chooses the number of drafts verified at each step."""

    def length(self) -> int:
        """Drafts to verify in the next step."""
        ...

    def observe(self, verified: int, accepted: int) -> None:
        """Record the outcome of a step."""
        ...


class FixedVerifyLength:
    """Always verify the same number of drafts."""

    def __init__(self, k: int) -> None:
        self.k = max(int(k), 0)

    def length(self) -> int:
        """The fixed K."""
        return self.k

    def observe(self, verified: int, accepted: int) -> None:
        """Nothing to learn."""


def expected_tokens(cumulative: Sequence[float], k: int) -> float:
    """1 + sum of P(first j drafts accepted) for j = 1..k."""
    return 1.0 + sum(cumulative[:k])


def best_length(cumulative: Sequence[float], cost: Sequence[float], draft_cost: float, max_k: int) -> int:
    """K in [0, max_k] maximising expected tokens per unit time.

    Args:
        cumulative: P(drafts 1..k all accepted) for k = 1..; shorter lists extend with 0.
        cost: relative verify cost of n = 1.. tokens (cost[0] = one token).
        draft_cost: relative cost of one drafter forward (paid when K > 0).
        max_k: upper bound (block size - 1).
    """
    best_k, best_rate = 0, 1.0 / cost[0]
    for k in range(1, max_k + 1):
        c = (cost[min(k, len(cost) - 1)]) + draft_cost
        rate = expected_tokens(list(cumulative) + [0.0] * k, k) / c
        if rate > best_rate + 1e-9:
            best_k, best_rate = k, rate
    return best_k


class AdaptiveVerifyLength:
    """Pick K from verify costs and per-position acceptance, refined while decoding.

    Args:
        max_k: block size - 1.
        cost: relative verify cost per length (measured or ``DEFAULT_COST[device]``).
        draft_cost: relative cost of one drafter forward.
        prior: prior conditional acceptance per position (P(k ok | 1..k-1 ok)); generic if None.
        prior_weight: pseudo-counts given to the prior.
        every: re-evaluate K after this many steps.
    """

    def __init__(
        self,
        max_k: int,
        cost: Sequence[float],
        draft_cost: float = 0.1,
        prior: Sequence[float] | None = None,
        prior_weight: float = 20.0,
        every: int = 8,
    ) -> None:
        self.max_k = max_k
        self.cost = list(cost)
        self.draft_cost = draft_cost
        cond = list(prior) if prior else [GENERIC_CONDITIONAL] * max_k
        cond = (cond + [cond[-1] if cond else GENERIC_CONDITIONAL] * max_k)[:max_k]
        # Beta pseudo-counts per position: successes / trials of "draft k accepted given 1..k-1 were"
        self.ok = [p * prior_weight for p in cond]
        self.tried = [prior_weight] * max_k
        self.every = every
        self._steps = 0
        self.k = self._choose()

    def conditional(self) -> list[float]:
        """Current estimate of P(draft k accepted | drafts 1..k-1 accepted)."""
        return [o / t if t else 0.0 for o, t in zip(self.ok, self.tried, strict=True)]

    def cumulative(self) -> list[float]:
        """Current estimate of P(drafts 1..k all accepted)."""
        out, p = [], 1.0
        for c in self.conditional():
            p *= c
            out.append(p)
        return out

    def _choose(self) -> int:
        return best_length(self.cumulative(), self.cost, self.draft_cost, self.max_k)

    def length(self) -> int:
        """K for the next step."""
        return self.k

    def observe(self, verified: int, accepted: int) -> None:
        """Update the per-position estimates with one step (positions 1..accepted+1 were tested)."""
        for j in range(min(verified, accepted + 1)):
            self.tried[j] += 1
            self.ok[j] += 1 if j < accepted else 0
        self._steps += 1
        if self._steps % self.every == 0:
            self.k = self._choose()
