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

from collections.abc import Sequence
from typing import Protocol

from runtime.engine.tree import tree_from_candidates
from runtime.engine.verify_length import GENERIC_CONDITIONAL

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

    def observe(self, ranks: Sequence[int]) -> None:
        """Record where the target's choice ranked at each visited depth (-1: not a candidate)."""
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

    def coverage(self) -> list[list[float]]:
        """Current estimate of ``c[d][r]``."""
        return [[h / t for h in row] for row, t in zip(self.hits, self.tried, strict=True)]

    def budget(self) -> int:
        """Tree nodes for the next step (0: a chain)."""
        return self.plan[0]

    def chain_length(self) -> int:
        """Drafts of the next step when it is a chain."""
        return self.plan[1]

    def observe(self, ranks: Sequence[int]) -> None:
        """Record where the target's choice ranked at each visited depth (-1: not a candidate)."""
        for d, r in enumerate(ranks[: self.max_depth]):
            self.tried[d] += 1
            if 0 <= r < RANKS:
                self.hits[d][r] += 1
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

    def observe(self, ranks: Sequence[int]) -> None:
        """Nothing to learn."""
