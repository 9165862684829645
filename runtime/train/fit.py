"""Train a drafter on a run's data (``fit``): a new drafter, a warm start or a resumed
checkpoint, its draft vocabulary and corpus table, the training and evaluation logs."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from runtime.engine.models.drafter_io import load_draft_model
from runtime.engine.models.drafter_surgery import add_copy_corpus, add_copy_inputs
from runtime.engine.models.target import TargetModel
from runtime.errors import ConfigError
from runtime.train.batching import count_corpus
from runtime.train.config import TrainConfig
from runtime.train.data import Progress
from runtime.train.datasets import open_datasets, open_eval_set
from runtime.train.model_init import (
    init_drafter,
    init_from_target,
    make_drafter_config,
    pick_mask_token_id,
    target_has_attention_bias,
    warm_start,
)
from runtime.train.shards import dataset_meta
from runtime.train.specs import DrafterSpec
from runtime.train.state import load_trainer_state
from runtime.train.trainer import Trainer
from runtime.train.vocab import choose_draft_vocab


def frozen_weights(target: TargetModel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(embedding, lm_head, final norm weight) of the target, detached."""
    base = getattr(target.model, "model", None)
    norm = getattr(base, "norm", None) if base is not None else None
    norm_w = norm.weight.detach() if norm is not None and hasattr(norm, "weight") else None
    return target.embed.weight.detach(), target.lm_head.weight.detach(), norm_w


def saved_config(ckpt: Path) -> TrainConfig:
    """The hyper-parameters a run recorded in its ``checkpoint/`` folder."""
    saved = dict(load_trainer_state(ckpt)["config"])
    saved["betas"] = tuple(saved["betas"])
    return TrainConfig(**saved)


