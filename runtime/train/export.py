"""Export a run's last checkpoint as a shipped drafter (``OUT/drafter``) with its model card."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from runtime.engine.models.drafter_io import load_draft_model, save_draft_model
from runtime.train.state import load_trainer_state


def _portable(path: Path | str, base: Path) -> str:
    """``path`` relative to the run folder when inside it, else its last two parts: no machine-
    specific absolute path ends up in a shipped drafter's config or card."""
    p, b = Path(path), Path(base)
    try:
        return str(p.resolve().relative_to(b.resolve()))
    except ValueError:
        return str(Path(*p.parts[-2:])) if p.is_absolute() else str(p)


def export(out_dir: Path, evaluation: dict[str, Any] | None, card: str) -> Path:
    """Copy the latest checkpoint's drafter to ``out_dir/drafter`` with the model card.

    The evaluation's conditional acceptance is stored in ``dflash_config.acceptance_conditional``
    (the runtime's prior for choosing the verify length).
    """
    ckpt = out_dir / "checkpoint"
    drafter = load_draft_model(ckpt, "cpu", torch.float32)
    dest = out_dir / "drafter"
    tmp = out_dir / "drafter.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    raw = dict(drafter.config.raw)
    dconf = dict(raw.get("dflash_config") or {})
    if evaluation and evaluation.get("conditional_acceptance"):
        dconf["acceptance_conditional"] = evaluation["conditional_acceptance"]
    blob = load_trainer_state(ckpt)
    # what bench's pitfall checks read: training length, feature dtype, thinking mode
    extra: dict[str, Any] = {
        "dflash_config": dconf,
        "training": {"max_len": int(blob["config"]["max_len"]), "dtype": "bfloat16", "thinking": False},
    }
    training = dict(raw.get("dflash_training") or {})
    if "dataset" in training:
        training["dataset"] = _portable(training["dataset"], out_dir)  # no machine-specific path shipped
    for key in ("extra_datasets", "corpus_datasets"):
        if key in training:
            training[key] = [_portable(p, out_dir) for p in training[key]]
    if evaluation:
        training["evaluation"] = evaluation
    extra["dflash_training"] = training
    drafter = drafter.to(torch.bfloat16)
    save_draft_model(drafter, tmp, extra)
    (tmp / "README.md").write_text(card)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.replace(dest)
    return dest
