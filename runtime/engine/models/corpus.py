"""Corpus n-gram proposals: what the target usually writes after the last few tokens (pure functions).

The context lookup (``runtime.engine.lookup``) copies what followed the same tokens earlier in the
request. Where the request holds no such match, the target's own habits still do: after
``for i in range(`` it writes ``len`` more often than anything else, whatever the request. A
``CorpusTable`` keeps, for every 2..4-token n-gram seen at least twice in the target's answers to
the training prompts, the token that most often followed it and how often it did: its confidence
level, 0 (less than half of the time), 1 (at least half) or 2 (at least 80%). A drafter with a corpus
(``dflash_config.copy_corpus``) is shown the table's proposal as its copy input where the context's
match is shorter than two tokens, and learns per n-gram size and confidence level how far to trust it
(``DFlashDraftModel.copy_bias``). On the target's answers to unseen requests a level-2 proposal is
right about three times in four, a level-0 one about once in seven.

Nothing here changes the output: the target verifies every draft. The table ships next to the
drafter's weights as ``corpus.safetensors`` (hashed keys, next ids, confidence levels).

``CorpusCounts`` is the training side: full counts over the training answers, exported as a table,
and queried leaving one sequence's own n-grams (and its near-duplicates') out, so that a training
sequence is shown what the rest of the corpus proposes (as an unseen request would be), not its own
continuation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

CORPUS_FILE = "corpus.safetensors"
MIN_COUNT = 2  # an n-gram seen once proposes nothing
_MOD = (1 << 61) - 1  # keys are hashed into int64 (a collision only costs a wrong guess, never output)

LEVELS = 3  # confidence levels: the best continuation's share < 1/2, >= 1/2, >= 4/5

# (n-gram size, key) -> (next id, confidence level) or None
Query = Callable[[int, Sequence[int]], "tuple[int, int] | None"]


def key_hash(tokens: Sequence[int]) -> int:
    """Hash of an n-gram (the same in training and at run time)."""
    h = 0
    for t in tokens:
        h = (h * 1_000_003 + int(t) + 1) % _MOD
    return h


def _best(nexts: dict[int, int], own: dict[int, int] | None = None) -> tuple[int, int] | None:
    """The most frequent next id (ties: smaller id) with its count >= MIN_COUNT, and its confidence
    level (``LEVELS``); ``own`` counts are left out first."""
    best, best_c, total = -1, 0, 0
    for tok, c in nexts.items():
        if own:
            c -= own.get(tok, 0)
        total += c
        if c > best_c or (c == best_c and c > 0 and tok < best):
            best, best_c = tok, c
    if best_c < MIN_COUNT:
        return None
    return best, 2 if 5 * best_c >= 4 * total else 1 if 2 * best_c >= total else 0


class CorpusTable:
    """The shipped table: per n-gram size, key hash -> (next id, confidence level).

    Args:
        ngram: (shortest, longest) n-gram size (>= 1).
        tables: per size n, {key hash: (next id, confidence level)}.
    """

    def __init__(self, ngram: tuple[int, int], tables: dict[int, dict[int, tuple[int, int]]]) -> None:
        if not 1 <= ngram[0] <= ngram[1]:
            raise ValueError(f"corpus n-gram sizes need 1 <= shortest <= longest, got {list(ngram)}")
        self.ngram = (int(ngram[0]), int(ngram[1]))
        self.tables = {n: tables.get(n, {}) for n in range(self.ngram[0], self.ngram[1] + 1)}

    def __len__(self) -> int:
        return sum(len(t) for t in self.tables.values())

    def query(self, n: int, key: Sequence[int]) -> tuple[int, int] | None:
        """The proposal after ``key`` (an n-gram of size ``n``), or None."""
        table = self.tables.get(n)
        return table.get(key_hash(key)) if table else None

    def save(self, folder: Path) -> Path:
        """Write ``corpus.safetensors`` into ``folder``."""
        from safetensors.torch import save_file

        state: dict[str, torch.Tensor] = {}
        for n, table in self.tables.items():
            keys = sorted(table)
            state[f"keys_{n}"] = torch.tensor(keys, dtype=torch.int64)
            state[f"next_{n}"] = torch.tensor([table[k][0] for k in keys], dtype=torch.int32)
            state[f"level_{n}"] = torch.tensor([table[k][1] for k in keys], dtype=torch.uint8)
        path = Path(folder) / CORPUS_FILE
        tmp = path.with_suffix(".tmp")
        save_file(state, str(tmp), metadata={"ngram": f"{self.ngram[0]},{self.ngram[1]}"})
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, folder: Path, ngram: tuple[int, int], vocab_size: int | None = None) -> CorpusTable:
        """Read ``corpus.safetensors`` from a drafter folder, checking every table.

        Args:
            folder: the drafter folder.
            ngram: (shortest, longest) n-gram size the drafter's config declares.
            vocab_size: the vocabulary the next ids must fall in (None: not checked).

        Raises:
            FileNotFoundError: the folder has no corpus file.
            ValueError: the file lacks a table of one of the sizes, or a table does not fit
                (not 1-D integers, lengths that differ, next ids outside the vocabulary, levels
                outside ``0..LEVELS - 1``); the message names the file and the tensor.
        """
        from safetensors.torch import load_file

        path = Path(folder) / CORPUS_FILE
        if not path.exists():
            raise FileNotFoundError(path)
        state = load_file(str(path))
        tables: dict[int, dict[int, tuple[int, int]]] = {}
        for n in range(ngram[0], ngram[1] + 1):
            try:
                keys, nxt, conf = state[f"keys_{n}"], state[f"next_{n}"], state[f"level_{n}"]
            except KeyError as e:
                raise ValueError(f"{path} has no table for {n}-grams ({e})") from e
            for name, t, top in (
                (f"keys_{n}", keys, None),
                (f"next_{n}", nxt, vocab_size),
                (f"level_{n}", conf, LEVELS),
            ):
                _check_column(path, name, t, len(keys), top)
            pairs = zip(nxt.tolist(), conf.tolist(), strict=True)
            tables[n] = dict(zip(keys.tolist(), pairs, strict=True))
        return cls(ngram, tables)


def _check_column(path: Path, name: str, t: torch.Tensor, length: int, top: int | None) -> None:
    """One tensor of a corpus table: 1-D integers, ``length`` entries, in [0, top) unless ``top`` is None."""
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise ValueError(f"{path}: {name} must hold integers, got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != 1:
        raise ValueError(f"{path}: {name} must be 1-D, got shape {list(t.shape)}")
    if t.numel() != length:
        raise ValueError(f"{path}: {name} has {t.numel()} entries for {length} keys")
    if top is not None and t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= top:
            raise ValueError(f"{path}: {name} holds {lo if lo < 0 else hi}, outside [0, {top})")


class CorpusCounts:
    """Counts of what followed every n-gram in the target's answers (the training side).

    Generated datasets overlap: an answers dataset edits the code of another dataset's answers, so
    two sequences can hold the same code. A sequence is therefore shown the corpus without itself
    and without its near-duplicates (``link_near_duplicates``), as an unseen request would be.

    Args:
        ngram: (shortest, longest) n-gram size.
    """

    def __init__(self, ngram: tuple[int, int]) -> None:
        if not 1 <= ngram[0] <= ngram[1]:
            raise ValueError(f"corpus n-gram sizes need 1 <= shortest <= longest, got {list(ngram)}")
        self.ngram = (int(ngram[0]), int(ngram[1]))
        self.counts: dict[int, dict[tuple[int, ...], dict[int, int]]] = {
            n: {} for n in range(self.ngram[0], self.ngram[1] + 1)
        }
        self.answer_tokens = 0
        self.sequences: list[tuple[list[int], int, list[int] | None]] = []
        self._index: dict[tuple[int, ...], int] = {}
        self.neighbours: list[list[int]] = []

    def add(self, tokens: Sequence[int], prompt_len: int, labels: Sequence[int] | None = None) -> None:
        """Count one sequence: every answer token after each of its preceding n-grams (the n-gram
        may reach into the prompt).

        Args:
            tokens: prompt + answer ids.
            prompt_len: prompt tokens (context only, never counted as a continuation).
            labels: for real text scored by the target, its own choice at each answer position
                (what it would have written there), counted after the text's n-grams; None when
                the answer tokens are the target's choices.
        """
        seq = [int(t) for t in tokens]
        lab = [int(t) for t in labels] if labels is not None else None
        for n, (key, tok) in _answer_ngrams(seq, prompt_len, self.ngram, lab):
            nexts = self.counts[n].setdefault(key, {})
            nexts[tok] = nexts.get(tok, 0) + 1
        self.answer_tokens += max(len(seq) - max(prompt_len, 1), 0)
        self._index.setdefault(tuple(seq), len(self.sequences))
        self.sequences.append((seq, int(prompt_len), lab))
        self.neighbours.append([])

    def link_near_duplicates(self, n: int = 8, max_df: int = 20, min_shared: int = 4) -> float:
        """Mark sequences that share at least ``min_shared`` rare ``n``-grams (in at most ``max_df``
        sequences: boilerplate is not a duplicate) as each other's near-duplicates.

        Returns:
            the mean number of near-duplicates per sequence.
        """
        grams = [{hash(tuple(seq[i : i + n])) for i in range(len(seq) - n + 1)} for seq, _, _ in self.sequences]
        owners: dict[int, list[int]] = {}
        for i, g in enumerate(grams):
            for h in g:
                owners.setdefault(h, []).append(i)
        shared: dict[tuple[int, int], int] = {}
        for ids in owners.values():
            if 2 <= len(ids) <= max_df:
                for x in range(len(ids)):
                    for y in range(x + 1, len(ids)):
                        pair = (ids[x], ids[y])
                        shared[pair] = shared.get(pair, 0) + 1
        self.neighbours = [[] for _ in self.sequences]
        for (x, y), c in shared.items():
            if c >= min_shared:
                self.neighbours[x].append(y)
                self.neighbours[y].append(x)
        return sum(map(len, self.neighbours)) / max(len(self.sequences), 1)

    def table(self) -> CorpusTable:
        """What ships: the best next id of every n-gram seen at least ``MIN_COUNT`` times."""
        tables: dict[int, dict[int, tuple[int, int]]] = {}
        for n, keys in self.counts.items():
            out: dict[int, tuple[int, int]] = {}
            for key, nexts in keys.items():
                best = _best(nexts)
                if best is not None:
                    out[key_hash(key)] = best
            tables[n] = out
        return CorpusTable(self.ngram, tables)

    def query_for(self, tokens: Sequence[int] | None = None) -> Query:
        """A query over the counts; given a counted sequence, its own n-grams and its
        near-duplicates' are left out."""
        own: dict[int, dict[tuple[int, ...], dict[int, int]]] = {}
        i = self._index.get(tuple(int(t) for t in tokens)) if tokens is not None else None
        if i is not None:
            for j in (i, *self.neighbours[i]):
                seq, plen, lab = self.sequences[j]
                for n, (key, tok) in _answer_ngrams(seq, plen, self.ngram, lab):
                    nexts = own.setdefault(n, {}).setdefault(key, {})
                    nexts[tok] = nexts.get(tok, 0) + 1

        def query(n: int, key: Sequence[int]) -> tuple[int, int] | None:
            k = tuple(key)
            nexts = self.counts.get(n, {}).get(k)
            if not nexts:
                return None
            return _best(nexts, own.get(n, {}).get(k))

        return query


