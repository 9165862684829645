"""Draft trees (DDTree): build a tree from one drafter pass, mask it, walk it (pure functions).

The drafter scores every slot of a block in one forward. Instead of verifying only the argmax
path, a tree of likely continuations is built under a node budget B: a node at depth d holds a
candidate for slot d, its score is the sum of the per-slot log-probabilities along its path, and a
best-first heap adds the B highest-scoring nodes (a node's children are slot d+1's top
candidates). The target verifies the whole tree in ONE forward with an ancestor-only mask and
positions ``start + depth``; the walk then follows the target's own choice at each node
(Ringel & Romano 2026, "Accelerating Speculative Decoding with Block Diffusion Draft Trees").

Node 0 is the root: the anchor (the last committed token, depth 0). Every other node's parent has
a smaller index, so parents always precede children and node order is best-first.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.engine.models.drafter import draft_columns_to_ids
from runtime.engine.transfer import download


@dataclass(frozen=True)
class DraftTree:
    """A draft tree rooted at the anchor.

    Attributes:
        tokens: token id of each node (full vocabulary); ``tokens[0]`` is the anchor.
        parents: parent index of each node; -1 for the root.
        depths: depth of each node (root 0); node i sits at position ``start + depths[i]``.
        ranks: rank of each node's token among its slot's candidates (0 = the drafter's argmax;
            -1 for the root).
        candidates: each slot's ranked candidate ids the tree was built from (for coverage
            statistics: where the target's choice ranked); may be empty.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    ranks: tuple[int, ...]
    candidates: tuple[tuple[int, ...], ...] = ()

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        """Deepest level of the tree (0 for a root alone)."""
        return max(self.depths)


def slot_candidates(
    logprobs: torch.Tensor, width: int, vocab_ids: torch.Tensor | None = None, extra_ids: torch.Tensor | None = None
) -> tuple[list[list[float]], list[list[int]]]:
    """Each slot's ``width`` best candidates, best first, on the host (the one host sync of drafting).

    Args:
        logprobs: [D, V_d] log-probabilities of slots 1..D.
        width: candidates kept per slot (capped by V_d).
        vocab_ids: [V_d] full-vocabulary id of each column (a reduced draft vocabulary), or None.
        extra_ids: [D] full id of column V_d, one more column per slot (a copy proposal outside
            the draft vocabulary), or None.

    Returns:
        (log-probabilities [D][w], full token ids [D][w]).
    """
    if logprobs.ndim != 2 or logprobs.shape[0] == 0 or width <= 0:
        return [], []
    top = torch.topk(logprobs.float(), min(width, int(logprobs.shape[1])), dim=-1)  # [D, w]
    ids = draft_columns_to_ids(top.indices, vocab_ids, extra_ids)
    w = int(top.values.shape[1])
    both = download(torch.cat([top.values.double(), ids.double()], dim=1))  # one host read: [D, 2w]
    return [row[:w] for row in both], [[int(t) for t in row[w:]] for row in both]


def tree_from_candidates(
    vals: Sequence[Sequence[float]], toks: Sequence[Sequence[int]], anchor: int, budget: int
) -> DraftTree:
    """Best-first draft tree over per-slot candidates (``slot_candidates``).

    Candidates are popped from a max-heap on the summed log-probability of their path. Popping
    a node pushes its next sibling (same parent, next-ranked token of the same slot) and its
    first child (top token of the next slot); both score at most the node itself, so nodes come
    out in non-increasing score order and the tree holds the ``budget`` best paths' nodes.

    Args:
        vals: [D][w] log-probabilities of each slot's candidates, best first.
        toks: [D][w] their token ids.
        anchor: the root's token id.
        budget: drafted nodes to add (B, the root not counted).
    """
    cands = tuple(tuple(int(t) for t in row) for row in toks)
    depth_max = len(vals)
    tokens, parents, depths, ranks = [int(anchor)], [-1], [0], [-1]
    if budget <= 0 or depth_max == 0 or not vals[0]:
        return DraftTree(tuple(tokens), tuple(parents), tuple(depths), tuple(ranks), cands)
    k = len(vals[0])
    scores = [0.0]
    # heap entries: (-score, tie-break counter, parent node, depth of the candidate, rank)
    heap: list[tuple[float, int, int, int, int]] = [(-vals[0][0], 0, 0, 1, 0)]
    counter = 1
    while heap and len(tokens) <= budget:
        neg, _, parent, depth, rank = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(int(toks[depth - 1][rank]))
        parents.append(parent)
        depths.append(depth)
        ranks.append(rank)
        scores.append(-neg)
        if rank + 1 < k:  # next sibling
            heapq.heappush(heap, (-(scores[parent] + vals[depth - 1][rank + 1]), counter, parent, depth, rank + 1))
            counter += 1
        if depth < depth_max:  # first child
            heapq.heappush(heap, (-(scores[node] + vals[depth][0]), counter, node, depth + 1, 0))
            counter += 1
    return DraftTree(tuple(tokens), tuple(parents), tuple(depths), tuple(ranks), cands)


