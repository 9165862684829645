"""How many tree nodes to verify per step (the tree budget B), like ``verify_length`` for chains.

The drafter's per-slot *coverage* is ``c[d][r]`` = P(the target's token at depth d+1 is the
drafter's rank-r candidate | the path so far was accepted). Treating depths as independent, a
node whose path has ranks (r_1..r_d) is on the target's path with probability prod c[i][r_i], so

    E[tokens per step](tree) = 1 + sum over drafted nodes of prod_i c[i][r_i]

and the best tree of B nodes under that model is the best-first tree over log c (the same
heap as ``runtime.engine.tree``). A chain of K drafts is the tree of rank-0 nodes only. The
policy picks, among chains K = 0..b-1 and trees B in ``BUDGETS`` whose verify size it has a cost
for, the one maximising E / (t_draft + t_verify(nodes + 1)), and refines the coverage from the
ranks the target's choices actually had while decoding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from runtime.engine.tree import DraftTree, tree_from_candidates
from runtime.engine.verify_length import GENERIC_CONDITIONAL, running_max

BUDGETS = (4, 8, 16, 32, 64)
RANKS = 8  # ranks tracked per depth
# Prior share of the non-argmax mass per rank (rank 1 gets RANK_DECAY of it, rank 2 RANK_DECAY^2 ...)
RANK_SHARE = 0.35
RANK_DECAY = 0.55
# Relative cost of verifying n tokens (n = 1..65) when nothing was measured. CPU: the issue's
# figures on a 2-core machine (~1x to 9, 1.25x at 17, 1.5x at 33, 2x at 65); GPUs are nearly flat.
DEFAULT_TREE_COST = {
    "cpu": [1.0 + 0.0 * n for n in range(9)]
    + [1.0 + 0.25 * (n - 8) / 8 for n in range(9, 17)]
    + [1.25 + 0.25 * (n - 16) / 16 for n in range(17, 33)]
    + [1.5 + 0.5 * (n - 32) / 32 for n in range(33, 66)],
    "cuda": [1.0] * 17 + [1.0 + 0.1 * (n - 17) / 48 for n in range(18, 66)],
}


def prior_coverage(conditional: Sequence[float], depth: int, ranks: int = RANKS) -> list[list[float]]:
    """Coverage table from per-position argmax acceptance (rank 0) and a geometric rank prior.

    Args:
        conditional: P(argmax accepted | path accepted) per depth (extended with its last value).
        depth: depths to fill (block size - 1).
        ranks: ranks per depth.
    """
    cond = list(conditional) or [GENERIC_CONDITIONAL]
    cond = (cond + [cond[-1]] * depth)[:depth]
    table = []
    for c0 in cond:
        rest = (1.0 - c0) * RANK_SHARE
        row = [c0] + [rest * (1 - RANK_DECAY) * RANK_DECAY ** (r - 1) for r in range(1, ranks)]
        table.append(row)
    return table


def expected_tokens(coverage: Sequence[Sequence[float]], budget: int, chain: bool = False) -> float:
    """Expected tokens per step (bonus included) of the best ``budget``-node tree (or a chain of
    ``budget`` argmax drafts) under the coverage model."""
    import math

    depth = len(coverage) if not chain else min(budget, len(coverage))
    if budget <= 0 or depth == 0:
        return 1.0
    if chain:
        e, p = 1.0, 1.0
        for d in range(depth):
            p *= coverage[d][0]
            e += p
        return e
    ranked = []
    for row in coverage[:depth]:
        order = sorted(range(len(row)), key=lambda r: -row[r])
        ranked.append(([math.log(max(row[r], 1e-12)) for r in order], order))
    tree = tree_from_candidates([v for v, _ in ranked], [o for _, o in ranked], 0, budget)
    probs = [1.0]
    e = 1.0
    for i in range(1, len(tree)):
        p = probs[tree.parents[i]] * coverage[tree.depths[i] - 1][tree.tokens[i]]
        probs.append(p)
        e += p
    return e


def best_plan(
    coverage: Sequence[Sequence[float]],
    cost: Sequence[float],
    draft_cost: float,
    max_depth: int,
    budgets: Sequence[int] = BUDGETS,
) -> tuple[int, int]:
    """The fastest plan under the model: (tree budget B, 0 for a chain; chain drafts K).

    Args:
        coverage: ``c[d][r]`` for depths 1..max_depth.
        cost: relative verify cost of n = 1.. tokens; trees are only considered up to its length.
        draft_cost: relative cost of one drafter forward.
        max_depth: block size - 1.
        budgets: tree budgets to consider.

    Returns:
        (B, K): B > 0 means a tree of B nodes; B == 0 means a chain of K drafts.
    """
    best, best_rate = (0, 0), 1.0 / cost[0]
    for k in range(1, max_depth + 1):
        rate = expected_tokens(coverage, k, chain=True) / (cost[min(k, len(cost) - 1)] + draft_cost)
        if rate > best_rate + 1e-9:
            best, best_rate = (0, k), rate
    for b in budgets:
        if b + 1 > len(cost) or max_depth < 1:
            continue
        rate = expected_tokens(coverage, b) / (cost[b] + draft_cost)
        if rate > best_rate * 1.02:  # a tree must beat the chain clearly: the model is approximate
            best, best_rate = (b, 0), rate
    return best


class TreeBudgetPolicy(Protocol):
    """Chooses the tree budget (or, with B = 0, a chain length) of each step."""

    def budget(self) -> int:
        """Tree nodes for the next step (0: a chain of ``chain_length()`` drafts)."""
        ...

    def chain_length(self) -> int:
        """Drafts of the next step when ``budget()`` is 0."""
        ...

    def observe(self, ranks: Sequence[int], tokens: int | None = None, nodes: int | None = None) -> None:
        """Record where the target's choice ranked at each visited depth (-1: not a candidate), and
        optionally the step's committed tokens and verified nodes (anchor included)."""
        ...


