"""What followed the context's earlier occurrences of its last tokens (pure functions).

``NgramIndex`` keeps, for every n-gram of length ``min_n..max_n`` in a growing context, where it
last ended; a query takes the longest suffix of the context that occurred before and returns what
followed its latest occurrence. One index per request serves both users: the drafter's copy inputs
(``block_copies``) and the context lookup (``runtime.engine.lookup``), each with its own sizes.
"""

from __future__ import annotations

from collections.abc import Iterable

from runtime.engine.models.corpus import Query, corpus_chain

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

    def match(self, length: int, ngram: tuple[int, int] | None = None) -> tuple[int, list[int]]:
        """What followed the latest earlier occurrence of the longest matching suffix.

        Args:
            length: tokens wanted.
            ngram: (shortest, longest) suffix to try, within the index's own sizes (default: those):
                one index serves users that match different sizes.

        A match whose continuation runs into the context's end is read as a period and repeated
        (``a b c a b`` continues ``c a b c ...``).

        Returns:
            (n-gram size matched, ``length`` tokens); (0, []) when no suffix of at least ``min_n``
            tokens occurred before.
        """
        seq = self.tokens
        if length <= 0:
            return 0, []
        lo, hi = ngram if ngram is not None else (self.min_n, self.max_n)
        if lo < self.min_n or hi > self.max_n:
            raise ValueError(f"n-gram sizes {lo}..{hi} are outside the index's {self.min_n}..{self.max_n}")
        for n in range(min(hi, len(seq)), lo - 1, -1):
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
    ngram: tuple[int, int] | None = None,
) -> tuple[list[int], list[int]]:
    """The copy inputs of one drafter block (``DFlashDraftModel.copy_inputs``).

    ``index`` holds the context up to and including the block's anchor (``ngram``: the suffix sizes
    the copy inputs match, default the index's own); slot k (1..b-1) is shown
    the k-th token of what followed the latest earlier occurrence of its longest matching suffix.
    With a ``corpus`` (a drafter with ``dflash_config.copy_corpus``), where that match is shorter
    than ``CONTEXT_FIRST`` tokens the slots are shown the corpus chain instead
    (``runtime.engine.models.corpus.corpus_chain``) when it has a first token.

    Returns:
        ([b] token ids, ``fill`` where there is none; [b] copy row per position: the matched
        n-gram size for a context copy, ``ngram[1] + 1 + ...`` for a corpus proposal, 0 at the
        anchor and wherever nothing is proposed).
    """
    lo, hi = ngram if ngram is not None else (index.min_n, index.max_n)
    n, guess = index.match(block_size - 1, (lo, hi))
    if corpus is not None and n < CONTEXT_FIRST:
        ids, rows = corpus_chain(corpus, index.tokens, corpus_ngram, block_size - 1, hi + 1)
        if ids:
            pad = block_size - 1 - len(ids)
            return [fill, *ids, *[fill] * pad], [0, *rows, *[0] * pad]
    if not guess:
        return [fill] * block_size, [0] * block_size
    return [fill, *guess], [0] + [n] * (block_size - 1)