def _answer_ngrams(
    seq: Sequence[int], prompt_len: int, ngram: tuple[int, int], labels: Sequence[int] | None = None
) -> Iterable[tuple[int, tuple[tuple[int, ...], int]]]:
    for p in range(max(prompt_len, 1), len(seq)):
        if labels is not None:
            i = p - prompt_len
            if not 0 <= i < len(labels) or labels[i] < 0:
                continue
            tok = labels[i]
        else:
            tok = seq[p]
        for n in range(ngram[0], min(ngram[1], p) + 1):
            yield n, (tuple(seq[p - n : p]), tok)


def corpus_rows(ngram: tuple[int, int]) -> int:
    """Rows of ``copy_scale`` / ``copy_bias`` the corpus adds: one per size and confidence level."""
    return LEVELS * (ngram[1] - ngram[0] + 1)


def corpus_chain(
    query: Query, context: Sequence[int], ngram: tuple[int, int], length: int, first_row: int
) -> tuple[list[int], list[int]]:
    """Follow the table from the end of ``context`` for up to ``length`` tokens.

    Each token is the proposal after the longest n-gram (``ngram`` sizes) ending at the context
    plus the tokens proposed before it; the chain stops where no size has one.

    Returns:
        (proposed ids, their copy rows: ``first_row + LEVELS * (n - shortest) + level``).
    """
    lo, hi = ngram
    tail = [int(t) for t in context[-hi:]]
    ids: list[int] = []
    rows: list[int] = []
    for _ in range(length):
        hit = None
        for n in range(min(hi, len(tail)), lo - 1, -1):
            hit = query(n, tail[len(tail) - n :])
            if hit is not None:
                ids.append(hit[0])
                rows.append(first_row + LEVELS * (n - lo) + hit[1])
                tail = [*tail[1:], hit[0]] if len(tail) >= hi else [*tail, hit[0]]
                break
        if hit is None:
            break
    return ids, rows
