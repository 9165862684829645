"""Pack sequences into one block-sparse training batch (``build_batch``), with the copy inputs
the decoder would show each block and, for a drafter with a corpus table, the corpus counts over
the training answers (``count_corpus``, ``CorpusSource``)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.engine.models.corpus import CorpusCounts, CorpusTable, Query
from runtime.engine.ngram import NgramIndex, block_copies
from runtime.train.shards import ShardDataset


@dataclass
class CorpusSource:
    """Where ``build_batch`` gets each sequence's corpus query (``runtime.engine.models.corpus``).

    Attributes:
        ngram: the table's (shortest, longest) n-gram size.
        counts: training counts; with ``leave_out`` a counted sequence is shown what the rest of
            the corpus proposes (its own n-grams left out), as an unseen request would be.
        table: a shipped table (evaluating a saved drafter), used when there are no counts.
    """

    ngram: tuple[int, int]
    counts: CorpusCounts | None = None
    table: CorpusTable | None = None
    leave_out: bool = False

    def query(self, tokens: Sequence[int]) -> Query:
        """The query for one sequence."""
        if self.counts is not None:
            return self.counts.query_for(tokens if self.leave_out else None)
        assert self.table is not None, "a CorpusSource needs counts or a table"
        return self.table.query


def count_corpus(datasets: Sequence[ShardDataset], ngram: tuple[int, int], max_len: int) -> CorpusCounts:
    """Corpus counts over the target's answers in ``datasets``, each sequence cut to ``max_len``
    tokens as training reads it, so that leaving a sequence out removes exactly what it added. In
    teacher-forced text the target's own choice at each position is counted after the text's
    n-gram (what it would have written there)."""
    counts = CorpusCounts(ngram)
    for ds in datasets:
        for shard in ds.shards:
            for j in range(shard.num_sequences):
                a, b = int(shard.offsets[j]), int(shard.offsets[j + 1])
                plen = int(shard.prompt_len[j])
                tokens = shard.tokens[a : min(b, a + max_len)].tolist()
                labels = shard.answer_labels(j).tolist() if shard.teacher_forced else None
                counts.add(tokens, plen, labels)
    counts.link_near_duplicates()
    return counts


def build_batch(
    seqs: Sequence[tuple[torch.Tensor, torch.Tensor, int]],
    anchors: int,
    block_size: int,
    mask_id: int,
    rng: random.Random,
    soft: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
    targets: Sequence[torch.Tensor | None] | None = None,
    copy_ngram: tuple[int, int] | None = None,
    corpus: CorpusSource | None = None,
    candidates: Sequence[Sequence[int] | None] | None = None,
) -> dict[str, torch.Tensor] | None:
    """Pack sequences into one block-sparse training batch.

    Args:
        soft: per sequence, its top-k ids and log-probs (``ShardDataset.get_topk``); when given
            for every sequence, the batch also carries ``soft_ids`` / ``soft_logp``.
        targets: per sequence, the target's own choice at each position (``ShardDataset.get_labels``)
            or None when its tokens are the target's choices. With them, slot k of a block
            anchored at ``a`` is labelled with the target's choice for ``a+k`` only while the
            tokens ``a+1 .. a+k-1`` agree with the target's choices (what the target would verify
            after those drafts); later slots are ignored.
        copy_ngram: with a drafter that has copy inputs, its n-gram sizes: each block also gets the
            context lookup's proposal over the sequence's tokens up to its anchor, exactly as the
            decoder computes it (``runtime.engine.ngram.block_copies``).
        corpus: with a drafter that has a corpus table: sequence tokens -> the query its copy
            inputs use for that sequence (``CorpusSource``), and the table's n-gram sizes.
        candidates: per sequence, the anchors to sample from (None: every answer position).

    Returns:
        ``features`` [B, C, n*D], ``block_ids`` [B, A*b], ``labels`` [B, A, b-1] (-100 = ignore),
        ``positions`` [B, C + A*b], ``mask`` [B, 1, A*b, C + A*b] (True = may attend), and with
        ``soft``: ``soft_ids`` [B, A, b-1, k] (-1 = none) and ``soft_logp`` [B, A, b-1, k]; with
        ``copy_ngram``: ``copy_ids`` / ``copy_n`` [B, A*b]; None when no sequence has an answer
        token to anchor on.
    """
    b = block_size
    picked = []
    use_soft = soft is not None and all(x is not None for x in soft)
    soft_picked: list[tuple[torch.Tensor, torch.Tensor]] = []
    for si, (tokens, feats, plen) in enumerate(seqs):
        t = tokens.numel()
        lo = max(plen, 1)
        cands = list(range(lo, t - 1))
        if candidates is not None and candidates[si] is not None:
            cands = [a for a in candidates[si] or () if lo <= a < t - 1]
        if not cands:
            continue
        chosen = sorted(rng.sample(cands, min(anchors, len(cands))))
        picked.append((tokens, feats, chosen, targets[si] if targets is not None else None))
        if use_soft:
            entry = soft[si] if soft is not None else None
            assert entry is not None  # use_soft: every sequence has its top-k
            soft_picked.append(entry)
    if not picked:
        return None
    n, a_max = len(picked), max(len(c) for _, _, c, _ in picked)
    c_len = max(tok.numel() - 1 for tok, _, _, _ in picked)
    q = a_max * b
    feat_dim = picked[0][1].shape[-1]
    features = torch.zeros((n, c_len, feat_dim), dtype=picked[0][1].dtype)
    block_ids = torch.full((n, q), mask_id, dtype=torch.long)
    labels = torch.full((n, a_max, b - 1), -100, dtype=torch.long)
    positions = torch.zeros((n, c_len + q), dtype=torch.long)
    mask = torch.zeros((n, 1, q, c_len + q), dtype=torch.bool)
    positions[:, :c_len] = torch.arange(c_len)
    ks = torch.arange(1, b)
    if use_soft:
        k_top = soft_picked[0][0].shape[1]
        soft_ids = torch.full((n, a_max, b - 1, k_top), -1, dtype=torch.long)
        soft_logp = torch.zeros((n, a_max, b - 1, k_top), dtype=torch.float32)
    if copy_ngram is not None:
        copy_ids = torch.full((n, q), mask_id, dtype=torch.long)
        copy_n = torch.zeros((n, q), dtype=torch.long)
    for i, (tokens, feats, chosen, tgt) in enumerate(picked):
        t = tokens.numel()
        if copy_ngram is not None:  # the decoder's copy inputs: the context up to each anchor (sorted)
            seq, index = tokens.tolist(), NgramIndex(*copy_ngram)
            query = corpus.query(seq) if corpus is not None else None
            for j, a in enumerate(chosen):
                index.extend(seq[len(index.tokens) : a + 1])
                if query is not None and corpus is not None:
                    ids, matched = block_copies(index, b, mask_id, query, corpus.ngram)
                else:
                    ids, matched = block_copies(index, b, mask_id)
                copy_ids[i, j * b : (j + 1) * b] = torch.tensor(ids)
                copy_n[i, j * b : (j + 1) * b] = torch.tensor(matched)
        if tgt is not None:
            agree = torch.cat([tokens == tgt, torch.zeros(b, dtype=torch.bool)])
        features[i, : t - 1] = feats[: t - 1]
        for j in range(a_max):
            qs = slice(j * b, (j + 1) * b)
            mask[i, 0, qs, c_len + j * b : c_len + (j + 1) * b] = True  # own block, bidirectional
            if j >= len(chosen):
                continue
            a = chosen[j]
            block_ids[i, j * b] = tokens[a]
            positions[i, c_len + j * b : c_len + (j + 1) * b] = torch.arange(a, a + b)
            mask[i, 0, qs, :a] = True  # context strictly before the anchor
            valid = (a + ks) < t
            if tgt is None:
                labels[i, j, valid] = tokens[(a + ks)[valid]]
            else:  # slot k needs tokens a+1..a+k-1 to be the target's own choices
                prefix = torch.cat([torch.ones(1, dtype=torch.bool), agree[a + 1 : a + b - 1]]).cumprod(0).bool()
                valid = valid & prefix
                labels[i, j, valid] = tgt[(a + ks)[valid]]
                valid = valid & (labels[i, j] >= 0)
            if use_soft:
                ids_i, logp_i = soft_picked[i]
                soft_ids[i, j, valid] = ids_i[(a + ks)[valid]]
                soft_logp[i, j, valid] = logp_i[(a + ks)[valid]]
    out = {"features": features, "block_ids": block_ids, "labels": labels, "positions": positions, "mask": mask}
    if use_soft:
        out["soft_ids"], out["soft_logp"] = soft_ids, soft_logp
    if copy_ngram is not None:
        out["copy_ids"], out["copy_n"] = copy_ids, copy_n
    return out
