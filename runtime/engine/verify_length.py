"""How many drafts to verify per step.

On a GPU a 16-token verify costs about as much as one token, so the whole block is verified. On a
CPU the verify cost grows with its length, so the best K maximises expected tokens per second:

    E[tokens per step](K) = 1 + sum_{k=1..K} P(drafts 1..k all accepted)
    cost(K)               = t_draft + t_verify(K + 1)
    K* = argmax_K E(K) / cost(K)

``AdaptiveVerifyLength`` starts from a prior on per-position acceptance (the drafter's recorded
statistics, or a generic curve) and a cost curve (measured, or a default per device class), and
refines both while decoding: the acceptance from the verified drafts, the cost from the step times
it observes (a running median per verify length, a line fitted through them for lengths not tried
yet, and an occasional probe of the neighbouring lengths). A cost curve measured on a busy machine
therefore corrects itself within a run.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

# Relative cost of verifying n tokens vs one, by device class (n = 1..16). CPU figures are the
# measured ratios on a 2-core AVX-512 machine (docs/method.md, "Costs": 16 tokens ~1.55x of one);
# GPUs are flat over this range.
DEFAULT_COST = {
    "cpu": [1.0, 1.08, 1.16, 1.24, 1.31, 1.38, 1.45, 1.52, 1.58, 1.64, 1.70, 1.76, 1.82, 1.88, 1.94, 2.0],
    "cuda": [1.0] * 8 + [1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 1.08, 1.1],
    "mps": [1.0, 1.03, 1.06, 1.09, 1.12, 1.15, 1.18, 1.21, 1.24, 1.27, 1.3, 1.33, 1.36, 1.39, 1.42, 1.45],
}
# Generic prior P(draft k accepted | drafts 1..k-1 accepted) when a drafter records nothing.
GENERIC_CONDITIONAL = 0.7
# The adaptive policy moves to another K only when it is expected to be this much faster.
SWITCH_MARGIN = 0.01


class VerifyLengthPolicy(Protocol):
    """Chooses the number of drafts verified at each step."""

    def length(self) -> int:
        """Drafts to verify in the next step."""
        ...

    def observe(self, verified: int, accepted: int, seconds: float | None = None) -> None:
        """Record the outcome of a step (``seconds``: its wall time, when measured)."""
        ...


class FixedVerifyLength:
    """Always verify the same number of drafts."""

    def __init__(self, k: int) -> None:
        self.k = max(int(k), 0)

    def length(self) -> int:
        """The fixed K."""
        return self.k

    def observe(self, verified: int, accepted: int, seconds: float | None = None) -> None:
        """Nothing to learn."""


def running_max(costs: Sequence[float]) -> list[float]:
    """Each cost raised to the largest one before it: a longer verify never costs less."""
    out, top = [], 0.0
    for c in costs:
        top = max(top, float(c))
        out.append(top)
    return out


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


def best_length_for_costs(cumulative: Sequence[float], step_cost: Sequence[float], max_k: int) -> int:
    """K in [0, max_k] maximising expected tokens per step over ``step_cost[K]`` (any unit).

    Args:
        cumulative: P(drafts 1..k all accepted) for k = 1..; shorter lists extend with 0.
        step_cost: cost of a whole step verifying K drafts, K = 0..max_k (drafting included).
        max_k: upper bound (block size - 1).
    """
    padded = list(cumulative) + [0.0] * (max_k + 1)
    best_k, best_rate = 0, 1.0 / step_cost[0]
    for k in range(1, max_k + 1):
        rate = expected_tokens(padded, k) / step_cost[k]
        if rate > best_rate * (1 + 1e-9):
            best_k, best_rate = k, rate
    return best_k


class AdaptiveVerifyLength:
    """Pick K from step costs and per-position acceptance, both refined while decoding.

    Args:
        max_k: block size - 1.
        cost: relative verify cost per length (measured or ``DEFAULT_COST[device]``); made monotone
            (a longer verify never costs less), so a nonsense measurement cannot point below it.
        draft_cost: relative cost of one drafter forward.
        prior: prior conditional acceptance per position (P(k ok | 1..k-1 ok)); generic if None.
        prior_weight: pseudo-counts given to the acceptance prior.
        every: re-evaluate K after this many steps.
        window: timed steps kept per verify length (their median is its observed cost).
        trust: timed steps of a length after which its own median replaces the model.
    """

    def __init__(
        self,
        max_k: int,
        cost: Sequence[float],
        draft_cost: float = 0.1,
        prior: Sequence[float] | None = None,
        prior_weight: float = 20.0,
        every: int = 4,
        window: int = 16,
        trust: int = 3,
    ) -> None:
        self.max_k = max_k
        self.cost = running_max(cost)
        self.draft_cost = draft_cost
        cond = list(prior) if prior else [GENERIC_CONDITIONAL] * max_k
        cond = (cond + [cond[-1] if cond else GENERIC_CONDITIONAL] * max_k)[:max_k]
        # Beta pseudo-counts per position: successes / trials of "draft k accepted given 1..k-1 were"
        self.ok = [p * prior_weight for p in cond]
        self.tried = [prior_weight] * max_k
        self.every = every
        self.trust = trust
        self.samples: list[deque[float]] = [deque(maxlen=window) for _ in range(max_k + 1)]
        self.probe: int | None = None  # a neighbouring length to time once, at the next step
        self._flip = 0
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

    def prior_step_cost(self, k: int) -> float:
        """Relative cost of a step verifying ``k`` drafts before any step was timed."""
        return self.cost[min(k, len(self.cost) - 1)] + (self.draft_cost if k > 0 else 0.0)

    def step_costs(self) -> list[float]:
        """Estimated cost of a step verifying K = 0..max_k drafts.

        Relative units until a step is timed; then seconds: a length's own median once it has
        ``trust`` timed steps, blended before that with a line through the timed lengths (or the
        prior curve scaled to the timed steps while fewer than two lengths were timed).
        """
        ks = range(self.max_k + 1)
        timed = [(k, statistics.median(self.samples[k]), len(self.samples[k])) for k in ks if self.samples[k]]
        if not timed:
            return [self.prior_step_cost(k) for k in ks]
        scale = statistics.median(m / self.prior_step_cost(k) for k, m, _ in timed)
        line = _fit_line([(k, m, n) for k, m, n in timed if k > 0])
        floor = 0.5 * min(m for _, m, _ in timed)
        out = []
        for k in ks:
            model = line(k) if (k > 0 and line is not None) else self.prior_step_cost(k) * scale
            model = max(model, floor)
            n = len(self.samples[k])
            if n == 0:
                out.append(model)
            else:
                w = min(n, self.trust) / self.trust
                out.append(w * statistics.median(self.samples[k]) + (1 - w) * model)
        return out

    def _choose(self) -> int:
        cum, costs = self.cumulative(), self.step_costs()
        best = best_length_for_costs(cum, costs, self.max_k)
        current = getattr(self, "k", None)
        if current is None or current == best:
            return best

        def rate(k: int) -> float:
            return expected_tokens(list(cum) + [0.0] * (k + 1), k) / costs[k]

        # hysteresis: timing noise must not flip K between two lengths that are nearly as good
        return current if rate(best) < rate(current) * (1 + SWITCH_MARGIN) else best

    def length(self) -> int:
        """K for the next step (a scheduled probe, else the chosen K)."""
        return self.probe if self.probe is not None else self.k

    def observe(self, verified: int, accepted: int, seconds: float | None = None) -> None:
        """Update the estimates with one step.

        Args:
            verified: drafts verified (positions 1..accepted+1 were tested).
            accepted: drafts accepted.
            seconds: the step's wall time (drafting + verifying); None learns acceptance only.
        """
        for j in range(min(verified, accepted + 1)):
            self.tried[j] += 1
            self.ok[j] += 1 if j < accepted else 0
        if seconds is not None and seconds > 0 and 0 <= verified <= self.max_k:
            self.samples[verified].append(float(seconds))
        self.probe = None
        self._steps += 1
        if self._steps % self.every == 0:
            self.k = self._choose()
            if seconds is not None:
                self._schedule_probe()

    def _schedule_probe(self) -> None:
        """Time a neighbour of K that has too few timed steps (hill climbing on measured costs)."""
        near = [k for k in (self.k + 1, self.k - 1) if 0 <= k <= self.max_k and len(self.samples[k]) < self.trust]
        if near:
            self.probe = near[self._flip % len(near)]
            self._flip += 1


def _fit_line(points: Sequence[tuple[int, float, int]]) -> Callable[[int], float] | None:
    """Weighted least-squares line cost = a + b*k through (k, median, count); slope >= 0; None below 2 lengths."""
    if len({k for k, _, _ in points}) < 2:
        return None
    w = sum(n for _, _, n in points)
    kbar = sum(k * n for k, _, n in points) / w
    mbar = sum(m * n for _, m, n in points) / w
    var = sum(n * (k - kbar) ** 2 for k, _, n in points)
    slope = max(sum(n * (k - kbar) * (m - mbar) for k, m, n in points) / var, 0.0) if var > 0 else 0.0
    return lambda k: mbar + slope * (k - kbar)
