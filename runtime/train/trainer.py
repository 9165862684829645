"""Drafter training (docs/method.md "Training recipe", docs/training.md): frozen target embedding and head, features from the
tapped target layers, random anchors, block-sparse attention, position-decayed cross-entropy,
AdamW with warm-up and cosine decay, checkpoints that resume and continue over several runs.

One step packs ``seqs_per_step`` sequences; each contributes ``anchors`` blocks of ``block_size``
slots. A block query sees the context features strictly before its anchor plus every slot of its
own block, nothing of other blocks. Slot k (1..b-1) is trained to predict the token at anchor + k,
weighted exp(-(k-1)/gamma).

Distillation (``distill``): "hard" trains on the target's greedy token only; "soft" mixes in a soft
cross-entropy against the target's own distribution at that position, restricted to the top-k
tokens the dataset stored (renormalised over those inside the draft vocabulary):
loss = (1 - soft_weight) * CE(hard label) + soft_weight * CE(top-k target distribution).
Soft CE and KL differ by the target's entropy, a constant, so they have the same gradient.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from runtime.engine.models.corpus import CorpusCounts, CorpusTable, Query
from runtime.engine.models.drafter import DFlashDraftModel, draft_columns_to_ids
from runtime.engine.models.drafter_io import load_draft_model, save_draft_model
from runtime.engine.ngram import NgramIndex, block_copies
from runtime.errors import ConfigError
from runtime.train.data import Shard, load_shard
from runtime.train.losses import fused_head_loss, head_argmax
from runtime.train.state import load_trainer_state, save_trainer_state

Progress = Callable[[dict[str, Any]], None]
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


COPY_LR_SCALE = 100.0  # default learning-rate multiplier of a drafter's copy inputs (TrainConfig.copy_lr)


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of a training run (recorded in the checkpoint and the model card).

    Attributes:
        seqs_per_step: sequences per optimiser step.
        anchors: blocks sampled per sequence.
        max_len: sequences are cut to this many tokens.
        lr: peak learning rate; ``min_lr_ratio`` of it at the end of the cosine.
        warmup: share of the schedule spent warming up linearly.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        grad_clip: gradient-norm clip.
        gamma: slot weight decay exp(-(k-1)/gamma) (None: 7/5/4 for b = 16/10/8, else b/2).
        steps: optimiser steps of this schedule (None: use ``time_budget``).
        time_budget: wall-clock seconds of this schedule (None: use ``steps``).
        eval_every: validation every N steps.
        checkpoint_every: seconds between checkpoints.
        seed: sampling seed.
        bf16: autocast matmuls to bfloat16.
        distill: "hard" (greedy labels only) or "soft" (plus the stored top-k distribution).
        soft_weight: share of the soft term in the loss when ``distill`` is "soft".
        copy_lr: peak learning rate of a drafter's copy inputs (``copy_scale``, ``copy_bias``; they
            start at 0 and must grow to several units), or None for ``COPY_LR_SCALE`` x ``lr``.
            A low ``lr`` with a high ``copy_lr`` teaches the copy inputs while the layers move little.
        anchor_sampling: "uniform" (blocks anchored anywhere in the answer) or "walk" (a window of
            ``anchors`` consecutive anchors per sequence, of which only those a chain decoder would
            visit with the drafter as it is now are trained on: the step's own drafts are walked,
            ``Trainer.walk_rows``, before the loss is taken).
        walk_seqs: held-out sequences that ``validate`` walks for ``tau_walk``.
    """

    seqs_per_step: int = 2
    anchors: int = 48
    max_len: int = 640
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup: float = 0.04
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    gamma: float | None = None
    steps: int | None = None
    time_budget: float | None = None
    eval_every: int = 200
    checkpoint_every: float = 300.0
    seed: int = 0
    bf16: bool = True
    distill: str = "hard"
    soft_weight: float = 0.5
    copy_lr: float | None = None
    anchor_sampling: str = "uniform"
    walk_seqs: int = 32

    def __post_init__(self) -> None:
        if self.anchor_sampling not in ("uniform", "walk"):
            raise ConfigError(f"anchor_sampling must be 'uniform' or 'walk', got {self.anchor_sampling!r}")
        if self.copy_lr is not None and not self.copy_lr > 0:
            raise ConfigError(f"copy_lr must be > 0, got {self.copy_lr}")
        if self.distill not in ("hard", "soft"):
            raise ConfigError(f"distill must be 'hard' or 'soft', got {self.distill!r}")
        if not 0.0 <= self.soft_weight <= 1.0:
            raise ConfigError(f"soft_weight must be in [0, 1], got {self.soft_weight}")
        if self.steps is None and self.time_budget is None:
            raise ConfigError("give a number of steps or a time budget for training")
        if self.seqs_per_step < 1 or self.anchors < 1:
            raise ConfigError("seqs_per_step and anchors must be >= 1")