class AdaptiveTreeBudget:
    """Pick the tree budget (or a chain length) from costs and coverage, refined while decoding.

    Args:
        max_depth: block size - 1.
        cost: relative verify cost per number of tokens (measured, or ``DEFAULT_TREE_COST``).
        draft_cost: relative cost of one drafter forward.
        prior: prior P(argmax accepted | path accepted) per depth (the drafter's recorded
            statistics), generic if None.
        prior_table: a recorded coverage table ``c[d][r]`` (the drafter's measured per-slot,
            per-rank coverage, e.g. ``dflash_config.rank_coverage``); overrides ``prior``.
        prior_weight: pseudo-counts given to the prior.
        every: re-plan after this many steps.
        budgets: tree budgets to consider.
        confidence: size every step from the drafter's own confidence (``ConfidenceCut``): a
            best-first tree up to ``tree_cap`` nodes, cut where further nodes are not worth their
            verify cost; False verifies the plan (a chain of K, or a tree of B) every step.
        calibration: the cut's calibration, shared across requests (a new one if None).
    """

    def __init__(
        self,
        max_depth: int,
        cost: Sequence[float],
        draft_cost: float = 0.1,
        prior: Sequence[float] | None = None,
        prior_weight: float = 20.0,
        every: int = 8,
        budgets: Sequence[int] = BUDGETS,
        prior_table: Sequence[Sequence[float]] | None = None,
        confidence: bool = True,
        calibration: Calibration | None = None,
    ) -> None:
        self.max_depth = max_depth
        self.cost = list(cost)
        self.draft_cost = draft_cost
        self.budgets = tuple(budgets)
        table = prior_coverage(prior or [], max_depth)
        if prior_table:
            rows = [([float(x) for x in row] + [0.0] * RANKS)[:RANKS] for row in prior_table]
            table = (rows + [rows[-1]] * max_depth)[:max_depth]
        self.hits = [[p * prior_weight for p in row] for row in table]
        self.tried = [prior_weight] * max_depth
        self.every = every
        self._steps = 0
        self.plan = best_plan(self.coverage(), self.cost, draft_cost, max_depth, self.budgets)
        self.confidence = ConfidenceCut(self.cost, self._plan_rate(), calibration, draft_cost) if confidence else None

    def _plan_rate(self) -> float:
        """Expected tokens per unit of relative cost of the current plan (the model's throughput)."""
        b, k = self.plan
        cov = self.coverage()
        if b > 0:
            return expected_tokens(cov, b) / (self.cost[min(b, len(self.cost) - 1)] + self.draft_cost)
        if k == 0:
            return 1.0 / self.cost[0]
        return expected_tokens(cov, k, chain=True) / (self.cost[min(k, len(self.cost) - 1)] + self.draft_cost)

    def tree_cap(self) -> int:
        """Most drafted nodes a step's tree may hold before the confidence cut keeps what is worth it:
        for a planned tree of B, up to 2B (within the measured costs); for a planned chain, a tree as
        big as the block is deep. Without the cut: the plan's budget (0: a chain)."""
        b = self.plan[0]
        if self.confidence is None:
            return b
        if b == 0:
            return min(self.max_depth, len(self.cost) - 1)
        return max(b, min(2 * b, len(self.cost) - 1))

    def tree_size_for(self, vals: Sequence[Sequence[float]], tree: DraftTree) -> int:
        """Drafted nodes to keep of the best-first ``tree`` (all of them when the cut is off)."""
        if self.confidence is None:
            return len(tree) - 1
        return self.confidence.tree_size(vals, tree)

    def coverage(self) -> list[list[float]]:
        """Current estimate of ``c[d][r]``."""
        return [[h / t for h in row] for row, t in zip(self.hits, self.tried, strict=True)]

    def budget(self) -> int:
        """Tree nodes for the next step (0: a chain)."""
        return self.plan[0]

    def chain_length(self) -> int:
        """Drafts of the next step when it is a chain."""
        return self.plan[1]

    def observe(self, ranks: Sequence[int], tokens: int | None = None, nodes: int | None = None) -> None:
        """Record where the target's choice ranked at each visited depth (-1: not a candidate);
        ``tokens`` / ``nodes``: the step's committed tokens and verified nodes (anchor included),
        which keep the confidence cut's throughput estimate current."""
        for d, r in enumerate(ranks[: self.max_depth]):
            self.tried[d] += 1
            if 0 <= r < RANKS:
                self.hits[d][r] += 1
        if self.confidence is not None:
            self.confidence.observe(ranks, tokens, nodes)
        self._steps += 1
        if self._steps % self.every == 0:
            self.plan = best_plan(self.coverage(), self.cost, self.draft_cost, self.max_depth, self.budgets)


