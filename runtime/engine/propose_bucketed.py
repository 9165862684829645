"""The DFlash drafter as a proposer on the capturable step (``BucketedTarget`` targets, the CUDA path).

Same proposals as ``DrafterProposer`` (same drafter, copy inputs, head); the drafter runs as
``BucketedDrafter``'s two fixed-shape forwards (context append, block), over a cache lent from the
drafter's pool (allocated once per loaded drafter, reused by the next request), with the block's
ids in a buffer of the drafter's step rather than per request.
"""

from __future__ import annotations

import torch

from runtime.engine.models.bucketed_drafter import BucketedDrafter, PooledDraftCache
from runtime.engine.models.drafter import DFlashDraftModel
from runtime.engine.models.target import TargetModel
from runtime.engine.propose import DrafterProposer
from runtime.engine.step import RequestContext


class BucketedProposer(DrafterProposer):
    """``DrafterProposer`` on the drafter's bucketed step (``runtime.engine.step.Proposer``).

    Args:
        target: the wrapped target (a ``BucketedTarget``).
        drafter: the drafter.
        block_size: the drafter's block length.
        step: the drafter's bucketed step (default: the drafter's own, ``BucketedDrafter.of``).
    """

    def __init__(
        self, target: TargetModel, drafter: DFlashDraftModel, block_size: int, step: BucketedDrafter | None = None
    ) -> None:
        super().__init__(target, drafter, block_size)
        self.step = step or BucketedDrafter.of(drafter)

    def begin(self, ctx: RequestContext, room: int, feats: torch.Tensor | None) -> None:
        """A pooled drafter cache for ``room`` positions (or the one the prompt cache gave ``ctx``),
        the prefilled features pending after what it held."""
        if not isinstance(ctx.d_cache, PooledDraftCache):
            ctx.d_cache = self.step.new_cache(room + self.block_size)
            ctx.pending = None
        if ctx.pending is not None and feats is not None:
            feats = torch.cat([ctx.pending, feats], dim=1)
        ctx.pending = feats

    def hidden(self, ctx: RequestContext) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The drafter's final hidden states [b, D] for [anchor, M, ..., M] (``DrafterProposer.hidden``)."""
        d_cache, pending = ctx.d_cache, ctx.pending
        assert isinstance(d_cache, PooledDraftCache) and pending is not None, "begin() sets up the drafter's state"
        if pending.shape[1]:
            self.step.append(d_cache, pending)
        block_ids = self.step.block_ids(self.block_size, self.mask_id)
        if ctx.anchor_on_device is not None:
            block_ids[0, :1] = ctx.anchor_on_device
        else:
            block_ids[0, 0] = ctx.anchor
        embeds, shown = self.block_embeds(ctx, block_ids)
        return self.step.block(d_cache, embeds), shown
