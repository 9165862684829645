"""Sanity checks on what a model computes, so that damaged weights fail loudly instead of printing nonsense."""

from __future__ import annotations

from typing import Any

import torch

from runtime.errors import ModelLoadError


def model_folder(model: Any) -> str:
    """Where a loaded transformers model came from (``config._name_or_path``), or its class name."""
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
    return str(name) if name else type(model).__name__


def ensure_finite_logits(logits: torch.Tensor, target: Any) -> None:
    """Stop when the target's first-step logits hold NaN or inf (one host sync, at prefill only).

    Safetensors with an intact header but garbage data load without complaint and decode to an
    endless run of token 0; the first step is where that shows.

    Args:
        logits: [n, vocab] logits of the prefill.
        target: the wrapped target (``.model`` names its folder).

    Raises:
        ModelLoadError: non-finite logits; the message names the model folder.
    """
    if not bool(torch.isfinite(logits).all()):
        folder = model_folder(getattr(target, "model", target))
        raise ModelLoadError(
            f"the target in {folder} computes non-finite logits (NaN/inf) on the first step: its weights are "
            "damaged or were saved wrongly; download or convert it again (dflash doctor checks the files)"
        )
