"""The DFlash drafter as a step's proposer: one forward over [anchor, M, ..., M] scores every slot
of the block, conditioned on the target's features of the committed context (``docs/method.md``).

The drafter's copy inputs (``dflash_config.copy_ngram``) show each slot what followed the
context's latest earlier occurrence of its last tokens (or the drafter's corpus table's chain), and
its pointer raises that token's logit (``DraftHead.with_copies``); both read the request's one
n-gram index (``RequestContext.index``).
"""

from __future__ import annotations

from typing import cast

import torch

from runtime.engine.draft_head import DraftHead
from runtime.engine.models.drafter import DFlashDraftModel, DraftLayer
from runtime.engine.models.kv_cache import DraftKVCache
from runtime.engine.models.target import TargetModel
from runtime.engine.ngram import block_copies
from runtime.engine.step import RequestContext, SlotCandidates
from runtime.engine.transfer import upload
from runtime.engine.tree import slot_candidates


class DrafterProposer:
    """Proposals of a DFlash drafter for a target (``runtime.engine.step.Proposer``).

    Args:
        target: the wrapped target (its embeddings and head are shared with the drafter).
        drafter: the drafter.
        block_size: the drafter's block length (drafts per step <= block_size - 1).
    """

    def __init__(self, target: TargetModel, drafter: DFlashDraftModel, block_size: int) -> None:
        self.target, self.drafter, self.block_size = target, drafter, block_size
        self.taps = tuple(int(i) for i in drafter.dflash.target_layer_ids)  # the target layers it reads
        self.head = DraftHead.for_pair(target, drafter)
        self.mask_id = drafter.dflash.mask_token_id
        self.ngram = drafter.dflash.copy_ngram  # the copy inputs' n-gram sizes, or None
        self._sliding = any(cast(DraftLayer, layer).self_attn.sliding_window for layer in drafter.layers)

    @property
    def state_key(self) -> int:
        """Which drafter's state a request's drafter cache is (the prompt cache matches on it)."""
        return id(self.drafter)

    def begin(self, ctx: RequestContext, room: int, feats: torch.Tensor | None) -> None:
        """A drafter cache for ``room`` positions (or the one the prompt cache gave ``ctx``), the
        prefilled features pending after what it held, reused buffers."""
        device = self.target.device
        if ctx.d_cache is None:
            ctx.d_cache = DraftKVCache(len(self.drafter.layers), capacity=room)
            ctx.pending = None
        if ctx.pending is not None and feats is not None:
            feats = torch.cat([ctx.pending, feats], dim=1)
        ctx.pending = feats
        ctx.scratch["block"] = torch.full((1, self.block_size), self.mask_id, dtype=torch.long, device=device)
        ctx.scratch["positions"] = torch.arange(room + self.block_size, device=device)

    def chain(self, ctx: RequestContext, depth: int) -> torch.Tensor:
        """[depth] argmax drafts on the device."""
        logits, extra_ids = self.logits(ctx, depth)
        return self.head.to_ids(torch.argmax(logits, dim=-1), extra_ids)

    def candidates(self, ctx: RequestContext, depth: int, width: int) -> SlotCandidates:
        """Each slot's ``width`` best candidates on the host (the step's first host read)."""
        logprobs, vocab_ids, extra_ids = self.logprobs(ctx, depth)
        vals, toks = slot_candidates(logprobs, width, vocab_ids, extra_ids)
        return SlotCandidates(vals, toks)

    def logprobs(
        self, ctx: RequestContext, depth: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """([depth, V] float log-probabilities of slots 1..depth, [V_d] full ids of the columns or
        None, [depth] full id of each slot's extra column or None: ``DraftHead.with_copies``)."""
        logits, extra_ids = self.logits(ctx, depth)
        return torch.log_softmax(logits, dim=-1), self.head.ids, extra_ids

    def logits(self, ctx: RequestContext, depth: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Float32 draft logits of slots 1..depth from one drafter forward, with the copy inputs'
        pointer where the drafter has one ([depth] full id of the extra column, or None)."""
        hidden, copies = self.hidden(ctx)
        hidden = hidden[1 : 1 + depth]
        logits = self.head.logits(hidden).float()  # float: see sampling.sample
        if copies is None:
            return logits, None
        ids, matched = copies[0][1 : 1 + depth], copies[1][1 : 1 + depth]
        return self.head.with_copies(logits, hidden, ids, self.drafter.copy_logit_bias(matched))

    def hidden(self, ctx: RequestContext) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The drafter's final hidden states for the block [anchor, M, ..., M] at the anchor's position.

        Returns:
            ([b, D]: row k (k >= 1) scores the token at position start + k (``DraftHead``); the copy
            inputs shown to the block, ([b] proposed ids, [b] matched n-gram sizes) on the device,
            or None when the drafter has none or nothing matched).
        """
        d_cache, pending = ctx.d_cache, ctx.pending
        assert d_cache is not None and pending is not None, "begin() sets up the drafter's state"
        b, start = self.block_size, ctx.start
        block_ids = ctx.scratch["block"]  # [1, b]: [anchor, M, ..., M]
        if ctx.anchor_on_device is not None:
            block_ids[0, :1] = ctx.anchor_on_device
        else:
            block_ids[0, 0] = ctx.anchor
        ctx_feats = self.drafter.fuse_context(pending)  # [1, C, D]
        all_positions = ctx.scratch["positions"]
        positions = all_positions[d_cache.seq_len : start + b].unsqueeze(0)  # [1, C + b]
        key_pos = all_positions[: start + b] if self._sliding else None
        embeds, shown = self.block_embeds(ctx, block_ids)
        hidden = self.drafter(embeds, ctx_feats, positions, cache=d_cache, key_positions=key_pos)
        d_cache.crop(start)  # keep context entries only; the block never stays cached
        return hidden[0], shown

    def block_embeds(
        self, ctx: RequestContext, block_ids: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The block's embeddings [1, b, D] with what the copy inputs add, and what they showed
        (([b] proposed ids, [b] matched n-gram sizes) on the device, or None)."""
        b = int(block_ids.shape[1])
        embeds = self.target.embed(block_ids)
        shown: tuple[torch.Tensor, torch.Tensor] | None = None
        index = ctx.indexed()
        if self.ngram is not None and index is not None:
            corpus = self.drafter.corpus
            if corpus is not None:
                ids, matched = block_copies(index, b, self.mask_id, corpus.query, corpus.ngram, ngram=self.ngram)
            else:
                ids, matched = block_copies(index, b, self.mask_id, ngram=self.ngram)
            if any(matched):
                dev = embeds.device
                shown = (upload(ids, torch.long, dev), upload(matched, torch.long, dev))
                copies = self.target.embed(shown[0][None])
                embeds = embeds + self.drafter.copy_inputs(copies, shown[1][None])
        return embeds, shown
