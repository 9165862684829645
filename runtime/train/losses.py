"""The drafter's head and loss in one pass over row chunks (a fused linear + cross-entropy).

Training spends most of a step on the draft head: [rows, N] logits for every block slot, cast to
float32, a log-softmax, its backward and the zero-filled gradient buffers around them, each a full
pass over rows x N memory (24.5K ids x 672 rows = 66 MB in float32). Here the logits of a chunk of
rows are made, reduced and turned into their gradient while they are still in cache, and only the
[rows, D] gradient of the hidden states is kept for the backward pass: the head weights are frozen,
so nothing else needs the logits.

The loss is a weighted cross-entropy against sparse target distributions, which covers both the
hard label and the target's stored top-k (soft distillation): for row r with target ids ``ids[r]``
and weights ``coef[r]`` (0 = unused entry),

    loss = sum_r ( sum_j coef[r, j] ) * logsumexp(logits[r]) - sum_j coef[r, j] * logits[r, ids[r, j]]

whose gradient with respect to logits[r] is ``sum_j coef[r, j] * softmax(logits[r]) - scatter(coef[r])``.

A drafter with copy inputs also points at the context lookup's proposal for each row: ``bonus[r]``
is added to the logit of column ``bonus_col[r]`` (a proposal inside the draft vocabulary) and
``extra[r]`` is the logit of one more column, index N (a proposal outside it, scored by the caller
from the full head; -inf where there is none). Both are differentiable inputs: their gradients are
the logits' gradient at those columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runtime.engine.draft_head import pointer_logits

DEFAULT_CHUNK = 128  # rows per chunk: 128 x 24.5K float32 logits = 12.5 MB (fastest of 16..256 measured on 2 cores)


@dataclass
class HeadLoss:
    """What one fused pass returns.

    Attributes:
        loss: scalar, differentiable with respect to the hidden states.
        lse: [R] logsumexp of each row's logits (float32, no gradient).
        picked: [R, J] logits at ``ids`` (float32, no gradient).
        pred: [R] argmax over the head (None unless metrics were asked for).
        rank: [R] how many logits exceed the one at ``ids[:, 0]`` (None unless metrics were asked for).
    """

    loss: torch.Tensor
    lse: torch.Tensor
    picked: torch.Tensor
    pred: torch.Tensor | None = None
    rank: torch.Tensor | None = None


def _chunk_logits(
    hh: torch.Tensor,
    head: torch.Tensor,
    s: int,
    e: int,
    bonus: torch.Tensor | None,
    bonus_col: torch.Tensor | None,
    extra: torch.Tensor | None,
) -> torch.Tensor:
    """float32 logits of rows ``s:e``: the head, the pointer's ``bonus`` at ``bonus_col`` and the
    ``extra`` column N where given ([c, N] or [c, N + 1]; ``runtime.engine.draft_head.pointer_logits``,
    as the decoder adds them)."""
    logits = (hh[s:e] @ head.T).float()
    col = bonus_col[s:e] if bonus_col is not None else None
    return pointer_logits(
        logits, col, bonus[s:e] if bonus is not None else None, extra[s:e] if extra is not None else None
    )


class _FusedHeadCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        head: torch.Tensor,
        ids: torch.Tensor,
        coef: torch.Tensor,
        chunk: int,
        metrics: bool,
        bonus: torch.Tensor | None,
        bonus_col: torch.Tensor | None,
        extra: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        rows, n = h.shape[0], head.shape[0]
        dev = h.device
        grad_bonus = torch.zeros(rows, dtype=torch.float32, device=dev) if bonus is not None else None
        grad_extra = torch.zeros(rows, dtype=torch.float32, device=dev) if extra is not None else None
        lse = torch.empty(rows, dtype=torch.float32, device=dev)
        picked = torch.empty(ids.shape, dtype=torch.float32, device=dev)
        pred = torch.empty(rows if metrics else 0, dtype=torch.long, device=dev)
        rank = torch.empty(rows if metrics else 0, dtype=torch.long, device=dev)
        want_grad = ctx.needs_input_grad[0]
        grad_h = torch.empty(h.shape, dtype=h.dtype, device=dev) if want_grad else None
        mass = coef.sum(-1)
        total = torch.zeros((), dtype=torch.float32, device=dev)
        hh = h.to(head.dtype)
        for s in range(0, rows, chunk):
            e = min(s + chunk, rows)
            logits = _chunk_logits(hh, head, s, e, bonus, bonus_col, extra)  # [c, N (+ 1)]
            top = logits.amax(-1, keepdim=True)
            at_ids = logits.gather(1, ids[s:e])
            if metrics:
                pred[s:e] = logits.argmax(-1)
                rank[s:e] = (logits > at_ids[:, :1]).sum(-1)
            logits.sub_(top).exp_()  # in place: exp(logits - max)
            z = logits.sum(-1)
            lse_c = z.log() + top.squeeze(-1)
            lse[s:e], picked[s:e] = lse_c, at_ids
            weighted = torch.where(coef[s:e] != 0, coef[s:e] * at_ids, 0.0)  # an unused -inf entry adds 0
            total += (mass[s:e] * lse_c).sum() - weighted.sum()
            if grad_h is not None:
                logits.mul_((mass[s:e] / z)[:, None])  # softmax scaled by the row's mass
                logits.scatter_add_(1, ids[s:e], -coef[s:e])
                grad_h[s:e] = (logits[:, :n].to(head.dtype) @ head).to(h.dtype)
            if grad_bonus is not None and bonus_col is not None:
                grad_bonus[s:e] = logits.gather(1, bonus_col[s:e, None])[:, 0]
            if grad_extra is not None:
                grad_extra[s:e] = logits[:, n]
        empty = torch.empty(0)
        ctx.save_for_backward(
            grad_h if grad_h is not None else empty,
            grad_bonus if grad_bonus is not None else empty,
            grad_extra if grad_extra is not None else empty,
        )
        ctx.has = (grad_h is not None, grad_bonus is not None, grad_extra is not None)
        ctx.mark_non_differentiable(lse, picked, pred, rank)
        return total, lse, picked, pred, rank

    @staticmethod
    def backward(ctx: Any, g_loss: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        grad_h, grad_bonus, grad_extra = ctx.saved_tensors
        has_h, has_bonus, has_extra = ctx.has
        g = g_loss.float()
        return (
            grad_h * g_loss.to(grad_h.dtype) if has_h else None,
            None,
            None,
            None,
            None,
            None,
            grad_bonus * g if has_bonus else None,
            None,
            grad_extra * g if has_extra else None,
        )


def fused_head_loss(
    h: torch.Tensor,
    head: torch.Tensor,
    ids: torch.Tensor,
    coef: torch.Tensor,
    metrics: bool = False,
    chunk: int = DEFAULT_CHUNK,
    bonus: torch.Tensor | None = None,
    bonus_col: torch.Tensor | None = None,
    extra: torch.Tensor | None = None,
) -> HeadLoss:
    """Weighted cross-entropy of ``h @ head.T`` against sparse targets, without materialising logits.

    Args:
        h: [R, D] hidden states (gradients flow to them).
        head: [N, D] frozen head weights (their dtype is the matmuls' dtype).
        ids: [R, J] head indices of each row's target entries (any valid index where unused; N is
            the ``extra`` column when given).
        coef: [R, J] float32 weight of each entry (0 where unused); the loss is normalised by the caller.
        metrics: also return the argmax and the rank of ``ids[:, 0]``.
        chunk: rows per chunk.
        bonus: [R] added to the logit of column ``bonus_col`` [R] of each row (both or neither).
        extra: [R] logit of column N of each row (-inf: none).

    Returns:
        ``HeadLoss`` (``pred`` and ``rank`` count column N where ``extra`` is given).
    """
    if ids.shape != coef.shape or ids.dim() != 2 or ids.shape[0] != h.shape[0]:
        raise ValueError(f"ids {tuple(ids.shape)} and coef {tuple(coef.shape)} must be [R, J] with R = {h.shape[0]}")
    if (bonus is None) != (bonus_col is None):
        raise ValueError("bonus and bonus_col go together")
    for name, t in (("bonus", bonus), ("bonus_col", bonus_col), ("extra", extra)):
        if t is not None and tuple(t.shape) != (h.shape[0],):
            raise ValueError(f"{name} {tuple(t.shape)} must be [R] with R = {h.shape[0]}")
    with torch.autocast(h.device.type, enabled=False):
        loss, lse, picked, pred, rank = _FusedHeadCE.apply(
            h,
            head,
            ids.to(h.device),
            coef.to(h.device, torch.float32),
            max(int(chunk), 1),
            metrics,
            bonus,
            bonus_col.to(h.device) if bonus_col is not None else None,
            extra,
        )
    return HeadLoss(loss, lse, picked, pred if metrics else None, rank if metrics else None)


@torch.no_grad()
def head_argmax(
    h: torch.Tensor,
    head: torch.Tensor,
    chunk: int = DEFAULT_CHUNK,
    bonus: torch.Tensor | None = None,
    bonus_col: torch.Tensor | None = None,
    extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """The argmax column of ``h @ head.T`` (with the pointer's ``bonus`` and ``extra`` column as in
    ``fused_head_loss``), chunk by chunk and without gradients: [R] indices, N for the extra column."""
    out = torch.empty(h.shape[0], dtype=torch.long, device=h.device)
    hh = h.detach().to(head.dtype)
    col = bonus_col.to(h.device) if bonus_col is not None else None
    with torch.autocast(h.device.type, enabled=False):
        for s in range(0, h.shape[0], chunk):
            e = min(s + chunk, h.shape[0])
            out[s:e] = _chunk_logits(hh, head, s, e, bonus, col, extra).argmax(-1)
    return out
