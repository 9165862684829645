"""The decode step's vocabulary: what a planner asks of a step, what proposers offer, what a step
taught, and the per-request context the loop (``runtime.engine.decode``) carries between steps.

One step, whatever sizes it and whatever proposes:

    plan -> propose -> verify -> walk -> commit -> compact caches -> observe -> event

- A ``Planner`` says how big the step is (``StepPlan``): how deep to draft, how many tree nodes at
  most, a chain or a best-first tree; after the drafter scored the slots it may keep fewer nodes
  (``keep``: the confidence cut), and it learns from each ``StepOutcome``. Plain decoding is a plan
  of depth 0.
- A ``Proposer`` scores the block's slots after the anchor (the DFlash drafter, with its copy
  inputs and corpus): per-slot candidates on the host, or the argmax chain left on the device.
- A ``Brancher`` grafts one more branch onto the step's tree (the context lookup).
- ``Draft`` is what the target verifies: a chain on the device (one host read per step: drafts
  and the target's choices together) or a tree on the host (its own host read of the candidates,
  then one of the target's choices).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from runtime.engine.models.kv_cache import DraftKVCache
from runtime.engine.ngram import NgramIndex
from runtime.engine.tree import DraftTree


@dataclass(frozen=True)
class StepPlan:
    """What a planner asks of one step.

    Attributes:
        depth: draft slots after the anchor (0: a plain step, the target alone).
        nodes: most drafted nodes before ``Planner.keep`` (a chain: ``depth``).
        tree: a best-first tree over the slots' candidates; False: the argmax chain.
        on_host: read the slots' candidates to the host (trees, the confidence cut and rank
            statistics need them); False: the argmax chain stays on the device.
        budget: the tree budget B the stats report (0: a chain plan).
        planned: the verify length the stats report (None: the kept tree's depth).
    """

    depth: int
    nodes: int
    tree: bool = False
    on_host: bool = False
    budget: int = 0
    planned: int | None = 0

    def limited(self, room: int) -> StepPlan:
        """This plan with at most ``room`` slots (the length limit near the end of a request)."""
        depth = max(min(self.depth, room), 0)
        if depth == self.depth:
            return self
        nodes = self.nodes if self.tree else depth
        return StepPlan(depth, nodes, self.tree, self.on_host, self.budget, self.planned)


@dataclass(frozen=True)
class SlotCandidates:
    """Each drafted slot's best candidates, best first, on the host.

    Attributes:
        vals: [depth][w] the proposer's log-probabilities.
        toks: [depth][w] their full-vocabulary ids.
    """

    vals: list[list[float]]
    toks: list[list[int]]


@dataclass(frozen=True)
class StepOutcome:
    """What one step taught: the verified tree, the accepted path and the target's choices.

    Attributes:
        tree: the verified tree (root = the anchor; a chain is a tree too).
        path: accepted node indices, root first; the bonus is ``choices[path[-1]]``.
        choices: the target's choice at every node.
        ranks: where the target's choice ranked among the candidates at each visited depth
            (-1: not among them); empty when the candidates stayed on the device.
        candidates: the slots' candidates the tree was built from (None: a device chain).
        drafted: nodes the proposer drafted (the rest were grafted by branchers).
        seconds: the step's wall time so far (draft + verify).
    """

    tree: DraftTree
    path: list[int]
    choices: list[int]
    ranks: list[int]
    candidates: SlotCandidates | None
    drafted: int
    seconds: float

    @property
    def accepted(self) -> int:
        """Accepted drafts."""
        return len(self.path) - 1

    @property
    def committed(self) -> int:
        """Tokens the step committed: the accepted drafts and the target's own."""
        return len(self.path)

    @property
    def nodes(self) -> int:
        """Tokens the target verified (anchor included)."""
        return len(self.tree)


@dataclass
class RequestContext:
    """Everything one request carries between steps (nothing of it lives on the decoder).

    Attributes:
        committed: prompt + committed ids; the last one is the anchor (committed, not yet seen
            by the target).
        device: the target's device.
        t_cache: the target's KV cache (holds ``start`` entries between steps).
        d_cache: the drafter's KV cache of context entries (None for plain decoding).
        pending: [1, C, n*D] target features not yet in the drafter cache.
        index: ONE n-gram index over ``committed``, shared by the copy inputs and the lookup.
        anchor_on_device: [1] the anchor on the target's device when a step left it there.
        scratch: per-request buffers of the proposer (reused across steps).
    """

    committed: list[int]
    device: torch.device
    t_cache: Any
    d_cache: DraftKVCache | None = None
    pending: torch.Tensor | None = None
    index: NgramIndex | None = None
    anchor_on_device: torch.Tensor | None = None
    scratch: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def anchor(self) -> int:
        """The last committed token."""
        return self.committed[-1]

    @property
    def start(self) -> int:
        """The anchor's position (entries in the target cache)."""
        return len(self.committed) - 1

    def indexed(self) -> NgramIndex | None:
        """The n-gram index, brought up to date with ``committed``."""
        if self.index is not None and len(self.index.tokens) < len(self.committed):
            self.index.extend(self.committed[len(self.index.tokens) :])
        return self.index


class Planner(Protocol):
    """Sizes each step."""

    max_depth: int  # block size - 1 (0: plain decoding)

    @property
    def max_nodes(self) -> int:
        """Most tokens a step verifies after the anchor (the caches' headroom)."""
        ...

    def plan(self) -> StepPlan:
        """The next step's plan (before the length limit)."""
        ...

    def keep(self, candidates: SlotCandidates, tree: DraftTree) -> int:
        """Drafted nodes to keep of the best-first ``tree`` built from ``candidates``."""
        ...

    def observe(self, outcome: StepOutcome) -> None:
        """Learn from a finished step."""
        ...


class Proposer(Protocol):
    """Scores the block's slots after the anchor in one forward."""

    taps: tuple[int, ...]  # the target layers whose outputs it reads (captured from the prefill on)

    @property
    def state_key(self) -> int:
        """Identifies the model whose per-request state (``RequestContext.d_cache``) it keeps."""
        ...

    def begin(self, ctx: RequestContext, room: int, feats: torch.Tensor | None) -> None:
        """Set up a request: ``room`` positions it may reach, the prefilled target features (after
        what a reused ``ctx.d_cache`` / ``ctx.pending`` from the prompt cache already hold)."""
        ...

    def chain(self, ctx: RequestContext, depth: int) -> torch.Tensor:
        """[depth] argmax drafts on the target's device (no host read)."""
        ...

    def candidates(self, ctx: RequestContext, depth: int, width: int) -> SlotCandidates:
        """Each slot's ``width`` best candidates on the host (one host read)."""
        ...


class Brancher(Protocol):
    """Grafts one more branch onto a step's tree."""

    def graft(self, ctx: RequestContext, tree: DraftTree, room: int) -> DraftTree:
        """``tree`` with the branch added (at most ``room`` tokens deep)."""
        ...

    def observe(self, outcome: StepOutcome) -> None:
        """Learn from a finished step."""
        ...
