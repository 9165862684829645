"""Choosing the reduced draft vocabulary: coverage of held-out answers against head cost.

A drafter with a reduced vocabulary scores only N token ids (the most frequent answer tokens of the
training data). A target token outside them can never be drafted: the out-of-vocabulary (OOV) share
of held-out answer tokens is a hard ceiling on acceptance at every slot. The head costs 2*N*D
multiply-adds per drafted slot, next to about 2*P for the drafter's P layer parameters.

A fine-tuned drafter (``--from-drafter``) ranks its source's draft vocabulary first (``prior``):
those ids stand for the earlier datasets' answers, which this run's data no longer holds, so a
fine-tune on new data widens the vocabulary instead of trading old tokens for new ones.

``coverage_report`` measures the OOV share on the held-out shard for a range of N;
``choose_size`` picks the smallest N whose OOV share is at most ``max_oov`` (``--draft-vocab auto``),
or the full vocabulary when the training data cannot reach it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from runtime.train.shards import ShardDataset
from runtime.train.specs import DrafterSpec

SIZES = (2048, 4096, 8192, 12288, 16384, 24576, 32768, 49152, 65536)
ROUND = 512  # an auto size is rounded up to a multiple of this (matmul-friendly)


def answer_counts(dataset: Any) -> Counter[int]:
    """Frequencies of the target's answer choices in a ``ShardDataset`` (prompt tokens are not
    drafted; for teacher-forced text, the target's argmax rather than the text)."""
    counts: Counter[int] = Counter()
    for shard in dataset.shards:
        for j in range(shard.num_sequences):
            ans = shard.answer_labels(j)
            ids, c = torch.unique(ans, return_counts=True)
            counts.update(dict(zip(ids.tolist(), c.tolist(), strict=True)))
    return counts


def ranked_tokens(counts: Counter[int], prior: Sequence[int] = ()) -> list[int]:
    """Token ids, most frequent first (ties: smaller id first, so the order is reproducible); the
    ``prior`` ids (a source drafter's vocabulary) come before all others, in the same order."""
    first = {int(t) for t in prior}
    return sorted(set(counts) | first, key=lambda t: (t not in first, -counts.get(t, 0), t))


def _first_n(ranked: Sequence[int], n: int, always: Sequence[int]) -> set[int]:
    """The ``always`` ids plus the first ranked ids beyond them, ``n`` ids in all (fewer when the
    ranking runs out)."""
    fixed = {int(t) for t in always}
    return {*[t for t in ranked if t not in fixed][: max(n - len(fixed), 0)], *fixed}


def oov_share(ranked: Sequence[int], heldout: Counter[int], n: int, always: Sequence[int] = ()) -> float:
    """Share of held-out answer tokens outside the top-``n`` ranked ids (plus ``always``)."""
    total = sum(heldout.values())
    if total == 0:
        return 0.0
    keep = _first_n(ranked, n, always)
    return 1.0 - sum(c for t, c in heldout.items() if t in keep) / total


def coverage_report(
    train_counts: Counter[int],
    heldout: Counter[int],
    vocab_size: int,
    hidden_size: int,
    layer_params: int,
    sizes: Sequence[int] = SIZES,
    always: Sequence[int] = (),
    prior: Sequence[int] = (),
) -> dict[str, Any]:
    """OOV share of held-out answer tokens and head cost for each candidate draft vocabulary size.

    Args:
        train_counts: answer-token counts of the training shards (the ranking).
        heldout: answer-token counts of the held-out shard(s).
        vocab_size: the target's full vocabulary V.
        hidden_size: D.
        layer_params: parameters of the drafter's decoder layers (their cost per slot, 2 flops each).
        sizes: candidate N (capped at the ids seen in training; the full vocabulary is added).
        always: ids always kept (EOS).
        prior: ids ranked first (a source drafter's vocabulary; see the module docstring).

    Returns:
        ``rows``: [{"n", "oov_share", "head_mflops_per_slot", "head_share"}], the last row being
        the full vocabulary (``n`` = V, OOV 0); plus counts of tokens seen.
    """
    ranked = ranked_tokens(train_counts, prior)
    seen = len(set(ranked) | set(always))
    cands = sorted({n for n in sizes if n < seen} | {seen})
    rows = []
    for n in [*cands, vocab_size]:
        head = 2.0 * n * hidden_size
        rows.append(
            {
                "n": int(n),
                "oov_share": round(oov_share(ranked, heldout, n, always) if n < vocab_size else 0.0, 5),
                "head_mflops_per_slot": round(head / 1e6, 2),
                "head_share": round(head / (head + 2.0 * layer_params), 3),
            }
        )
    return {
        "heldout_answer_tokens": int(sum(heldout.values())),
        "train_answer_tokens": int(sum(train_counts.values())),
        "distinct_train_tokens": len(train_counts),
        "prior_ids": len(set(prior)),
        "vocab_size": int(vocab_size),
        "rows": rows,
    }


