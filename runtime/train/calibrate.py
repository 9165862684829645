"""Copy-trust calibration: one scale of a drafter's copy pointer, chosen on held-out requests.

A drafter with copy inputs learns how far to trust the context lookup's proposal
(``DFlashDraftModel.copy_bias``, one bias per matched n-gram size) on its training data, where its
own guesses are at their best. On requests unlike that data its own guesses get worse while the
copies stay as good. But the runtime also verifies the context lookup's own copy next to the draft
(``ContextLookup``), and where both copy the same tokens the drafter's trust in them buys nothing:
on the shipped drafter, a 3x pointer raised the drafter-alone teacher-forced tau on chat-coding from
2.18 to 2.40 and cut the real decoder's tau on ood-chat from 2.19 to 2.09. ``calibrate_copy``
multiplies every matched size's bias by one scale (0 turns the pointer off, the copy inputs stay),
the one that maximises teacher-forced tau at every anchor of the target's answers to a calibration
set of prompts, where a block accepts the longer of the drafter's chain and the lookup's copy
(objective "lookup", the runtime's default) or the drafter's chain alone ("chain", ``--lookups 0``).
The set must be disjoint from the prompts the drafter is evaluated on, or the evaluation is
optimistic; ``dflash train --calibrate-copy`` refuses the OOD evaluation set.

The scale is folded into ``copy_bias``: the drafter keeps the published layout plus its copy inputs,
and every engine that reads them drafts with the calibrated trust.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from runtime.engine.drafter import DFlashDraftModel
from runtime.errors import ConfigError
from runtime.train.trainer import ShardDataset, TrainConfig, Trainer

SCALES = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)  # the grid searched
OBJECTIVES = ("lookup", "chain")
LOOKUP_MIN_MATCH = 2  # the runtime's context lookup matches 2-4-grams (``ContextLookup``)
ANCHORS = 4096  # blocks per pair of sequences: more than any sequence has, so every anchor is scored


@torch.no_grad()
def calibrate_copy(
    drafter: DFlashDraftModel,
    embed_weight: torch.Tensor,
    head_weight: torch.Tensor,
    data: ShardDataset,
    device: torch.device | str = "cpu",
    bf16: bool = False,
    scales: Sequence[float] = SCALES,
    objective: str = "lookup",
    max_seqs: int = 64,
) -> dict[str, Any]:
    """Scale ``drafter.copy_bias`` (every matched size by the same factor) by the grid value with
    the highest teacher-forced tau on ``data``, in place.

    Args:
        drafter: a drafter with copy inputs.
        embed_weight, head_weight: the target's input embeddings and output head.
        data: the target's answers to the calibration prompts (``prepare_eval_data``).
        device: where to score.
        bf16: autocast matmuls to bfloat16 while scoring (as training does on such devices).
        scales: the factors tried (1 is always tried); ties go to the one nearest 1.
        objective: "lookup" (the runtime's default decoding: every block accepts the longer of the
            drafter's chain and the context lookup's copy of 2+-gram matches, so the drafter is
            worth most where the lookup is wrong) or "chain" (the drafter alone, ``--lookups 0``).
        max_seqs: sequences of ``data`` scored (the first ones).

    Returns:
        ``scale`` (the one applied), ``objective``, ``tau`` / ``slot1`` before and after, ``positions``
        (slot-1 positions scored) and ``grid``: per scale tried, ``tau_chain`` (drafter alone),
        ``tau_lookup`` (with the context lookup) and slot-1 top-1.

    Raises:
        ConfigError: the drafter has no copy inputs, an unknown objective, or ``data`` gives no
            complete block.
    """
    if drafter.copy_bias is None:
        raise ConfigError("the drafter has no copy inputs to calibrate (train it with --copy-inputs or --copy-ngram)")
    if objective not in OBJECTIVES:
        raise ConfigError(f"calibration objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if 1.0 not in scales:
        scales = (1.0, *scales)
    with tempfile.TemporaryDirectory(prefix="dflash-calibrate-") as tmp:
        cfg = TrainConfig(steps=1, anchors=ANCHORS, bf16=bf16)
        trainer = Trainer(drafter, embed_weight, head_weight, data, None, cfg, Path(tmp), device)
        trainer.validate(max_seqs=max_seqs, dataset=data, name="calibration")  # builds the fixed batches
        batches = trainer._val_batches.get("calibration") or []
        bias = drafter.copy_bias
        base = bias.detach().clone()
        drafter.eval()
        grid = []
        for scale in scales:
            bias.copy_(base * scale)
            grid.append({"scale": float(scale), **_score(trainer, batches)})
        drafter.train()
    key = "tau_lookup" if objective == "lookup" else "tau_chain"
    best = max(grid, key=lambda r: (round(r[key], 3), -abs(r["scale"] - 1.0)))
    bias.data.copy_(base * best["scale"])
    before = next(r for r in grid if r["scale"] == 1.0)
    return {
        "scale": best["scale"],
        "objective": objective,
        "tau_before": before[key],
        "tau_after": best[key],
        "slot1_before": before["slot1"],
        "slot1_after": best["slot1"],
        "positions": before["positions"],
        "grid": [{k: v for k, v in r.items() if k != "positions"} for r in grid],
    }


def _score(trainer: Trainer, batches: Sequence[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Teacher-forced tau of the drafter's chain and of the better of it and the context lookup's
    copy, per complete block, and slot-1 top-1, over ``batches``."""
    chain, union, hits, present = [], [], 0, 0
    for b in batches:
        _, m = trainer._forward(b)
        correct, have = m["correct"].cpu(), m["present"].cpu()  # [B, A, b-1]
        labels = b["labels"]
        n, a, k = labels.shape
        proposal = b["copy_ids"].view(n, a, k + 1)[..., 1:]  # slot k's copy (slot 0 is the anchor)
        matched = b["copy_n"].view(n, a, k + 1)[..., 1:]
        copied = (proposal == labels) & (matched >= LOOKUP_MIN_MATCH) & (labels >= 0)
        full = have.all(-1)
        run = torch.cumprod(correct.long(), -1).sum(-1)[full]
        chain.append(run)
        union.append(torch.maximum(run, torch.cumprod(copied.long(), -1).sum(-1)[full]))
        hits += int(correct[..., 0][have[..., 0]].sum())
        present += int(have[..., 0].sum())
    runs = torch.cat(chain).float() if chain else torch.zeros(0)
    if runs.numel() == 0:
        raise ConfigError("the calibration set has no answer long enough to score a whole block")
    return {
        "tau_chain": round(1.0 + runs.mean().item(), 4),
        "tau_lookup": round(1.0 + torch.cat(union).float().mean().item(), 4),
        "slot1": round(hits / max(present, 1), 4),
        "positions": present,
    }