def fit(
    target: TargetModel,
    tokenizer: Any,
    data_dir: Path,
    out_dir: Path,
    spec: DrafterSpec,
    config: TrainConfig | None,
    resume: bool = False,
    extend: bool = False,
    device: str | torch.device = "cpu",
    progress: Progress | None = None,
    eval_sets: dict[str, Path] | None = None,
    extra_data: Sequence[Path] = (),
    corpus_data: Sequence[Path] = (),
) -> Trainer:
    """Train a drafter on ``data_dir``; checkpoints go to ``out_dir/checkpoint``.

    Args:
        config: hyper-parameters; None with ``resume`` keeps the checkpoint's.
        resume: continue from ``out_dir/checkpoint`` (same schedule).
        extend: with ``resume``, start a new warm-up + cosine segment (continue a finished run).
        eval_sets: more held-out dataset folders (e.g. {"ood": OUT/eval-data/ood}), evaluated with
            the validation shard at every ``eval_every`` steps into ``out_dir/eval.jsonl``.
        extra_data: more dataset folders trained on with ``data_dir`` (``open_datasets``).
        corpus_data: dataset folders counted into a drafter's corpus table (every shard) but not
            trained on; a resumed run without them counts the ones it recorded.

    Raises:
        ConfigError: a checkpoint exists and neither ``resume`` nor a fresh ``out_dir`` was asked for.
    """
    ckpt = out_dir / "checkpoint"
    embed, head, final_norm = frozen_weights(target)
    hidden = target.hidden_size
    init_report = None
    if resume:
        if not ckpt.exists():
            raise ConfigError(f"nothing to resume: {ckpt} does not exist")
        drafter = load_draft_model(ckpt, "cpu", torch.float32)
        cfg = dict(drafter.config.raw)
        if config is None:
            config = saved_config(ckpt)
    else:
        if config is None:
            raise ConfigError("a new training run needs a number of steps or a time budget")
        if ckpt.exists():
            raise ConfigError(f"{ckpt} exists; pass --resume to continue it or choose another --out")
        meta = dataset_meta(data_dir)
    if not resume and spec.from_drafter is not None:
        drafter, init_report = warm_start(spec.from_drafter, target, meta["taps"], spec.grow_to)
    elif not resume:
        taps = list(spec.taps) if spec.taps else list(meta["taps"])
        mask = spec.mask_token_id if spec.mask_token_id is not None else pick_mask_token_id(target.config, tokenizer)
        cfg = make_drafter_config(
            target.config,
            num_layers=spec.num_layers,
            block_size=spec.block_size,
            target_layer_ids=taps,
            mask_token_id=mask,
            intermediate_size=spec.intermediate_size,
        )
        if spec.init == "target":
            cfg["attention_bias"] = target_has_attention_bias(target.model)  # Qwen2: copy q/k/v biases
        drafter = init_drafter(cfg, final_norm)
        if spec.init == "target":
            init_report = init_from_target(drafter, target.model)
    if not resume and spec.copy_ngram is not None:
        drafter = add_copy_inputs(drafter, spec.copy_ngram)
    taps = list(drafter.dflash.target_layer_ids)
    train, val = open_datasets(data_dir, taps, hidden, extra=extra_data)
    out_dir.mkdir(parents=True, exist_ok=True)
    coverage = None
    if not resume:
        coverage = choose_draft_vocab(drafter, train, val, spec, target.vocab_size, _eos_ids(tokenizer))
        (out_dir / "vocab-coverage.json").write_text(json.dumps(coverage, indent=2))
        if init_report is not None:
            (out_dir / "init-report.json").write_text(json.dumps(init_report, indent=2))
    counts = None
    grams = spec.copy_corpus if not resume and spec.copy_corpus is not None else drafter.dflash.copy_corpus
    if resume and not corpus_data:
        corpus_data = [Path(p) for p in (drafter.config.raw.get("dflash_training") or {}).get("corpus_datasets", [])]
    if corpus_data and grams is None:
        raise ConfigError("--corpus-data fills a corpus table: give --copy-corpus (or a drafter that has one)")
    if grams is not None:  # counted afresh from this run's training answers (a resumed run: the same ones)
        more = [open_eval_set(Path(p), taps, hidden) for p in corpus_data]
        counts = count_corpus([train, *more], grams, config.max_len)
        drafter = add_copy_corpus(drafter, grams)  # the Trainer builds its table from the counts
    trainer = Trainer(drafter, embed, head, train, val, config, out_dir, device, corpus=counts)
    for name, path in (eval_sets or {}).items():
        trainer.extra_evals[name] = open_eval_set(path, taps, hidden)
    if resume:
        trainer.load_checkpoint(ckpt, new_segment=extend)
    log = (out_dir / "train_log.jsonl").open("a")
    eval_log = (out_dir / "eval.jsonl").open("a")

    def on_step(info: dict[str, Any]) -> None:
        if "val" in info:
            log.write(json.dumps({"time": time.time(), **info}) + "\n")
            log.flush()
        if progress:
            progress(info)

    def on_eval(entry: dict[str, Any]) -> None:
        eval_log.write(json.dumps({"time": round(time.time(), 1), **entry}) + "\n")
        eval_log.flush()

    trainer.on_eval = on_eval
    recorded = dict(drafter.config.raw.get("dflash_training") or {}) if resume else {}
    init_kind = "drafter" if spec.from_drafter is not None else spec.init
    init_note = recorded.get("init") or (
        {"kind": "not recorded"} if resume else {"kind": init_kind, **({"report": init_report} if init_report else {})}
    )
    vocab_note = recorded.get("draft_vocab") or _vocab_note(coverage, drafter)

    def extra() -> dict[str, Any]:
        rec = _training_record(trainer, data_dir)
        if extra_data:
            rec["extra_datasets"] = [str(p) for p in extra_data]
        if corpus_data:
            rec["corpus_datasets"] = [str(p) for p in corpus_data]
        if counts is not None:
            table = trainer.drafter.corpus
            rec["corpus"] = {"entries": len(table) if table is not None else 0, "answer_tokens": counts.answer_tokens}
        rec["init"], rec["draft_vocab"] = init_note, vocab_note
        return {"dflash_training": rec}

    try:
        trainer.run(on_step, extra)
    finally:
        log.close()
        eval_log.close()
    return trainer


def _vocab_note(coverage: dict[str, Any] | None, drafter: Any) -> dict[str, Any]:
    if coverage is None:
        n = drafter.draft_vocab_ids
        return {"n": int(n.numel()) if n is not None else None}
    return {**coverage["chosen"], "heldout_answer_tokens": coverage["heldout_answer_tokens"]}


def _eos_ids(tokenizer: Any) -> list[int]:
    ids = []
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return ids


def _training_record(trainer: Trainer, data_dir: Path) -> dict[str, Any]:
    s = trainer.state
    last = s.history[-1] if s.history else {}
    return {
        "steps": s.step,
        "train_seconds": round(s.elapsed, 1),
        "segments": s.segments,
        "context_tokens_seen": s.tokens_seen,
        "dataset": str(data_dir),
        "hyperparameters": {
            k: v for k, v in asdict(trainer.cfg).items() if k not in ("eval_every", "checkpoint_every")
        },
        "last_validation": last,
    }
