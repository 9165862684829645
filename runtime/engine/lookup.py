"""Context n-gram lookup: drafts copied from the prompt and the answer so far (pure functions).

Code edits, refactors, ports and tests repeat long stretches of the code they were given. When
the last few committed tokens occurred earlier in the context, the tokens that followed them there
are a cheap guess for what comes next ("prompt lookup decoding", Saxena 2023; llama.cpp's n-gram
drafts). ``TreeDecoder`` merges such a guess into the drafter's tree as one more branch: nodes the
drafter already proposed are shared, the rest are appended, and the target verifies everything in
the same forward, so the output stays exactly the target's.

``NgramIndex`` keeps, for every n-gram of length ``min_n..max_n`` in the context, where it last
ended; a query takes the longest suffix of the context that occurred before and returns what
followed its latest occurrence. ``LookupLength`` adapts how many tokens to copy from what the
target accepted: guesses cost verify nodes, so a run of rejected guesses shortens them.
``ContextLookup`` is both for one generation, as the decoder uses them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from runtime.engine.corpus import Query, corpus_chain
from runtime.engine.tree import DraftTree

CONTEXT_FIRST = 2  # a context match this long is shown before the corpus's proposal


class NgramIndex:
    """Latest occurrence of every short n-gram of a growing token sequence.

    Args:
        min_n: shortest suffix matched (>= 1).
        max_n: longest suffix matched (>= min_n); longer matches are tried first.
    """

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after it
        self._indexed = 0  # n-grams ending before this index have been recorded

    def extend(self, tokens: Iterable[int]) -> None:
        """Append committed tokens."""
        self.tokens.extend(int(t) for t in tokens)
        seq, last = self.tokens, self._last
        # an n-gram ending at j is recorded once token j + 1 exists, so a query never finds the
        # context's own suffix and every match has a continuation
        for j in range(self._indexed, len(seq) - 1):
            for n in range(self.min_n, min(self.max_n, j + 1) + 1):
                last[tuple(seq[j - n + 1 : j + 1])] = j + 1
        self._indexed = max(self._indexed, len(seq) - 1)

    def match(self, length: int) -> tuple[int, list[int]]:
        """What followed the latest earlier occurrence of the longest matching suffix.

        Args:
            length: tokens wanted.

        A match whose continuation runs into the context's end is read as a period and repeated
        (``a b c a b`` continues ``c a b c ...``).

        Returns:
            (n-gram size matched, ``length`` tokens); (0, []) when no suffix of at least ``min_n``
            tokens occurred before.
        """
        seq = self.tokens
        if length <= 0:
            return 0, []
        for n in range(min(self.max_n, len(seq)), self.min_n - 1, -1):
            at = self._last.get(tuple(seq[len(seq) - n :]))
            if at is not None:
                # a match close to the end continues into the guess itself (a repeating period)
                out = seq[at : at + length]
                while len(out) < length:
                    out.append(out[len(out) - (len(seq) - at)])
                return n, out
        return 0, []


def block_copies(
    index: NgramIndex,
    block_size: int,
    fill: int,
    corpus: Query | None = None,
    corpus_ngram: tuple[int, int] = (2, 4),
) -> tuple[list[int], list[int]]:
    """The copy inputs of one drafter block (``DFlashDraftModel.copy_inputs``).

    ``index`` holds the context up to and including the block's anchor; slot k (1..b-1) is shown
    the k-th token of what followed the latest earlier occurrence of its longest matching suffix.
    With a ``corpus`` (a drafter with ``dflash_config.copy_corpus``), where that match is shorter
    than ``CONTEXT_FIRST`` tokens the slots are shown the corpus chain instead
    (``runtime.engine.corpus.corpus_chain``) when it has a first token.

    Returns:
        ([b] token ids, ``fill`` where there is none; [b] copy row per position: the matched
        n-gram size for a context copy, ``index.max_n + 1 + ...`` for a corpus proposal, 0 at the
        anchor and wherever nothing is proposed).
    """
    n, guess = index.match(block_size - 1)
    if corpus is not None and n < CONTEXT_FIRST:
        ids, rows = corpus_chain(corpus, index.tokens, corpus_ngram, block_size - 1, index.max_n + 1)
        if ids:
            pad = block_size - 1 - len(ids)
            return [fill, *ids, *[fill] * pad], [0, *rows, *[0] * pad]
    if not guess:
        return [fill] * block_size, [0] * block_size
    return [fill, *guess], [0] + [n] * (block_size - 1)


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
    """The context lookup of one generation: the n-gram index over its context and the copy length.

    Args:
        context: the prompt and the tokens committed so far.
        longest: most tokens copied in one step (>= 1).
        ngram: (shortest, longest) suffix matched.
    """

    def __init__(self, context: Iterable[int], longest: int, ngram: tuple[int, int] = (2, 4)) -> None:
        self.index = NgramIndex(*ngram)
        self.index.extend(context)
        self.longest = longest
        self.length = LookupLength(longest, min(2, longest))
        self.nodes: list[int] = []  # the last guess's nodes in its tree

    def add_to(self, tree: DraftTree, room: int) -> DraftTree:
        """``tree`` with this step's guess (at most ``room`` tokens) merged in as a branch."""
        _, guess = self.index.match(min(self.length.length, room))
        self.nodes = []
        if guess:
            tree, self.nodes = merge_chain(tree, guess, self.longest)
        return tree

    def observe(self, path: Sequence[int], new_ids: Iterable[int]) -> None:
        """The step's accepted node indices and its committed tokens: index them, adapt the length."""
        self.index.extend(new_ids)
        on_path = set(path)
        self.length.observe(len(self.nodes), sum(1 for i in self.nodes if i in on_path))


def chain_is_path(tree: DraftTree) -> bool:
    """True when every node's parent is the node before it (a chain: the causal verify fits)."""
    return all(p == i - 1 for i, p in enumerate(tree.parents))
