"""Evaluate a run's checkpoint: the real decoder against plain decoding on the in-distribution
and OOD prompts, side by side, and the teacher-forced coverage on the target's answers to both."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runtime.engine.models.drafter_io import load_draft_model
from runtime.errors import ConfigError
from runtime.pipeline import Pipeline
from runtime.session import SessionOptions, calibrate
from runtime.train.config import TrainConfig
from runtime.train.data import load_shard
from runtime.train.datasets import open_datasets, open_eval_set
from runtime.train.evaluate import EvalResult, IdPrompt, encode, evaluate
from runtime.train.fit import frozen_weights
from runtime.train.heldout import HELDOUT, ood_prompts
from runtime.train.trainer import Trainer


def evaluate_checkpoint(
    pipe: Pipeline,
    session: SessionOptions,
    out: Path,
    n: int,
    tokens: int,
    say: Callable[[str], None],
    data_dir: Path | None = None,
    ood: bool = True,
) -> dict[str, Any]:
    """Real-decoder evaluation on the in-distribution and OOD sets, side by side, plus the
    teacher-forced top-k coverage and OOV share on the target's answers to both."""
    pipe.drafter = load_draft_model(out / "checkpoint", pipe.device, pipe.dtype)
    pipe.target.set_taps(pipe.drafter.dflash.target_layer_ids)
    if session.calibration_file is not None:  # the verify length comes from this machine's costs, as in `dflash run`
        calibrate(pipe, session.calibration_file, say)
    what, in_dist = in_distribution_prompts(data_dir, n)
    sets = {"in_distribution": (what, in_dist)}
    if ood:
        sets["ood"] = ("hand-written OOD chat requests (runtime/assets/prompts/ood-chat.jsonl)", ood_prompts()[:n])
    results, summary = {}, {}
    limit = pipe.target.max_positions
    for name, (desc, prompts) in list(sets.items()):
        fits = [p for p in prompts if limit is None or len(encode(pipe, p)) + tokens < limit]
        if len(fits) < len(prompts):
            say(f"{name}: {len(prompts) - len(fits)} prompt(s) longer than the target's context skipped")
        sets[name] = (desc, fits)
    for name, (desc, prompts) in sets.items():
        if not prompts:
            continue
        torch.manual_seed(0)
        say(f"evaluating on {len(prompts)} {name} prompts: {desc} ({tokens} tokens each, plain vs DFlash)")
        results[name] = evaluate(pipe, prompts, max_new_tokens=tokens, progress=say)
        summary[name] = {"description": desc, **results[name].summary()}
        say(f"{name}: " + json.dumps(summary[name]))
    pooled = EvalResult(tuple(p for r in results.values() for p in r.prompts)).summary()  # the verify-length prior
    tf = teacher_forced(pipe, out, {"in_distribution": data_dir, "ood": out / "eval-data" / "ood"})
    for name, m in tf.items():
        say(f"{name} teacher-forced: " + json.dumps(m))
    return {**pooled, "sets": summary, "teacher_forced": tf}


def in_distribution_prompts(data_dir: Path | None, n: int) -> tuple[str, list[Any]]:
    """Prompts of the dataset's held-out (validation) shard, never trained on; the hand-written
    held-out list when the dataset is not on this machine."""
    shards = sorted(Path(data_dir).glob("shard-*.safetensors")) if data_dir and Path(data_dir).is_dir() else []
    if len(shards) < 2:
        return "held-out prompts (hand-written, runtime/train/heldout.py)", list(HELDOUT[:n])
    shard = load_shard(shards[-1])
    out = []
    for j in range(min(n, shard.num_sequences)):
        a = int(shard.offsets[j])
        ids = tuple(shard.tokens[a : a + int(shard.prompt_len[j])].tolist())
        src = shard.sources[j] if j < len(shard.sources) else "heldout-shard"
        out.append(IdPrompt(ids, not src.startswith(("stdlib-raw", "raw-file")), src))
    return "the generator's prompts in the dataset's held-out shard (never trained on)", out


def teacher_forced(pipe: Any, out: Path, sets: dict[str, Path | None]) -> dict[str, Any]:
    """Top-k coverage per slot, OOV share and teacher-forced tau of the checkpoint on datasets of
    target answers (the validation shard, the OOD answers)."""
    drafter = load_draft_model(out / "checkpoint", "cpu")
    taps = list(drafter.dflash.target_layer_ids)
    embed, head, _ = frozen_weights(pipe.target)
    res: dict[str, Any] = {}
    for name, path in sets.items():
        if not path or not Path(path).is_dir() or not list(Path(path).glob("shard-*.safetensors")):
            continue
        try:
            if name == "in_distribution":
                _, data = open_datasets(Path(path), taps, pipe.target.hidden_size)
            else:
                data = open_eval_set(Path(path), taps, pipe.target.hidden_size)
        except ConfigError:  # too few shards, or features of other layers: nothing to measure here
            continue
        cfg = TrainConfig(steps=1, bf16=pipe.dtype != torch.float32)
        tr = Trainer(drafter, embed, head, data, data, cfg, out, "cpu")
        res[name] = tr.validate(max_seqs=64, dataset=data, name=name)
    return res
