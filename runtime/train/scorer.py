"""A drafter scored against the frozen target embedding and head: the loss and metrics of one
training batch (hard labels, the stored top-k distribution, the copy inputs' pointer), and the
walk a chain decoder takes over held-out answers (``tau_walk``)."""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.nn.functional as F

from runtime.engine.draft_head import copy_pointer
from runtime.engine.models.corpus import CorpusCounts
from runtime.engine.models.drafter import DFlashDraftModel, draft_columns_to_ids
from runtime.errors import ConfigError
from runtime.train import metrics
from runtime.train.batching import CorpusSource, build_batch
from runtime.train.config import TrainConfig, slot_weights
from runtime.train.losses import fused_head_loss, head_argmax
from runtime.train.shards import ShardDataset
from runtime.train.vocab import DraftVocab


class DraftScorer:
    """A drafter's loss and metrics on training batches, against frozen target weights.

    Args:
        drafter: the drafter (float32 master weights).
        embed_weight: [V, D] target embedding (frozen).
        head_weight: [V, D] target lm_head (frozen).
        config: hyper-parameters (precision, distillation, slot weights, anchor sampling).
        device: where to compute.
        corpus: for a drafter with a corpus table (``dflash.copy_corpus``), the counts over the
            training answers (``count_corpus``): training leaves each sequence's own n-grams out,
            and the drafter's table becomes theirs. Without them the drafter's own table is used.
    """

    def __init__(
        self,
        drafter: DFlashDraftModel,
        embed_weight: torch.Tensor,
        head_weight: torch.Tensor,
        config: TrainConfig,
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
        # full id -> column of the reduced head (negative outside), for the copy pointer
        self._columns = self.vocab.lookup.to(self.device) if self.vocab.ids is not None else None
        # the copy inputs' pointer scores a proposal outside the draft vocabulary from the full head
        self.full_head = head_weight if drafter.dflash.copy_ngram is not None else None
        if not config.bf16:  # float32 end to end (tests, exactness checks)
            self.head, self.embed = self.head.float(), self.embed.float()
        self.cfg = config
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
        self._walk = config.anchor_sampling == "walk"

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
        return metrics.walk_rows(runs.cpu(), (labels >= 0).any(-1).cpu()).reshape(-1).to(rows.device)

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
        # the decoder's pointer (runtime.engine.draft_head), in float32 products
        p = copy_pointer(rows, cid, bias, cn > 0, self._columns, self.full_head, dtype=torch.float32)
        if p.extra is None or p.outside is None:  # the full vocabulary
            return {"bonus": p.bias, "bonus_col": p.col}, None, target
        flat = labels.reshape(-1).to(dev)
        named = p.outside & (target < 0) & (flat == cid) & (flat >= 0)
        args = {"bonus": p.bias, "bonus_col": p.col, "extra": p.extra}
        return args, cid, torch.where(named, torch.full_like(target, self.head.shape[0]), target)

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

    @torch.no_grad()
    def walk_metrics(self, data: ShardDataset, max_seqs: int = 16) -> dict[str, Any]:
        """What the real decoder would see on held-out answers: the drafts at *every* anchor, walked
        as a chain decoder walks them (``metrics.walk``). ``tau_tf`` averages the leading run over anchors
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
                steps += metrics.walk(runs, max(seq[2], 1), seq[0].numel() - 1)
        if was_training:
            self.drafter.train()
        if not steps:
            return {}
        return {
            "tau_walk": round(1.0 + sum(steps) / len(steps), 4),
            "walk_top1": round(sum(r > 0 for r in steps) / len(steps), 4),
        }