def choose_size(
    train_counts: Counter[int],
    heldout: Counter[int],
    vocab_size: int,
    max_oov: float = 0.01,
    always: Sequence[int] = (),
    prior: Sequence[int] = (),
) -> int:
    """The smallest N (rounded up to a multiple of ``ROUND``) whose held-out OOV share is at most
    ``max_oov``; 0 (the full vocabulary) when even every token seen in training misses it, or when
    N would exceed half the vocabulary (the head then costs about as much as the full one)."""
    ranked = ranked_tokens(train_counts, prior)
    total = sum(heldout.values())
    if total == 0:
        return 0
    keep = set(always)
    covered = sum(heldout.get(t, 0) for t in keep)
    n = len(keep)
    for t in ranked:
        if 1.0 - covered / total <= max_oov:
            break
        if t not in keep:
            keep.add(t)
            covered += heldout.get(t, 0)
            n += 1
    if 1.0 - covered / total > max_oov:
        return 0
    n = -(-n // ROUND) * ROUND
    return 0 if n > vocab_size // 2 else min(n, len(set(ranked) | set(always)))


def vocab_ids(
    train_counts: Counter[int], n: int, always: Sequence[int] = (), prior: Sequence[int] = ()
) -> torch.Tensor:
    """The draft vocabulary: the first ``n`` ranked ids (``prior``, then the most frequent training
    answer tokens) plus ``always``, sorted."""
    return torch.tensor(sorted(_first_n(ranked_tokens(train_counts, prior), n, always)), dtype=torch.long)


def choose_draft_vocab(
    drafter: Any, train: ShardDataset, val: ShardDataset, spec: DrafterSpec, vocab_size: int, always: Sequence[int]
) -> dict[str, Any]:
    """Set ``drafter.draft_vocab_ids`` from ``spec.draft_vocab`` (N, 0 = full, or "auto") and return
    the coverage report (OOV share on the held-out shard vs N, head cost; ``runtime.train.vocab``).
    A drafter that already has a reduced vocabulary (a warm start) keeps its ids ranked first."""
    train_counts = answer_counts(train)
    held = answer_counts(val)
    source = drafter.draft_vocab_ids
    prior = source.tolist() if source is not None else []
    layer_params = sum(p.numel() for p in drafter.layers.parameters())
    report = coverage_report(
        train_counts, held, vocab_size, drafter.config.hidden_size, layer_params, always=always, prior=prior
    )
    if spec.draft_vocab == "auto":
        n = choose_size(train_counts, held, vocab_size, spec.max_oov, always, prior)
        rule = f"auto: smallest N with held-out OOV share <= {spec.max_oov:.1%} (0 = full vocabulary)"
    else:
        n = int(spec.draft_vocab)
        rule = "given" if n else "full vocabulary"
    drafter.draft_vocab_ids = vocab_ids(train_counts, n, always, prior) if n else None
    chosen = int(drafter.draft_vocab_ids.numel()) if n else vocab_size
    report["chosen"] = {
        "n": chosen,
        "full": not n,
        "rule": rule,
        "oov_share": round(oov_share(ranked_tokens(train_counts, prior), held, chosen, always), 5) if n else 0.0,
    }
    return report


class DraftVocab:
    """Map full-vocab labels to draft-vocab indices (-100 for ids outside the draft vocab)."""

    def __init__(self, ids: torch.Tensor | None, vocab_size: int) -> None:
        self.ids = ids
        if ids is not None:
            self.lookup = torch.full((vocab_size,), -100, dtype=torch.long)
            self.lookup[ids] = torch.arange(ids.numel())

    def map(self, labels: torch.Tensor) -> torch.Tensor:
        """Labels as indices into the draft head."""
        if self.ids is None:
            return labels
        out = torch.full_like(labels, -100)
        ok = labels >= 0
        out[ok] = self.lookup[labels[ok]]
        return out
