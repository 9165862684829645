"""Context n-gram lookup: drafts copied from the prompt and the answer so far (pure functions).

Code edits, refactors, ports and tests repeat long stretches of the code they were given. When
the last few committed tokens occurred earlier in the context, the tokens that followed them there
are a cheap guess for what comes next ("prompt lookup decoding", Saxena 2023; llama.cpp's n-gram
drafts). The decoder merges such a guess into the drafter's tree as one more branch: nodes the
drafter already proposed are shared, the rest are appended, and the target verifies everything in
the same forward, so the output stays exactly the target's.

The request's ``NgramIndex`` (``runtime.engine.ngram``) finds what followed the latest earlier
occurrence of the context's longest matching suffix. ``LookupLength`` adapts how many tokens to copy from what the
target accepted: guesses cost verify nodes, so a run of rejected guesses shortens them.
``ContextLookup`` grafts the guess onto a step's tree, reading the request's index.
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.engine.step import RequestContext, StepOutcome
from runtime.engine.tree import DraftTree


def merge_chain(tree: DraftTree, chain: Sequence[int], max_new: int) -> tuple[DraftTree, list[int]]:
    """Add ``chain`` (continuing the root) to ``tree`` as a branch.

    The chain follows existing nodes while they hold its tokens; from the first token the tree
    lacks, its nodes are appended (rank -2: not the drafter's), at most ``max_new`` of them.

    Returns:
        (the merged tree, the chain's nodes in order: shared ones and appended ones).
    """
    tokens, parents, depths, ranks = list(tree.tokens), list(tree.parents), list(tree.depths), list(tree.ranks)
    children: dict[tuple[int, int], int] = {
        (p, t): i for i, (p, t) in enumerate(zip(parents, tokens, strict=True)) if p >= 0
    }
    node, added, nodes = 0, 0, []
    for tok in chain:
        child = children.get((node, int(tok)))
        if child is None:
            if added >= max_new:
                break
            child = len(tokens)
            tokens.append(int(tok))
            parents.append(node)
            depths.append(depths[node] + 1)
            ranks.append(-2)
            children[(node, int(tok))] = child
            added += 1
        node = child
        nodes.append(child)
    if not added:
        return tree, nodes
    return DraftTree(tuple(tokens), tuple(parents), tuple(depths), tuple(ranks), tree.candidates), nodes


class LookupLength:
    """How many context tokens to copy per step, adapted to what the target accepts.

    A guess accepted whole doubles the length (up to ``longest``); one whose first token was
    rejected halves it (down to ``shortest``); otherwise the length becomes the accepted part plus
    two.

    Args:
        longest: most tokens copied in one step.
        shortest: fewest (>= 1).
    """

    def __init__(self, longest: int = 16, shortest: int = 2) -> None:
        if not 1 <= shortest <= longest:
            raise ValueError(f"lookup lengths need 1 <= shortest <= longest, got {shortest}, {longest}")
        self.longest, self.shortest = longest, shortest
        self.length = min(longest, max(shortest, 8))

    def observe(self, proposed: int, accepted: int) -> None:
        """Record a step whose guess had ``proposed`` tokens, ``accepted`` of them accepted."""
        if proposed <= 0:
            return
        if accepted >= proposed:
            target = 2 * self.length
        elif accepted == 0:
            target = self.length // 2
        else:
            target = accepted + 2
        self.length = max(self.shortest, min(self.longest, target))


class ContextLookup:
    """The context lookup as a step's brancher (``runtime.engine.step.Brancher``): what followed the
    latest earlier occurrence of the context's last tokens joins the tree as one more branch.

    It reads the request's n-gram index (``RequestContext.index``, which must cover ``ngram``) and
    keeps the copy length of one generation (make one per request).

    Args:
        longest: most tokens copied in one step (>= 1).
        ngram: (shortest, longest) suffix matched.
    """

    def __init__(self, longest: int, ngram: tuple[int, int] = (2, 4)) -> None:
        self.ngram = ngram
        self.longest = longest
        self.length = LookupLength(longest, min(2, longest))
        self.nodes: list[int] = []  # the last guess's nodes in its tree

    def graft(self, ctx: RequestContext, tree: DraftTree, room: int) -> DraftTree:
        """``tree`` with this step's guess (at most ``room`` tokens) merged in as a branch."""
        index = ctx.indexed()
        assert index is not None, "the decoder builds the request's n-gram index"
        _, guess = index.match(min(self.length.length, room), self.ngram)
        self.nodes = []
        if guess:
            tree, self.nodes = merge_chain(tree, guess, self.longest)
        return tree

    def observe(self, outcome: StepOutcome) -> None:
        """Adapt the copy length to how much of the last guess the target accepted."""
        on_path = set(outcome.path)
        self.length.observe(len(self.nodes), sum(1 for i in self.nodes if i in on_path))
