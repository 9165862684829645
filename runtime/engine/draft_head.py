"""The draft head: the target's lm_head read by the drafter, optionally over the drafter's reduced
vocabulary, with the copy inputs' pointer column (``DFlashDraftModel.copy_logit_bias``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.engine.models.drafter import DFlashDraftModel, draft_columns_to_ids
from runtime.engine.models.linear import FusedLinear, Int8Head
from runtime.engine.models.target import TargetModel


class DraftHead:
    """The target's lm_head, optionally restricted to the drafter's reduced vocabulary."""

    def __init__(self, target: TargetModel, drafter: DFlashDraftModel) -> None:
        weight = target.lm_head.weight
        bias = getattr(target.lm_head, "bias", None)
        ids = drafter.draft_vocab_ids
        if ids is not None:
            ids = ids.to(weight.device)
            weight = weight[ids]
            bias = bias[ids] if bias is not None else None
        self.weight, self.bias, self.ids = weight, bias, ids
        self.full_weight, self.full_bias = target.lm_head.weight, getattr(target.lm_head, "bias", None)
        self._columns: torch.Tensor | None = None  # full id -> column of the reduced head (-1: outside)
        # a reduced head is a copy: pack it once for oneDNN where that runs (runtime.engine.models.linear)
        # (the full head is packed too where the target computes in another dtype than its weights)
        pack = (ids is not None or weight.dtype != target.dtype) and type(weight.data) is torch.Tensor
        pack = pack and FusedLinear.can_pack(weight.device, weight.dtype)
        self._packed = FusedLinear([_Plain(weight, bias)], pack=True) if pack else None
        if target.int8 and type(weight) is torch.Tensor:
            # beside an int8 target (its own head in int8), the draft head is read in int8 as well
            self._packed = FusedLinear([Int8Head(_Plain(weight, bias))], pack=False)

    @classmethod
    def for_pair(cls, target: TargetModel, drafter: DFlashDraftModel) -> DraftHead:
        """The head of this pair, built once and kept on the drafter (a reduced head is a gathered,
        packed copy of the target's: not something to redo per request)."""
        cached = drafter.__dict__.get("_dflash_head")
        if cached is not None and cached[0] is target.lm_head.weight:
            head: DraftHead = cached[1]
            return head
        head = cls(target, drafter)
        drafter.__dict__["_dflash_head"] = (target.lm_head.weight, head)
        return head

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits for hidden states [K, D] -> [K, V_d] over the draft vocabulary (column j is full
        id ``ids[j]``, or j without a reduced vocabulary)."""
        if self._packed is not None:
            return self._packed(hidden)[0]
        return F.linear(hidden, self.weight, self.bias)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy draft ids for hidden states [K, D] -> [K] (ids in the full vocabulary)."""
        best = torch.argmax(self.logits(hidden).float(), dim=-1)  # float: see sampling.sample
        return self.ids[best] if self.ids is not None else best

    def with_copies(
        self, logits: torch.Tensor, hidden: torch.Tensor, copy_ids: torch.Tensor, bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft logits with the copy inputs' pointer (``DFlashDraftModel.copy_logit_bias``).

        Args:
            logits: [K, V_d] float32 draft logits of ``hidden`` [K, D].
            copy_ids: [K] full id of each slot's proposed token (any id where there is none).
            bias: [K] what to add to its logit (0 where there is none).

        Returns:
            (logits with ``bias`` added at each proposal's column, [K] the full id of one more
            column or None): a proposal outside a reduced draft vocabulary is scored from the
            target's full head in column V_d (-inf in slots without such a proposal).
        """
        has = bias != 0
        if self.ids is None:
            return logits.index_put_((torch.arange(logits.shape[0], device=logits.device), copy_ids), bias, True), None
        if self._columns is None:
            cols = torch.full((self.full_weight.shape[0],), -1, dtype=torch.long, device=self.ids.device)
            cols[self.ids] = torch.arange(self.ids.numel(), device=self.ids.device)
            self._columns = cols
        col = self._columns[copy_ids]
        inside = has & (col >= 0)
        logits = logits.index_put_(
            (torch.arange(logits.shape[0], device=logits.device), col.clamp(min=0)), bias * inside, True
        )
        outside = has & (col < 0)
        # scored in every slot and kept where the proposal is outside (no host read to ask whether any is)
        rows = self.full_weight[copy_ids].to(hidden.dtype)  # [K, D]
        score = (hidden * rows).sum(-1).float() + bias
        if self.full_bias is not None:
            score = score + self.full_bias[copy_ids].float()
        extra = torch.where(outside, score, torch.full_like(score, float("-inf")))[:, None].to(logits.dtype)
        return torch.cat([logits, extra], 1), copy_ids

    def to_ids(self, columns: torch.Tensor, extra_ids: torch.Tensor | None) -> torch.Tensor:
        """Columns [K, ...] of ``logits`` (or ``with_copies``' logits) -> full ids."""
        return draft_columns_to_ids(columns, self.ids, extra_ids)


class _Plain:
    """A weight/bias pair shaped like an ``nn.Linear`` for ``FusedLinear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
