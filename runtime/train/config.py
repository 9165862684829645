"""A training run's hyper-parameters (``TrainConfig``), its counters (``TrainState``) and the
slots' loss weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.errors import ConfigError

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
            ``metrics.walk_rows``, before the loss is taken).
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
