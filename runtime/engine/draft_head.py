"""The draft head: the target's lm_head read by the drafter, optionally over the drafter's reduced
vocabulary, with the copy inputs' pointer column (``DFlashDraftModel.copy_logit_bias``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.engine.models.drafter import DFlashDraftModel, draft_columns_to_ids
from runtime.engine.models.linear import FusedLinear, Int8Head, _plain
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
        if target.int8 and weight.dtype.is_floating_point and _plain(weight):
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
        """Draft logits with the copy inputs' pointer (``DFlashDraftModel.copy_logit_bias``;
        ``copy_pointer`` and ``pointer_logits``, which training shares).

        Args:
            logits: [K, V_d] float32 draft logits of ``hidden`` [K, D].
            copy_ids: [K] full id of each slot's proposed token (any id where there is none).
            bias: [K] what to add to its logit (0 where there is none).

        Returns:
            (logits with ``bias`` added at each proposal's column, [K] the full id of one more
            column or None): a proposal outside a reduced draft vocabulary is scored from the
            target's full head in column V_d (-inf in slots without such a proposal).
        """
        if self.ids is not None and self._columns is None:
            self._columns = draft_columns(self.ids, self.full_weight.shape[0])
        pointer = copy_pointer(hidden, copy_ids, bias, bias != 0, self._columns, self.full_weight, self.full_bias)
        return pointer_logits(logits, pointer.col, pointer.bias, pointer.extra), pointer.extra_ids

    def to_ids(self, columns: torch.Tensor, extra_ids: torch.Tensor | None) -> torch.Tensor:
        """Columns [K, ...] of ``logits`` (or ``with_copies``' logits) -> full ids."""
        return draft_columns_to_ids(columns, self.ids, extra_ids)


class _Plain:
    """A weight/bias pair shaped like an ``nn.Linear`` for ``FusedLinear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias


def draft_columns(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab_size] full id -> column of a reduced head over ``ids`` (-1: outside it)."""
    cols = torch.full((vocab_size,), -1, dtype=torch.long, device=ids.device)
    cols[ids] = torch.arange(ids.numel(), device=ids.device)
    return cols


@dataclass(frozen=True)
class CopyPointer:
    """The copy inputs' pointer over a draft head's columns, row by row (``copy_pointer``).

    Attributes:
        col: [K] the column each row's ``bias`` goes to (0 where it adds nothing).
        bias: [K] float32 added to the logit there (0 without a proposal inside the head).
        extra: [K] float32 logit of one more column, the proposal outside a reduced head scored
            from the full head (-inf in rows without one); None over the full vocabulary.
        extra_ids: [K] full id of that column (the proposal), or None.
        outside: [K] the rows whose proposal is that column, or None.
    """

    col: torch.Tensor
    bias: torch.Tensor
    extra: torch.Tensor | None = None
    extra_ids: torch.Tensor | None = None
    outside: torch.Tensor | None = None


def copy_pointer(
    hidden: torch.Tensor,
    copy_ids: torch.Tensor,
    bias: torch.Tensor,
    has: torch.Tensor,
    columns: torch.Tensor | None,
    full_weight: torch.Tensor,
    full_bias: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> CopyPointer:
    """What the copy inputs' pointer adds to each row's draft logits, in decoding and training.

    Each proposal gets ``bias`` at its column; over a reduced head (``columns``), a proposal
    outside it is one more column instead, scored from the target's full head. Differentiable in
    ``hidden`` and ``bias`` (training learns ``copy_bias`` through it).

    Args:
        hidden: [K, D] the drafter's hidden states.
        copy_ids: [K] full id of each row's proposal (any id where there is none).
        bias: [K] float32 what its logit gets (``DFlashDraftModel.copy_logit_bias``).
        has: [K] the rows that have a proposal.
        columns: [V] full id -> column of the reduced head, negative outside it
            (``draft_columns``); None: the full vocabulary (every proposal is inside).
        full_weight: [V, D] the target's full head (scores a proposal outside).
        full_bias: [V] its bias, if any.
        dtype: the outside score's product dtype (None: ``hidden``'s).
    """
    if columns is None:
        return CopyPointer(copy_ids, bias)
    col = columns[copy_ids]
    inside, outside = has & (col >= 0), has & (col < 0)
    extra = torch.full(bias.shape, float("-inf"), dtype=torch.float32, device=bias.device)
    # decoding scores every row and keeps the outside ones (no host read to ask whether any is);
    # training, with gradients, skips the gather when no proposal is outside
    if not torch.is_grad_enabled() or bool(outside.any()):
        dt = dtype or hidden.dtype
        rows = full_weight[copy_ids.to(full_weight.device)].to(hidden.device, dt)  # [K, D]
        score = (hidden.to(dt) * rows).sum(-1).float() + bias
        if full_bias is not None:
            score = score + full_bias[copy_ids.to(full_bias.device)].float().to(score.device)
        extra = torch.where(outside, score, extra)
    return CopyPointer(col.clamp(min=0), torch.where(inside, bias, torch.zeros_like(bias)), extra, copy_ids, outside)


def pointer_logits(
    logits: torch.Tensor, col: torch.Tensor | None, bias: torch.Tensor | None, extra: torch.Tensor | None = None
) -> torch.Tensor:
    """Head logits [K, V] with the copy pointer (``copy_pointer``): ``bias`` [K] added in place
    at column ``col`` [K] of each row and, where given, ``extra`` [K] appended as column V."""
    if bias is not None and col is not None:
        logits.scatter_add_(1, col[:, None], bias[:, None].to(logits.dtype))
    if extra is not None:
        logits = torch.cat([logits, extra[:, None].to(logits.dtype)], 1)
    return logits
