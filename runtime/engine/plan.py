"""Planners: how big each decode step is (``runtime.engine.step.Planner``).

- ``FixedPlanner``: the same step every time: a chain of K argmax drafts (kept on the device: one
  host read per step), a best-first tree of B nodes, or plain decoding (K = 0).
- ``AdaptivePlanner``: the device's cost model (``runtime.engine.costs``) and the drafter's
  coverage, refined while decoding, choose a chain of K or a tree of B; with the confidence cut
  (``runtime.engine.confidence``) every step then keeps only the nodes worth their verify cost.

The coverage model: ``c[d][r]`` = P(the target's token at depth d+1 is the drafter's rank-r
candidate | the path so far was accepted). Treating depths as independent, a node whose path has
ranks (r_1..r_d) is on the target's path with probability prod c[i][r_i], so

    E[tokens per step](tree) = 1 + sum over drafted nodes of prod_i c[i][r_i]

and the best tree of B nodes under that model is the best-first tree over log c. A chain of K is
the tree of rank-0 nodes only. The plan maximises E / (t_draft + t_verify(nodes + 1)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from runtime.engine.confidence import RANKS, ConfidenceCut, HitRates
from runtime.engine.step import SlotCandidates, StepOutcome, StepPlan
from runtime.engine.tree import DraftTree, tree_from_candidates

BUDGETS = (4, 8, 16, 32, 64)  # tree sizes an adaptive plan considers
GENERIC_CONDITIONAL = 0.7  # prior P(draft k accepted | drafts 1..k-1 accepted) when a drafter records nothing
# Prior share of the non-argmax mass per rank (rank 1 gets RANK_DECAY of it, rank 2 RANK_DECAY^2 ...)
RANK_SHARE = 0.35
RANK_DECAY = 0.55
# While plain decoding is the model's fastest plan, the cut's steps skip the drafter (its forward
# would be paid for drafts the cut then drops); one step in PROBE_EVERY still drafts, so the coverage
# and the cut's calibration keep learning and drafting comes back where it pays again.
PROBE_EVERY = 4


class FixedPlanner:
    """The same step every time.

    Args:
        max_depth: block size - 1 (0: plain decoding).
        depth: drafts per chain step (<= max_depth), when ``budget`` is 0.
        budget: drafted nodes of a best-first tree per step (0: the chain).
    """

    def __init__(self, max_depth: int, depth: int | None = None, budget: int = 0) -> None:
        self.max_depth = max(int(max_depth), 0)
        self.depth = self.max_depth if depth is None else max(min(int(depth), self.max_depth), 0)
        self.budget = int(budget)
        if self.budget:
            self._plan = StepPlan(self.max_depth, self.budget, tree=True, on_host=True, budget=self.budget,
                                  planned=self.max_depth)  # fmt: skip
        else:
            self._plan = StepPlan(self.depth, self.depth, planned=self.depth)

    @property
    def max_nodes(self) -> int:
        """Most tokens a step verifies after the anchor."""
        return self.budget or self.depth

    def plan(self) -> StepPlan:
        """The fixed plan."""
        return self._plan

    def keep(self, candidates: SlotCandidates, tree: DraftTree) -> int:
        """Every node."""
        return len(tree) - 1

    def observe(self, outcome: StepOutcome) -> None:
        """Nothing to learn."""


class AdaptivePlanner:
    """Chain length or tree budget from costs and coverage, refined while decoding.

    Args:
        max_depth: block size - 1.
        cost: relative verify cost of n = 1.. tokens (measured, or the device's prior).
        draft_cost: relative cost of one drafter forward.
        prior: prior P(argmax accepted | path accepted) per depth (the drafter's recorded
            statistics), generic if None.
        prior_table: a recorded coverage table ``c[d][r]`` (``dflash_config.rank_coverage``);
            overrides ``prior``.
        prior_weight: pseudo-counts given to the prior.
        every: re-plan after this many steps.
        trees: trees may be planned (False: chains only, e.g. attention without custom masks).
        cut: size every step by the drafter's confidence (``ConfidenceCut``); False verifies the plan.
        hit_rates: the cut's calibration, shared across requests (a new one if None).
    """

    def __init__(
        self,
        max_depth: int,
        cost: Sequence[float],
        draft_cost: float = 0.1,
        prior: Sequence[float] | None = None,
        prior_table: Sequence[Sequence[float]] | None = None,
        prior_weight: float = 20.0,
        every: int = 8,
        trees: bool = True,
        cut: bool = True,
        hit_rates: HitRates | None = None,
    ) -> None:
        self.max_depth = max_depth
        self.cost = list(cost)
        self.draft_cost = draft_cost
        self.trees = trees
        self.budgets = BUDGETS if trees else ()
        table = prior_coverage(prior or [], max_depth)
        if prior_table:
            rows = [([float(x) for x in row] + [0.0] * RANKS)[:RANKS] for row in prior_table]
            table = (rows + [rows[-1]] * max_depth)[:max_depth]
        self.hits = [[p * prior_weight for p in row] for row in table]
        self.tried = [prior_weight] * max_depth
        self.every = every
        self._steps = 0
        self.choice = best_plan(self.coverage(), self.cost, draft_cost, max_depth, self.budgets)
        self.cut = ConfidenceCut(self.cost, self._plan_rate(), hit_rates, draft_cost) if cut else None

    @property
    def max_nodes(self) -> int:
        """Most tokens a step verifies after the anchor."""
        return max(self.max_depth, len(self.cost) - 1, *self.budgets)

    def coverage(self) -> list[list[float]]:
        """Current estimate of ``c[d][r]``."""
        return [[h / t for h in row] for row, t in zip(self.hits, self.tried, strict=True)]

    def _plan_rate(self) -> float:
        """Expected tokens per unit of relative cost of the current plan (the model's throughput)."""
        b, k = self.choice
        cov = self.coverage()
        if b > 0:
            return expected_tokens(cov, b) / (self.cost[min(b, len(self.cost) - 1)] + self.draft_cost)
        if k == 0:
            return 1.0 / self.cost[0]
        return expected_tokens(cov, k, chain=True) / (self.cost[min(k, len(self.cost) - 1)] + self.draft_cost)

    def tree_cap(self) -> int:
        """Drafted nodes a step's tree may hold before the cut keeps what is worth it: for a planned
        tree of B, up to 2B (within the measured costs); for a planned chain, as many as the block is
        deep. Without the cut: the plan's budget (0: a chain)."""
        b = self.choice[0]
        if self.cut is None:
            return b
        if b == 0:
            return min(self.max_depth, len(self.cost) - 1)
        return max(b, min(2 * b, len(self.cost) - 1))

    def plan(self) -> StepPlan:
        """The next step: the planned tree or chain; under the cut, a best-first tree (a chain
        where trees are off) up to ``tree_cap`` nodes, cut per step by ``keep``, or, while plain
        decoding is the fastest plan, a step without drafts on all but one in ``PROBE_EVERY``."""
        b, k = self.choice
        if self.cut is not None:
            if b == 0 and k == 0 and self._steps % PROBE_EVERY:
                return StepPlan(0, 0, tree=self.trees, on_host=True, budget=0, planned=0)  # the target alone
            cap = self.tree_cap()
            depth = self.max_depth if self.trees else min(self.max_depth, cap)
            return StepPlan(depth, cap, tree=self.trees, on_host=True, budget=b, planned=self.max_depth if b else None)
        if b > 0:
            return StepPlan(self.max_depth, b, tree=True, on_host=True, budget=b, planned=self.max_depth)
        return StepPlan(k, k, tree=False, on_host=True, budget=0, planned=k)

    def keep(self, candidates: SlotCandidates, tree: DraftTree) -> int:
        """Drafted nodes of the best-first ``tree`` worth their cost (all of them without the cut)."""
        if self.cut is None:
            return len(tree) - 1
        return self.cut.tree_size(candidates.vals, tree)

    def observe(self, outcome: StepOutcome) -> None:
        """Refine the coverage from where the target's choices ranked; keep the cut calibrated and
        its throughput current; re-plan every ``every`` steps."""
        for d, r in enumerate(outcome.ranks[: self.max_depth]):
            self.tried[d] += 1
            if 0 <= r < RANKS:
                self.hits[d][r] += 1
        if self.cut is not None:
            vals = outcome.candidates.vals if outcome.candidates is not None else []
            self.cut.observe(vals, outcome.ranks, outcome.committed, outcome.nodes)
        self._steps += 1
        if self._steps % self.every == 0:
            self.choice = best_plan(self.coverage(), self.cost, self.draft_cost, self.max_depth, self.budgets)


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
        budgets: tree budgets to consider (none: chains only).

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
