"""The confidence cut: each step keeps only the draft-tree nodes worth their verify cost, judged by
the drafter's own (calibrated) confidence in each candidate. See ``ConfidenceCut``."""

from __future__ import annotations

import math
from collections.abc import Sequence

from runtime.engine.costs import running_max
from runtime.engine.tree import DraftTree

RANKS = 8  # candidates per slot the calibration and the rank statistics track

# The confidence cut's calibration: the drafter's probability of a candidate in CAL_BINS equal bins,
# each with CAL_PRIOR pseudo-observations at the bin's centre (a calibrated drafter needs no correction).
CAL_BINS = 10
CAL_PRIOR = 4.0
# pseudo-steps given to the plan's modelled throughput before measured steps take over
RATE_PRIOR = 8.0


def _bin(logprob: float) -> int:
    p = math.exp(min(float(logprob), 0.0))
    return min(int(p * CAL_BINS), CAL_BINS - 1)


class HitRates:
    """How often the target picks a drafted candidate, by the drafter's probability for it.

    Two tables of CAL_BINS bins: argmax candidates (P(accepted | path accepted)) and runner-ups
    (P(the target picks this one | path accepted)). One object may serve many requests (a pipeline
    keeps one per loaded pair), so a session's later requests start calibrated.
    """

    def __init__(self) -> None:
        prior = [CAL_PRIOR * (b + 0.5) / CAL_BINS for b in range(CAL_BINS)]
        self.top_ok, self.top_tried = list(prior), [CAL_PRIOR] * CAL_BINS
        self.other_ok, self.other_tried = list(prior), [CAL_PRIOR] * CAL_BINS

    def top(self, logprob: float) -> float:
        """Calibrated P(an argmax draft is accepted | the path to it was)."""
        b = _bin(logprob)
        return self.top_ok[b] / self.top_tried[b]

    def other(self, logprob: float) -> float:
        """Calibrated P(the target picks a runner-up candidate | its path was accepted)."""
        b = _bin(logprob)
        return self.other_ok[b] / self.other_tried[b]

    def record(self, logprob: float, runner_up: bool, hit: bool) -> None:
        """One observation: a candidate of this log-probability was (not) the target's choice."""
        b = _bin(logprob)
        if runner_up:
            self.other_tried[b] += 1
            self.other_ok[b] += 1 if hit else 0
        else:
            self.top_tried[b] += 1
            self.top_ok[b] += 1 if hit else 0


class ConfidenceCut:
    """Per-step tree size from the drafter's confidence in each candidate.

    The drafter scores every slot of the block in one forward before anything is verified, so each
    step knows how sure it is of each draft. A node of the best-first draft tree is on the target's
    path with probability ``prod q(p)`` over its path, p the drafter's probability of each token on
    it and q calibrated online per probability bin from the target's choices (``HitRates``: one
    table for argmax candidates, one for runner-ups). The step keeps the first n nodes maximising

        1 + sum_{i<=n} P(node i on the target's path)  -  lambda * cost[n]

    where lambda is the decoder's throughput (tokens per unit of relative cost, from the plan's model
    at first, then from the steps taken): a node is worth its verify cost when the tokens it is
    expected to add beat what that time would produce on average. Confident stretches (boilerplate,
    a name being repeated) get deep chains, uncertain ones a few shallow alternatives or none: more
    tokens per step for the same cost where a fixed plan over- or under-verifies. The drafter forward
    is already paid, so it does not enter the choice.

    Args:
        cost: relative verify cost of n = 1.. tokens.
        rate: the initial throughput (tokens per unit of relative cost).
        calibration: a shared calibration (a new one if None).
        draft_cost: relative cost of one drafter forward (counted into the throughput of drafted steps).
    """

    def __init__(
        self, cost: Sequence[float], rate: float, calibration: HitRates | None = None, draft_cost: float = 0.0
    ) -> None:
        self.cost = running_max(cost)
        self.draft_cost = draft_cost
        self.calibration = calibration if calibration is not None else HitRates()
        self.tokens = RATE_PRIOR * rate
        self.spent = RATE_PRIOR

    def accept_prob(self, logprob: float) -> float:
        """Calibrated P(the draft is accepted | the path to it was) for a top-1 log-probability."""
        return self.calibration.top(logprob)

    def other_prob(self, logprob: float) -> float:
        """Calibrated P(the target picks a runner-up candidate | its path was accepted)."""
        return self.calibration.other(logprob)

    @property
    def rate(self) -> float:
        """Current throughput estimate (tokens per unit of relative cost)."""
        return self.tokens / self.spent

    def tree_size(self, vals: Sequence[Sequence[float]], tree: DraftTree) -> int:
        """Drafted nodes to keep of a best-first tree (its first n nodes, n in 0..len(tree) - 1).

        A node is on the target's path with probability prod q over its path: ``q`` of the top-1
        calibration for argmax nodes, of the runner-up calibration for the others.

        Args:
            vals: [D][w] the drafter's log-probabilities of each slot's candidates, best first.
            tree: the best-first tree built from them (parents precede children).
        """
        lam = self.rate
        probs = [1.0]
        best_n, best, e = 0, 1.0 - lam * self.cost[0], 1.0
        for i in range(1, len(tree)):
            if i >= len(self.cost):
                break
            d, r = tree.depths[i], tree.ranks[i]
            q = self.accept_prob(vals[d - 1][r]) if r == 0 else self.other_prob(vals[d - 1][r])
            probs.append(probs[tree.parents[i]] * q)
            e += probs[i]
            gain = e - lam * self.cost[i]
            if gain > best + 1e-12:
                best_n, best = i, gain
        return best_n

    def observe(self, vals: Sequence[Sequence[float]], ranks: Sequence[int], tokens: int, nodes: int) -> None:
        """Calibrate from one step and count its tokens and modelled cost.

        Args:
            vals: [D][w] the log-probabilities of the step's candidates (what ``tree_size`` saw).
            ranks: the target's choice at each visited depth: its rank among the candidates, -1
                when none of them.
            tokens: tokens the step committed.
            nodes: tokens it verified (anchor included).
        """
        for d, r in enumerate(ranks[: len(vals)]):
            for j, v in enumerate(vals[d][:RANKS]):
                self.calibration.record(float(v), runner_up=j > 0, hit=r == j)
        if nodes >= 1:
            self.tokens += tokens
            self.spent += self.cost[min(nodes - 1, len(self.cost) - 1)] + (self.draft_cost if nodes > 1 else 0.0)