@dataclass
class TrainState:
    """What a checkpoint records besides weights and optimiser moments."""

    step: int = 0
    elapsed: float = 0.0
    segment_start_step: int = 0
    segment_start_elapsed: float = 0.0
    segments: int = 1
    tokens_seen: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


def slot_weights(block_size: int, gamma: float | None) -> torch.Tensor:
    """[b-1] loss weights exp(-(k-1)/gamma) for slots k = 1..b-1."""
    g = gamma if gamma is not None else DEFAULT_GAMMA.get(block_size, max(block_size / 2.0, 1.0))
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / g)


class ShardDataset:
    """Sequences of a set of shards, with the tap columns the drafter uses.

    Args:
        shards: loaded shards.
        data_taps: taps stored in the shards, in order.
        use_taps: taps the drafter consumes (a subset of ``data_taps``), in its order.
        hidden_size: D.
    """

    def __init__(
        self, shards: Sequence[Shard], data_taps: Sequence[int], use_taps: Sequence[int], hidden_size: int
    ) -> None:
        missing = [t for t in use_taps if t not in data_taps]
        if missing:
            raise ConfigError(f"the dataset has no features for target layers {missing} (it has {list(data_taps)})")
        self.shards = list(shards)
        self.index = [(si, j) for si, s in enumerate(self.shards) for j in range(s.num_sequences)]
        d = hidden_size
        cols = [torch.arange(data_taps.index(t) * d, (data_taps.index(t) + 1) * d) for t in use_taps]
        self.columns = torch.cat(cols)
        self.contiguous = bool(torch.equal(self.columns, torch.arange(self.columns.numel()) + int(self.columns[0])))

    def __len__(self) -> int:
        return len(self.index)

    def get(self, i: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(tokens [T], features [T, n*D] bf16, prompt length) of sequence ``i`` cut to ``max_len``."""
        si, j = self.index[i]
        s = self.shards[si]
        a, b = int(s.offsets[j]), int(s.offsets[j + 1])
        b = min(b, a + max_len)
        feats = s.features[a:b]
        if self.contiguous:
            c0 = int(self.columns[0])
            feats = feats[:, c0 : c0 + self.columns.numel()]
        else:
            feats = feats[:, self.columns]
        return s.tokens[a:b], feats, int(s.prompt_len[j])

    def get_labels(self, i: int, max_len: int) -> torch.Tensor | None:
        """The target's own choice for each token of sequence ``i`` [T] (-1 at prompt positions)
        when its shard is teacher-forced text (``runtime.train.text``); None for generated answers,
        whose tokens are the target's choices."""
        si, j = self.index[i]
        s = self.shards[si]
        if not s.teacher_forced:
            return None
        a, b = int(s.offsets[j]), int(s.offsets[j + 1])
        t, plen = min(b - a, max_len), int(s.prompt_len[j])
        out = torch.full((t,), -1, dtype=torch.long)
        out[plen:t] = s.answer_labels(j)[: max(t - plen, 0)]
        return out

    @property
    def has_topk(self) -> bool:
        """Every shard stores the target's top-k distribution (soft labels)."""
        return bool(self.shards) and all(s.topk_ids is not None for s in self.shards)

    def get_topk(self, i: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Top-k ids [T, k] (-1 at prompt positions) and log-probs [T, k] of sequence ``i``, row p
        being the target's distribution for token p; None when its shard has no soft labels."""
        si, j = self.index[i]
        s = self.shards[si]
        if s.topk_ids is None or s.topk_logp is None:
            return None
        a, b = int(s.offsets[j]), int(s.offsets[j + 1])
        t = min(b - a, max_len)
        plen = int(s.prompt_len[j])
        k = s.topk_ids.shape[1]
        ids = torch.full((t, k), -1, dtype=torch.long)
        logp = torch.zeros((t, k), dtype=torch.float32)
        r0 = s.answer_start(j)
        n = max(t - plen, 0)
        ids[plen:t] = s.topk_ids[r0 : r0 + n].long()
        logp[plen:t] = s.topk_logp[r0 : r0 + n].float()
        return ids, logp


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


def build_draft_vocab(dataset: ShardDataset, size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent answer tokens of the dataset (plus ``always``), sorted by id."""
    from runtime.train.vocab import answer_counts

    counts = answer_counts(dataset)
    ranked = sorted(counts, key=lambda t: -counts[t])[: max(size - len(always), 0)]
    return torch.tensor(sorted(set(ranked) | {int(t) for t in always}), dtype=torch.long)


class Trainer:
    """Train a drafter against frozen target embedding/head weights.

    Args:
        drafter: the drafter (float32 master weights).
        embed_weight: [V, D] target embedding (frozen).
        head_weight: [V, D] target lm_head (frozen).
        train: training sequences.
        val: validation sequences (fixed anchors).
        config: hyper-parameters.
        out_dir: run folder (``checkpoint/`` inside).
        device: where to train.
        corpus: for a drafter with a corpus table (``dflash.copy_corpus``), the counts over the
            training answers (``count_corpus``): training leaves each sequence's own n-grams out,
            and the drafter's table becomes theirs. Without them the drafter's own table is used.
    """

    def __init__(
        self,
        drafter: DFlashDraftModel,
        embed_weight: torch.Tensor,
        head_weight: torch.Tensor,
        train: ShardDataset,
        val: ShardDataset | None,
        config: TrainConfig,
        out_dir: Path,
        device: torch.device | str = "cpu",
        corpus: CorpusCounts | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.drafter = drafter.to(self.device).float().train()
        self.embed = embed_weight.to(self.device)
        ids = drafter.draft_vocab_ids
        self.vocab = DraftVocab(ids.cpu() if ids is not None else None, head_weight.shape[0])
        head = head_weight[ids.to(head_weight.device)] if ids is not None else head_weight
        self.head = head.to(self.device).contiguous()
        # the copy inputs' pointer scores a proposal outside the draft vocabulary from the full head
        self.full_head = head_weight if drafter.dflash.copy_ngram is not None else None
        if not config.bf16:  # float32 end to end (tests, exactness checks)
            self.head, self.embed = self.head.float(), self.embed.float()
        self.train_data, self.val_data = train, val
        self.cfg = config
        self.out_dir = Path(out_dir)
        self.block = drafter.dflash.block_size
        self.mask_id = drafter.dflash.mask_token_id
        self.weights = slot_weights(self.block, config.gamma).to(self.device)
        self.copy_ngram = drafter.dflash.copy_ngram
        self.corpus_train: CorpusSource | None = None
        self.corpus_eval: CorpusSource | None = None
        grams = drafter.dflash.copy_corpus
        if grams is not None and corpus is not None:
            self.drafter.corpus = corpus.table()
            self.corpus_train = CorpusSource(grams, counts=corpus, leave_out=True)
            self.corpus_eval = CorpusSource(grams, table=self.drafter.corpus)
        elif grams is not None:
            if self.drafter.corpus is None:
                raise ConfigError("the drafter declares a corpus table but has none; pass its counts")
            self.corpus_train = self.corpus_eval = CorpusSource(grams, table=self.drafter.corpus)
        copy = [p for p in (drafter.copy_scale, drafter.copy_bias) if p is not None and p.requires_grad]
        params = [p for p in self.drafter.parameters() if p.requires_grad and all(p is not c for c in copy)]
        # copy_scale and copy_bias start at 0 and must grow to several units: their own (by default
        # COPY_LR_SCALE x larger) learning rate on the same schedule, no weight decay
        groups: list[dict[str, Any]] = [{"params": params, "lr_scale": 1.0}]
        if copy:
            scale = config.copy_lr / config.lr if config.copy_lr is not None else COPY_LR_SCALE
            groups.append({"params": copy, "lr_scale": scale, "weight_decay": 0.0})
        # fused AdamW (one kernel per step) where this torch build has it for the device
        try:
            self.opt = torch.optim.AdamW(
                groups, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay, fused=True
            )
        except (RuntimeError, TypeError, ValueError):
            self.opt = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
        self._last_acc: list[float] = []
        self.state = TrainState()
        self.rng = random.Random(config.seed)
        self._val_batches: dict[str, list[dict[str, torch.Tensor]]] = {}
        self.extra_evals: dict[str, ShardDataset] = {}  # more held-out sets, validated with ``val``
        self.on_eval: Callable[[dict[str, Any]], None] | None = None
        self._soft = config.distill == "soft"
        self._walk = config.anchor_sampling == "walk"
        if self._soft and not train.has_topk:
            raise ConfigError(
                "--distill soft needs a dataset with the target's top-k log-probabilities (built with --topk K); "
                "this dataset has hard labels only: build a new one (--data DIR) or use --distill hard"
            )

    # -- schedule ---------------------------------------------------------------------------
    def progress(self) -> float:
        """Fraction of the current schedule segment done (steps or wall clock, whichever is ahead)."""
        s = self.state
        fracs = []
        if self.cfg.steps:
            fracs.append((s.step - s.segment_start_step) / self.cfg.steps)
        if self.cfg.time_budget:
            fracs.append((s.elapsed - s.segment_start_elapsed) / self.cfg.time_budget)
        return min(max(fracs), 1.0)

    def lr_at(self, progress: float) -> float:
        """Linear warm-up then cosine decay to ``min_lr_ratio`` of the peak."""
        c = self.cfg
        if progress < c.warmup:
            return c.lr * max(progress / c.warmup, 0.02)
        t = (progress - c.warmup) / max(1.0 - c.warmup, 1e-9)
        return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))

    # -- one step ---------------------------------------------------------------------------
    def _forward(self, batch: dict[str, torch.Tensor], metrics: bool = True) -> tuple[torch.Tensor, dict[str, Any]]:
        dev = self.device
        feats = batch["features"].to(dev, self.head.dtype)
        block_ids = batch["block_ids"].to(dev)
        labels = batch["labels"].to(dev)
        n, a, _ = labels.shape
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.cfg.bf16):
            ctx = self.drafter.fuse_context(feats)
            emb = F.embedding(block_ids, self.embed)
            if "copy_ids" in batch:
                copies = F.embedding(batch["copy_ids"].to(dev), self.embed)
                emb = emb + self.drafter.copy_inputs(copies, batch["copy_n"].to(dev))
            h = self.drafter(emb, ctx, batch["positions"].to(dev), mask=batch["mask"].to(dev))
            h = h.view(n, a, self.block, -1)[:, :, 1:]  # slots 1..b-1
        rows = h.reshape(-1, h.shape[-1])
        target = self.vocab.map(labels.cpu()).to(dev).view(-1)
        pointer: dict[str, torch.Tensor] = {}
        extra_ids: torch.Tensor | None = None
        if "copy_ids" in batch and self.drafter.copy_bias is not None:
            # the pointer's extra column makes some labels outside the draft vocabulary trainable
            pointer, extra_ids, target = self._pointer(batch, rows, target, labels)
        w = self.weights.repeat(n * a)
        if self._walk and self.drafter.training:  # on-policy: only the anchors the decoder would visit
            w = w * self._visited(rows, labels, pointer, extra_ids).repeat_interleave(self.block - 1).float()
        valid = (target >= 0).float()
        hard_coef = w * valid / (w * valid).sum().clamp(min=1e-6)
        ids, coef = target.clamp(min=0)[:, None], hard_coef[:, None]
        soft_parts = self._soft_targets(batch, w) if "soft_ids" in batch else None
        use_soft = self.cfg.distill == "soft" and soft_parts is not None
        if soft_parts is not None:
            s_idx, s_coef, _ = soft_parts
            mix = self.cfg.soft_weight if use_soft else 0.0  # 0: soft metrics only
            ids = torch.cat([ids, s_idx], 1)
            coef = torch.cat([coef * (1.0 - mix), s_coef * mix], 1)
        out_h = fused_head_loss(
            rows,
            self.head,
            ids,
            coef,
            metrics=metrics,
            bonus=pointer.get("bonus"),
            bonus_col=pointer.get("bonus_col"),
            extra=pointer.get("extra"),
        )
        loss = out_h.loss  # with --distill hard the soft entries weigh 0: they only feed the metrics
        if not metrics:
            return loss, {}
        with torch.no_grad():
            hard_rows = out_h.lse - out_h.picked[:, 0]
            out: dict[str, Any] = {"hard": float((hard_rows * hard_coef).sum())}
            if soft_parts is not None:
                _, s_coef, entropy = soft_parts
                soft = float((s_coef.sum(-1) * out_h.lse).sum() - (s_coef * out_h.picked[:, 1:]).sum())
                out["soft"], out["kl"] = soft, soft - float(entropy)
            assert out_h.pred is not None and out_h.rank is not None
            full_pred = self.drafter_ids(out_h.pred, extra_ids).view(n, a, self.block - 1)
            correct = (full_pred == labels) & (labels >= 0)
            present = labels >= 0
            # rank of the target's token among the draft logits (a huge rank when outside the draft vocab)
            rank = torch.where(target >= 0, out_h.rank, torch.full_like(out_h.rank, 1 << 30)).view(n, a, self.block - 1)
            oov = (target.view(n, a, self.block - 1) < 0) & present
        out.update({"correct": correct.cpu(), "present": present.cpu(), "rank": rank.cpu(), "oov": oov.cpu()})
        return loss, out

    def _soft_targets(
        self, batch: dict[str, torch.Tensor], w: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The stored top-k target distribution as sparse loss entries: head indices [R, k], weights
        [R, k] (the renormalised probability times the row's slot weight, normalised over the rows
        that have one) and the weighted mean entropy of those distributions (soft CE minus it is
        the KL divergence: 0 when matched).

        The target's probabilities are renormalised over the top-k ids inside the draft vocabulary;
        slots with none of them inside are skipped. None when no row has any.
        """
        ids = batch["soft_ids"]  # [n, A, b-1, k]
        k = ids.shape[-1]
        idx = self.vocab.map(ids.clamp(min=0)).view(-1, k)
        ok = (ids.view(-1, k) >= 0) & (idx >= 0)
        p = batch["soft_logp"].view(-1, k).exp() * ok
        mass = p.sum(-1)
        has = mass > 0
        if not bool(has.any()):
            return None
        q = (p / mass.clamp(min=1e-12)[:, None]).to(self.device)
        wh = w * has.to(self.device).float()
        row = wh / wh.sum().clamp(min=1e-6)
        entropy = (-(q * q.clamp(min=1e-12).log()).sum(-1) * row).sum()
        return idx.clamp(min=0).to(self.device), q * row[:, None], entropy

    def _visited(
        self, rows: torch.Tensor, labels: torch.Tensor, pointer: dict[str, torch.Tensor], extra_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """[n * a] the anchors of a window batch that the walk visits, from the drafts as they are now."""
        n, a, k = labels.shape
        pred = head_argmax(
            rows, self.head, bonus=pointer.get("bonus"), bonus_col=pointer.get("bonus_col"), extra=pointer.get("extra")
        )
        correct = (self.drafter_ids(pred, extra_ids).view(n, a, k) == labels) & (labels >= 0)
        runs = torch.cumprod(correct.long(), dim=-1).sum(-1)
        return self.walk_rows(runs.cpu(), (labels >= 0).any(-1).cpu()).reshape(-1).to(rows.device)

    def drafter_ids(self, idx: torch.Tensor, extra_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Draft-head indices [R] -> full-vocab ids (index N: the row's ``extra_ids``, the copy
        proposal outside the draft vocabulary)."""
        return draft_columns_to_ids(idx, self.drafter.draft_vocab_ids, extra_ids)

    def _pointer(
        self, batch: dict[str, torch.Tensor], rows: torch.Tensor, target: torch.Tensor, labels: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor]:
        """The copy inputs' pointer as ``fused_head_loss`` arguments (``DFlashDraftModel.copy_bias``):
        each slot's proposal gets the bias of its n-gram size at its column, or, outside the draft
        vocabulary, one more column scored from the full head. Returns those arguments, the full id
        of that column per row (None with the full vocabulary) and the head-index targets, where a
        label outside the draft vocabulary that the proposal names is now column N."""
        assert self.drafter.copy_bias is not None and self.full_head is not None
        dev, n_slots = self.device, self.block
        cid = batch["copy_ids"].view(-1, n_slots)[:, 1:].reshape(-1).to(dev)  # [R] slots 1..b-1
        cn = batch["copy_n"].view(-1, n_slots)[:, 1:].reshape(-1).to(dev)
        bias = self.drafter.copy_logit_bias(cn)  # [R] float32, 0 without a match
        col = self.vocab.map(cid.cpu()).to(dev)
        has = cn > 0
        if self.drafter.draft_vocab_ids is None:
            return {"bonus": bias, "bonus_col": cid}, None, target
        inside, outside = has & (col >= 0), has & (col < 0)
        args = {"bonus": torch.where(inside, bias, torch.zeros_like(bias)), "bonus_col": col.clamp(min=0)}
        weights = self.full_head[cid.to(self.full_head.device)].to(dev, torch.float32)  # [R, D]
        score = (rows.float() * weights).sum(-1) + bias
        args["extra"] = torch.where(outside, score, torch.full_like(score, float("-inf")))
        flat = labels.reshape(-1).to(dev)
        named = outside & (target < 0) & (flat == cid) & (flat >= 0)
        return args, cid, torch.where(named, torch.full_like(target, self.head.shape[0]), target)

    @staticmethod
    def coverage_metrics(
        rank: torch.Tensor, present: torch.Tensor, oov: torch.Tensor, slots: int = 3, tops: Sequence[int] = (1, 2, 4, 8)
    ) -> dict[str, Any]:
        """Top-n coverage per slot and the out-of-vocabulary share.

        Args:
            rank: [.., b-1] rank of the target's token among the drafter's logits (0 = top-1).
            present: [.., b-1] slots that have a label.
            oov: [.., b-1] labels outside the draft vocabulary.
            slots: report slots 1..slots.
            tops: the n of top-n.

        Returns:
            ``topk_coverage``: {"top1": [slot 1, slot 2, ...], ...}; ``oov_share``: share of
            labelled slots whose token the drafter cannot propose at all.
        """
        r, pr = rank.reshape(-1, rank.shape[-1]), present.reshape(-1, present.shape[-1])
        cov = {}
        for n in tops:
            hit = (r < n) & pr
            cov[f"top{n}"] = [
                round(float(hit[:, k].sum()) / max(int(pr[:, k].sum()), 1), 4) for k in range(min(slots, r.shape[1]))
            ]
        share = float(oov.sum()) / max(int(present.sum()), 1)
        return {"topk_coverage": cov, "oov_share": round(share, 4)}

    @staticmethod
    def block_metrics(correct: torch.Tensor, present: torch.Tensor) -> dict[str, Any]:
        """Slot accuracies and teacher-forced tau (1 + mean leading run of correct slots)."""
        full = present.all(-1)
        run = torch.cumprod(correct.long(), dim=-1).sum(-1)
        slot_acc = (correct.sum((0, 1)).float() / present.sum((0, 1)).clamp(min=1).float()).tolist()
        tau = 1.0 + run[full].float().mean().item() if full.any() else float("nan")
        run3 = torch.cumprod(correct[..., :3].long(), dim=-1).sum(-1)
        tau3 = 1.0 + run3[full].float().mean().item() if full.any() else float("nan")
        return {"slot_acc": [round(x, 4) for x in slot_acc], "tau_tf": round(tau, 4), "tau_tf_k3": round(tau3, 4)}

    @staticmethod
    def walk(runs: Sequence[int], first: int, end: int) -> list[int]:
        """The leading runs of the steps a chain decoder verifying the whole block takes over one
        answer: from the first anchor, each step commits its run of correct drafts plus the target's
        own token, so the next anchor is ``a + run + 1``.

        Args:
            runs: leading run of correct slots at every anchor ``first, first + 1, ...``.
            first: the first anchor (the answer's first token, produced by the prefill).
            end: the sequence length - 1: the decoder has committed the answer when it reaches it.
        """
        out, a = [], first
        while a < end:
            r = min(int(runs[a - first]), end - a - 1)  # the last step commits what is left, no more
            out.append(r)
            a += r + 1
        return out

    def _all_anchor_runs(
        self, seq: tuple[torch.Tensor, torch.Tensor, int], labels: torch.Tensor | None, corpus: CorpusSource | None
    ) -> list[int] | None:
        """Leading run of correct drafts at every anchor of one sequence (no gradients)."""
        b = build_batch(
            [seq], 1 << 30, self.block, self.mask_id, random.Random(0), None, [labels], self.copy_ngram, corpus
        )
        if b is None:
            return None
        with torch.no_grad():
            _, m = self._forward(b)
        return [int(x) for x in torch.cumprod(m["correct"][0].long(), dim=-1).sum(-1).tolist()]

    def _window(self, seq: tuple[torch.Tensor, torch.Tensor, int]) -> list[int]:
        """``anchors`` consecutive anchors at a random place in the answer (all of a shorter one)."""
        lo, end = max(seq[2], 1), seq[0].numel() - 1
        n = min(self.cfg.anchors, max(end - lo, 0))
        start = self.rng.randint(lo, end - n) if end - n > lo else lo
        return list(range(start, start + n))

    @staticmethod
    def walk_rows(runs: torch.Tensor, anchored: torch.Tensor) -> torch.Tensor:
        """[n, a] True at the anchors a chain decoder visits when it enters each sequence's window
        of consecutive anchors at the first one: anchor j -> j + run + 1.

        Args:
            runs: [n, a] leading run of correct drafts at each anchor.
            anchored: [n, a] the anchors that exist (a sequence's window may be shorter).
        """
        keep = torch.zeros_like(anchored)
        for i in range(runs.shape[0]):
            count, j = int(anchored[i].sum()), 0
            for r in Trainer.walk(runs[i, :count].tolist(), 0, count):
                keep[i, j] = True
                j += r + 1
        return keep

    @torch.no_grad()
    def walk_metrics(self, data: ShardDataset, max_seqs: int = 16) -> dict[str, Any]:
        """What the real decoder would see on held-out answers: the drafts at *every* anchor, walked
        as a chain decoder walks them (``walk``). ``tau_tf`` averages the leading run over anchors
        drawn uniformly, but the decoder only anchors where its previous step stopped, right after a
        miss, where drafting is harder: on the embedded pair's OOD answers ``tau_tf`` read 2.56 where
        the decoder (chain of 7, float32, lookup off) measured 2.06, and ``tau_walk`` 2.06.

        Returns:
            ``tau_walk`` (committed tokens per step, pooled) and ``walk_top1`` (slot-1 top-1 at the
            anchors the walk visits); empty without held-out sequences.
        """
        steps: list[int] = []
        was_training = self.drafter.training
        self.drafter.eval()
        for i in range(min(max_seqs, len(data))):
            seq = data.get(i, self.cfg.max_len)
            runs = self._all_anchor_runs(seq, data.get_labels(i, self.cfg.max_len), self.corpus_eval)
            if runs is not None:
                steps += self.walk(runs, max(seq[2], 1), seq[0].numel() - 1)
        if was_training:
            self.drafter.train()
        if not steps:
            return {}
        return {
            "tau_walk": round(1.0 + sum(steps) / len(steps), 4),
            "walk_top1": round(sum(r > 0 for r in steps) / len(steps), 4),
        }

    def step(self) -> dict[str, Any]:
        """One optimiser step on a fresh random batch."""
        t0 = time.perf_counter()
        batch = None
        while batch is None:
            picks = [self.rng.randrange(len(self.train_data)) for _ in range(self.cfg.seqs_per_step)]
            seqs = [self.train_data.get(i, self.cfg.max_len) for i in picks]
            soft = [self.train_data.get_topk(i, self.cfg.max_len) for i in picks] if self._soft else None
            targets = [self.train_data.get_labels(i, self.cfg.max_len) for i in picks]
            walks = [self._window(s) for s in seqs] if self._walk else None
            batch = build_batch(
                seqs,
                self.cfg.anchors,
                self.block,
                self.mask_id,
                self.rng,
                soft,
                targets,
                self.copy_ngram,
                self.corpus_train,
                walks,
            )
        lr = self.lr_at(self.progress())
        for g in self.opt.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        loss, m = self._forward(batch, metrics=self.state.step % 10 == 0)  # argmax metrics every 10th step
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
        self.opt.step()
        dt = time.perf_counter() - t0
        self.state.step += 1
        self.state.elapsed += dt
        self.state.tokens_seen += int(batch["features"].shape[0] * batch["features"].shape[1])
        slots = int((batch["labels"] >= 0).sum())
        if m:
            acc = m["correct"].sum((0, 1)).float() / m["present"].sum((0, 1)).clamp(min=1).float()
            self._last_acc = [round(x, 3) for x in acc[:4].tolist()]
        extra = {"soft_loss": m["soft"]} if m and "soft" in m else {}
        return {
            **extra,
            "step": self.state.step,
            "loss": float(loss.detach()),
            "lr": lr,
            "grad_norm": float(gnorm),
            "slot_acc": self._last_acc,
            "slots_per_s": slots / dt,
            "step_s": dt,
            "progress": self.progress(),
        }

    @torch.no_grad()
    def validate(self, max_seqs: int = 16, dataset: ShardDataset | None = None, name: str = "val") -> dict[str, Any]:
        """Teacher-forced metrics on fixed held-out blocks: ``val_loss`` (slot-weighted hard CE,
        comparable across --distill modes), ``val_soft`` / ``val_kl`` (soft CE and KL to the target's
        top-k distribution, when the data has it),
        slot accuracies, tau_tf, top-1/2/4/8 coverage at slots 1..3 and the OOV share.

        Args:
            max_seqs: held-out sequences used (the first ones, fixed anchors).
            dataset: the held-out set (default: the validation shard).
            name: cache key of its fixed batches.
        """
        data = self.val_data if dataset is None else dataset
        if data is None or len(data) == 0:
            return {}
        if name not in self._val_batches:
            rng = random.Random(1234)
            idx = list(range(min(max_seqs, len(data))))
            batches = []
            for i in range(0, len(idx), 2):
                pick = idx[i : i + 2]
                seqs = [data.get(j, self.cfg.max_len) for j in pick]
                soft = [data.get_topk(j, self.cfg.max_len) for j in pick] if data.has_topk else None
                targets = [data.get_labels(j, self.cfg.max_len) for j in pick]
                b = build_batch(
                    seqs,
                    self.cfg.anchors,
                    self.block,
                    self.mask_id,
                    rng,
                    soft,
                    targets,
                    self.copy_ngram,
                    self.corpus_eval,
                )
                if b is not None:
                    batches.append(b)
            self._val_batches[name] = batches
        self.drafter.eval()
        hards, softs, kls, corrects, presents, ranks, oovs = [], [], [], [], [], [], []
        for b in self._val_batches[name]:
            _, m = self._forward(b)
            hards.append(m["hard"])
            if "soft" in m:
                softs.append(m["soft"])
                kls.append(m["kl"])
            corrects.append(m["correct"].flatten(0, 1))
            presents.append(m["present"].flatten(0, 1))
            ranks.append(m["rank"].flatten(0, 1))
            oovs.append(m["oov"].flatten(0, 1))
        self.drafter.train()
        if not corrects:
            return {}
        present = torch.cat(presents)
        out = self.block_metrics(torch.cat(corrects)[None], present[None])
        out["val_loss"] = round(sum(hards) / len(hards), 4)
        if softs:
            out["val_soft"] = round(sum(softs) / len(softs), 4)
            out["val_kl"] = round(sum(kls) / len(kls), 4)
        out.update(self.coverage_metrics(torch.cat(ranks), present, torch.cat(oovs)))
        out.update(self.walk_metrics(data, max_seqs=min(max_seqs, self.cfg.walk_seqs)))
        return out

    def _record(self, val: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Append a validation to the history and report it, with the extra held-out sets, to
        ``on_eval`` (the run folder's eval.jsonl). Returns the extra sets' metrics."""
        entry = {"step": self.state.step, "elapsed": round(self.state.elapsed, 1)}
        self.state.history.append({**entry, **val})
        evals = self.evaluate_extra() if self.extra_evals else {}
        if self.on_eval is not None:
            self.on_eval({**entry, "in_distribution": val, **evals})
        return evals

    def evaluate_extra(self) -> dict[str, dict[str, Any]]:
        """``validate`` on every set of ``extra_evals`` (e.g. the OOD prompts' target answers)."""
        return {name: self.validate(max_seqs=64, dataset=ds, name=name) for name, ds in self.extra_evals.items()}

    # -- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self, extra_config: dict[str, Any] | None = None) -> Path:
        """Write ``checkpoint/`` (drafter in the published layout + trainer state) atomically."""
        ckpt = self.out_dir / "checkpoint"
        tmp = self.out_dir / "checkpoint.tmp"
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp)
        save_draft_model(self.drafter, tmp, extra_config)
        save_trainer_state(tmp, self.opt.state_dict(), asdict(self.state), asdict(self.cfg), self.rng.getstate())
        if ckpt.exists():
            import shutil

            shutil.rmtree(ckpt)
        tmp.replace(ckpt)
        return ckpt

    def load_checkpoint(self, ckpt: Path, new_segment: bool = False) -> None:
        """Restore weights, optimiser moments, counters and RNG from ``ckpt``.

        Args:
            ckpt: a ``checkpoint/`` folder.
            new_segment: start a fresh schedule segment (warm-up + cosine) from these weights,
                to continue a finished run with more steps or time.
        """
        loaded = load_draft_model(ckpt, self.device, torch.float32)
        self.drafter.load_state_dict(loaded.state_dict(), strict=False)
        blob = load_trainer_state(ckpt)  # never unpickles: safetensors + JSON
        self.opt.load_state_dict(blob["optimizer"])
        self.state = TrainState(**blob["state"])
        self.rng.setstate(blob["rng"])
        if new_segment:
            self.state.segment_start_step = self.state.step
            self.state.segment_start_elapsed = self.state.elapsed
            self.state.segments += 1

    # -- the loop ---------------------------------------------------------------------------
    def run(
        self, progress: Progress | None = None, extra_config: Callable[[], dict[str, Any]] | None = None
    ) -> TrainState:
        """Train until the schedule segment is done; checkpoint on the way and at the end.

        A KeyboardInterrupt saves a checkpoint and re-raises, so ``--resume`` continues.
        """
        last_ckpt = time.perf_counter()
        if self.state.step == 0 and not self.state.history:
            self._record(self.validate())
        try:
            while self.progress() < 1.0:
                info = self.step()
                if self.state.step % self.cfg.eval_every == 0:
                    info["val"] = self.validate()
                    info["evals"] = self._record(info["val"])
                if progress:
                    progress(info)
                if time.perf_counter() - last_ckpt > self.cfg.checkpoint_every:
                    self.save_checkpoint(extra_config() if extra_config else None)
                    last_ckpt = time.perf_counter()
        except KeyboardInterrupt:
            self.save_checkpoint(extra_config() if extra_config else None)
            raise
        if not self.state.history or self.state.history[-1]["step"] != self.state.step:
            self._record(self.validate())
        self.save_checkpoint(extra_config() if extra_config else None)
        return self.state


def iter_shards(data_dir: Path) -> Iterator[Shard]:
    """Load every shard of a dataset folder, in order."""
    for p in sorted(Path(data_dir).glob("shard-*.safetensors")):
        yield load_shard(p)


def dataset_meta(data_dir: Path) -> dict[str, Any]:
    """The ``dataset.json`` of a dataset folder."""
    path = Path(data_dir) / "dataset.json"
    if not path.exists():
        raise ConfigError(
            f"{data_dir} is not a dflash training dataset (no dataset.json); build one with `dflash train --out DIR --data-only`"
        )
    return dict(json.loads(path.read_text()))