def chain_tree(anchor: int, draft: Sequence[int], candidates: Sequence[Sequence[int]] = ()) -> DraftTree:
    """The chain [anchor, d_1, ..., d_k] as a tree (each node the child of the previous one)."""
    n = len(draft)
    return DraftTree(
        (int(anchor), *(int(t) for t in draft)),
        (-1, *range(n)),
        tuple(range(n + 1)),
        (-1, *([0] * n)),
        tuple(tuple(int(t) for t in row) for row in candidates),
    )


def truncate_tree(tree: DraftTree, drafted: int) -> DraftTree:
    """The first ``drafted`` nodes after the root of a best-first tree (a tree again: parents
    precede children)."""
    n = max(0, min(int(drafted), len(tree) - 1)) + 1
    return DraftTree(tree.tokens[:n], tree.parents[:n], tree.depths[:n], tree.ranks[:n], tree.candidates)


def choice_ranks(tree: DraftTree, path: Sequence[int], choices: Sequence[int]) -> list[int]:
    """Where the target's choice ranked among the drafter's candidates at each visited depth.

    Args:
        tree: the verified tree (with ``candidates``).
        path: accepted node indices, root first (``walk``).
        choices: the target's choice at every node.

    Returns:
        One entry per visited node whose next slot was drafted: the rank of the target's choice
        (0 = the drafter's argmax), or -1 when it was not among the candidates.
    """
    out = []
    for node in path:
        d = tree.depths[node]
        if d >= len(tree.candidates):
            break
        row = tree.candidates[d]
        c = int(choices[node])
        out.append(row.index(c) if c in row else -1)
    return out


def ancestor_mask(parents: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """Which tree nodes each node may attend to: itself and its ancestors.

    Args:
        parents: parent index per node (-1 for the root); parents precede children.
        device: where to build the mask.

    Returns:
        [N, N] bool, ``mask[i, j]`` True iff node j is node i or one of its ancestors.
    """
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            if p >= i:
                raise ValueError(f"node {i} has parent {p}: parents must precede their children")
            mask[i] = mask[p]
        mask[i, i] = True
    return mask.to(device) if device is not None else mask


def walk(tree: DraftTree, choices: Sequence[int]) -> list[int]:
    """Follow the target's choices down the tree.

    At each visited node the target's choice (its argmax, or its sample there: an exact sample of
    the target given the accepted path) names the next token; if a child of the node holds it,
    that child is accepted and the walk continues from it.

    Args:
        tree: the verified tree.
        choices: the target's choice at every node (index-aligned with ``tree.tokens``).

    Returns:
        The accepted path as node indices, starting with the root: [0, n_1, ..., n_a]. The
        target's next token (the bonus) is ``choices[path[-1]]``.
    """
    children: dict[tuple[int, int], int] = {}
    for i in range(1, len(tree)):
        children.setdefault((tree.parents[i], tree.tokens[i]), i)
    path = [0]
    while (nxt := children.get((path[-1], int(choices[path[-1]])))) is not None:
        path.append(nxt)
    return path


def first_child_descent(parents: Sequence[int], node: int) -> list[int]:
    """From ``node``, repeatedly step to its first (best-ranked) child; the nodes visited after it.

    Indices follow ``parents`` (any node numbering in which parents precede children; -1 = root).
    """
    first: dict[int, int] = {}
    for i, p in enumerate(parents):
        first.setdefault(p, i)
    out = []
    while node in first:
        node = first[node]
        out.append(node)
    return out


def losing_branches(parents: Sequence[int], path: Sequence[int]) -> list[list[int]]:
    """The branches that lost where the walk stopped: each child of the last accepted node,
    followed by its best-ranked descendants.

    Args:
        parents: parent of each drafted node (indices into the drafted nodes; -1 = the anchor).
        path: accepted drafted nodes in order (empty: the walk stopped at the anchor).

    Returns:
        One node list per losing branch, best-ranked branch first.
    """
    last = path[-1] if path else -1
    return [[c, *first_child_descent(parents, c)] for c, p in enumerate(parents) if p == last]


def chain_is_path(tree: DraftTree) -> bool:
    """True when every node's parent is the node before it (a chain: the causal verify fits)."""
    return all(p == i - 1 for i, p in enumerate(tree.parents))