class FixedTreeBudget:
    """Always the same tree budget."""

    def __init__(self, budget: int) -> None:
        self.plan = (int(budget), 0)

    def budget(self) -> int:
        """The fixed B."""
        return self.plan[0]

    def chain_length(self) -> int:
        """Unused (B > 0)."""
        return 0

    def observe(self, ranks: Sequence[int], tokens: int | None = None, nodes: int | None = None) -> None:
        """Nothing to learn."""


# The confidence cut's calibration: the drafter's probability of a candidate in CAL_BINS equal bins,
# each with CAL_PRIOR pseudo-observations at the bin's centre (a calibrated drafter needs no correction).
CAL_BINS = 10
CAL_PRIOR = 4.0
# pseudo-steps given to the plan's modelled throughput before measured steps take over
RATE_PRIOR = 8.0


def _bin(logprob: float) -> int:
    p = math.exp(min(float(logprob), 0.0))
    return min(int(p * CAL_BINS), CAL_BINS - 1)


class Calibration:
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
    it and q calibrated online per probability bin from the target's choices (``Calibration``: one
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
        self, cost: Sequence[float], rate: float, calibration: Calibration | None = None, draft_cost: float = 0.0
    ) -> None:
        self.cost = running_max(cost)
        self.draft_cost = draft_cost
        self.calibration = calibration if calibration is not None else Calibration()
        self.tokens = RATE_PRIOR * rate
        self.spent = RATE_PRIOR
        self._rows: list[list[float]] = []  # the candidates' log-probabilities of the last step's slots

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
        self._rows = [[float(v) for v in row[:RANKS]] for row in vals]
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

    def observe(self, ranks: Sequence[int], tokens: int | None = None, nodes: int | None = None) -> None:
        """Calibrate from the target's choice at each visited depth (its rank among the candidates,
        -1: none of them) and count the step's tokens and modelled cost."""
        for d, r in enumerate(ranks[: len(self._rows)]):
            for j, v in enumerate(self._rows[d]):
                self.calibration.record(v, runner_up=j > 0, hit=r == j)
        self._rows = []
        if tokens is not None and nodes is not None and nodes >= 1:
            self.tokens += tokens
            self.spent += self.cost[min(nodes - 1, len(self.cost) - 1)] + (self.draft_cost if nodes > 1 else 0.0)
