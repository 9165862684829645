"""Copy-trust calibration: one scale of a drafter's copy pointer, chosen on held-out requests.

A drafter with copy inputs learns how far to trust the context lookup's proposal
(``DFlashDraftModel.copy_bias``, one bias per matched n-gram size) on its training data, where its
own guesses are at their best. On requests unlike that data its own guesses get worse while the
copies stay as good, so the learnt bias trusts them too little. ``calibrate_copy`` multiplies every
matched size's bias by one scale (longer matches, already trusted more, gain more), the scale that
maximises teacher-forced tau (the mean accepted run of a chain, ``Trainer.block_metrics``) at every
anchor of the target's answers to a calibration set of prompts (on the shipped drafter a scale beat
adding one shift to every size: at equal tau, higher slot-1 top-1 on chat-coding). The set must be
disjoint from the prompts the drafter is evaluated on, or the evaluation is optimistic; ``dflash train --calibrate-copy`` refuses the OOD evaluation set.

The scale is folded into ``copy_bias``: the drafter keeps the published layout plus its copy inputs,
and every engine that reads them drafts with the calibrated trust.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from runtime.engine.drafter import DFlashDraftModel
from runtime.errors import ConfigError
from runtime.train.trainer import ShardDataset, TrainConfig, Trainer

SCALES = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0)  # the grid searched
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
        max_seqs: sequences of ``data`` scored (the first ones).

    Returns:
        ``scale`` (the one applied), ``tau_tf`` / ``slot1`` before and after, ``positions`` (slot-1
        positions scored) and ``grid`` (tau_tf and slot-1 top-1 at every scale tried).

    Raises:
        ConfigError: the drafter has no copy inputs, or ``data`` gives no complete block.
    """
    if drafter.copy_bias is None:
        raise ConfigError("the drafter has no copy inputs to calibrate (train it with --copy-inputs or --copy-ngram)")
    if 1.0 not in scales:
        scales = (1.0, *scales)
    with tempfile.TemporaryDirectory(prefix="dflash-calibrate-") as tmp:
        cfg = TrainConfig(steps=1, anchors=ANCHORS, bf16=bf16)
        trainer = Trainer(drafter, embed_weight, head_weight, data, None, cfg, Path(tmp), device)
        bias = drafter.copy_bias
        base = bias.detach().clone()
        grid = []
        for scale in scales:
            bias.copy_(base * scale)
            m = trainer.validate(max_seqs=max_seqs, dataset=data, name="calibration")
            if not m or m["tau_tf"] != m["tau_tf"]:  # no complete block: tau is nan
                raise ConfigError("the calibration set has no answer long enough to score a whole block")
            grid.append({"scale": float(scale), "tau_tf": m["tau_tf"], "slot1": m["slot_acc"][0]})
        best = max(grid, key=lambda r: (round(r["tau_tf"], 3), -abs(math.log(r["scale"]))))
        bias.copy_(base * best["scale"])
        positions = sum(int((b["labels"][..., 0] >= 0).sum()) for b in trainer._val_batches["calibration"])
    before = next(r for r in grid if r["scale"] == 1.0)
    return {
        "scale": best["scale"],
        "tau_tf_before": before["tau_tf"],
        "tau_tf_after": best["tau_tf"],
        "slot1_before": before["slot1"],
        "slot1_after": best["slot1"],
        "positions": positions,
        "grid": grid,
    }
