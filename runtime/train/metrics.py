"""What a drafter's drafts on a batch measure: slot accuracies, teacher-forced tau, top-n
coverage and OOV share, and the walk a chain decoder takes over an answer (``tau_walk``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


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


def block_metrics(correct: torch.Tensor, present: torch.Tensor) -> dict[str, Any]:
    """Slot accuracies and teacher-forced tau (1 + mean leading run of correct slots)."""
    full = present.all(-1)
    run = torch.cumprod(correct.long(), dim=-1).sum(-1)
    slot_acc = (correct.sum((0, 1)).float() / present.sum((0, 1)).clamp(min=1).float()).tolist()
    tau = 1.0 + run[full].float().mean().item() if full.any() else float("nan")
    run3 = torch.cumprod(correct[..., :3].long(), dim=-1).sum(-1)
    tau3 = 1.0 + run3[full].float().mean().item() if full.any() else float("nan")
    return {"slot_acc": [round(x, 4) for x in slot_acc], "tau_tf": round(tau, 4), "tau_tf_k3": round(tau3, 4)}


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
        for r in walk(runs[i, :count].tolist(), 0, count):
            keep[i, j] = True
            j += r + 1
    return keep
