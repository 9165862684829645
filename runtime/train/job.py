"""`dflash train` as one call: ``run_training(options, hooks)`` checks the options, records the
run folder, builds the data, trains, evaluates and exports; ``--eval-only`` re-evaluates and
re-exports a checkpoint. Nothing here prints: lines and progress go to ``TrainHooks``."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from runtime.engine.models.device import cpu_has_fast_bf16, resolve_device
from runtime.engine.models.drafter_config import default_target_layer_ids
from runtime.errors import ConfigError
from runtime.models.embedded import embedded_drafter_dir
from runtime.pipeline import Pipeline
from runtime.session import SessionOptions
from runtime.train import options as opt
from runtime.train.checkpoint_eval import evaluate_checkpoint
from runtime.train.config import TrainConfig, TrainState
from runtime.train.datasets import data_report, prepare_data, prepare_eval_data
from runtime.train.export import export
from runtime.train.fit import fit, saved_config
from runtime.train.lock import RunFolderLock
from runtime.train.model_card import RunRecord, model_card
from runtime.train.options import OptionError, TrainOptions
from runtime.train.run_folder import DATA_REPORT, record_command, record_sources, recorded_sources
from runtime.train.specs import COPY_NGRAM, DataSpec, DrafterSpec
from runtime.train.state import LEGACY_PICKLE, STATE_JSON, load_trainer_state, read_checkpoint_config
from runtime.train.text import default_roots

# the hyper-parameter options a resumed run takes over only when they are typed again
_HYPER = ("lr", "copy_lr", "anchors", "anchor_sampling", "seqs_per_step", "max_len", "distill", "soft_weight")


@dataclass(frozen=True)
class TrainHooks:
    """What ``run_training`` needs from its caller and tells it.

    Attributes:
        open_pipeline: dtype choice -> the target opened (no drafter), with its session options.
        say: one line of progress.
        data_progress: data generation progress (``prepare_data``'s dicts).
        data_report: the dataset's size and mix (``data_report``), once it is built.
        step: a training step's numbers (``fit``'s progress).
    """

    open_pipeline: Callable[[str], tuple[Pipeline, SessionOptions]]
    say: Callable[[str], None]
    data_progress: Callable[[dict[str, Any]], None]
    data_report: Callable[[dict[str, Any]], None]
    step: Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class TrainResult:
    """Where the run ended: the exported drafter (``exported``), or the dataset (``--data-only``)."""

    path: Path
    exported: bool


def run_training(o: TrainOptions, hooks: TrainHooks) -> TrainResult:
    """Run one `dflash train` invocation, holding the run folder's lock throughout.

    Raises:
        OptionError: a bad option value or combination (a usage error).
        ConfigError, ModelLoadError: the run folder, its checkpoint or data cannot be used.
    """
    budget = opt.duration(o.time_budget)
    with RunFolderLock(o.out):  # one command per run folder, held until this one ends
        if (o.resume or o.eval_only) and (o.out / "checkpoint" / "config.json").exists():
            read_checkpoint_config(o.out / "checkpoint")  # a damaged one stops here, before anything is written
        if o.eval_only:
            return _eval_only(o, hooks)
        return _train(o, budget, hooks)


def _train(o: TrainOptions, budget: float | None, hooks: TrainHooks) -> TrainResult:
    out, say = o.out, hooks.say
    spec, data, extra_data, corpus_data, roots = _drafter_spec(o, budget)
    cfg = _train_config(o, budget)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = data or out / "data"
    pipe, session = hooks.open_pipeline(train_dtype(o.dtype, o.device))
    if pipe.tokenizer is None:
        raise OptionError("the target has no tokenizer; dflash train needs one to build prompts")
    record_command(out, o.argv)  # only invocations that got as far as building data or training
    data_taps = spec.taps or tuple(default_target_layer_ids(pipe.target.num_layers, o.layers or 1))
    if o.resume and (out / "checkpoint" / "config.json").exists():
        raw = read_checkpoint_config(out / "checkpoint")
        data_taps = tuple(raw["dflash_config"]["target_layer_ids"])
    if not o.data_only:
        record_sources(out, data_dir, extra_data, corpus_data)
    say(f"dataset {data_dir} (taps {list(data_taps)})")
    generator = "answers" if o.prompts_from else "self" if o.self_instruct else "files" if o.file_requests else "v2"
    if roots:
        generator = "fim" if o.fim_from else "text"
    data_spec = DataSpec(
        num_prompts=o.prompts,
        max_new_tokens=o.answer_tokens,
        batch_size=o.gen_batch,
        seed=o.data_seed,
        topk=o.topk,
        generator=generator,
        source=o.prompts_from,
        text_roots=roots,
    )
    prepare_data(pipe.target, pipe.tokenizer, data_dir, data_taps, data_spec, pipe.stop_token_ids, hooks.data_progress)
    report = data_report(data_dir)
    (out / DATA_REPORT).write_text(json.dumps(report, indent=2))
    hooks.data_report(report)
    if o.data_only:
        return TrainResult(data_dir, exported=False)
    eval_sets = {}
    if o.ood_eval:
        say("OOD evaluation set: the target's answers to the hand-written OOD prompts")
        eval_sets["ood"] = prepare_eval_data(
            pipe.target,
            pipe.tokenizer,
            out / "eval-data" / "ood",
            data_taps,
            pipe.stop_token_ids,
            max_new_tokens=o.answer_tokens,
            topk=o.topk,
        )
    trainer = fit(
        pipe.target,
        pipe.tokenizer,
        data_dir,
        out,
        spec,
        cfg,
        resume=o.resume,
        extend=o.extend,
        device=pipe.device,
        progress=hooks.step,
        eval_sets=eval_sets,
        extra_data=extra_data,
        corpus_data=corpus_data,
    )
    evaluation = None
    if not o.no_eval and o.eval_prompts > 0:
        evaluation = evaluate_checkpoint(pipe, session, out, o.eval_prompts, o.eval_tokens, say, data_dir, o.ood_eval)
    card = model_card(pipe, trainer, evaluation, o.argv, data_dir=data_dir)
    return TrainResult(export(out, evaluation, card), exported=True)


def _drafter_spec(
    o: TrainOptions, budget: float | None
) -> tuple[DrafterSpec, Path | None, list[Path], list[Path], tuple[Path, ...]]:
    """The options checked, in the order the CLI always checked them: the drafter to build, the
    dataset folder (None: OUT/data), the extra and corpus datasets and the --text-from roots."""
    out, resume = o.out, o.resume
    vocab_choice = opt.draft_vocab(o.draft_vocab)
    if o.distill not in ("hard", "soft"):
        raise OptionError(f"--distill must be hard or soft, got {o.distill!r}")
    ngram = opt.ngram_sizes(o.copy_ngram) if o.copy_ngram is not None else COPY_NGRAM if o.copy_inputs else None
    corpus_grams = opt.ngram_sizes(o.copy_corpus, "--copy-corpus") if o.copy_corpus is not None else None
    if o.init not in ("random", "target"):
        raise OptionError(f"--init must be random or target, got {o.init!r}")
    if o.precision not in ("auto", "bf16", "fp32"):
        raise OptionError(f"--train-precision must be auto, bf16 or fp32, got {o.precision!r}")
    if not o.data_only and not resume and o.steps is None and budget is None:
        raise OptionError("give --steps or --time-budget (or --data-only)")
    tap_ids = opt.layer_ids(o.taps) if o.taps else None
    if sum(map(bool, (o.text_from, o.fim_from, o.prompts_from, o.self_instruct, o.file_requests))) > 1:
        raise OptionError(
            "--text-from, --fim-from, --prompts-from, --self-instruct and --file-requests cannot be combined"
        )
    roots: tuple[Path, ...] = ()
    if o.text_from or o.fim_from:
        flag = "--fim-from" if o.fim_from else "--text-from"
        asked = o.fim_from or o.text_from
        picked = [r for t in asked for r in (default_roots() if t == "auto" else [Path(t)])]
        for r in picked:
            if not r.is_dir():
                raise OptionError(f"{flag} {str(r)!r} is not a folder")
            if o.text_from and (r / "dataset.json").is_file():
                raise OptionError(f"--text-from {str(r)!r} is a dataset folder (--fim-from cuts holes in its answers)")
        roots = tuple(dict.fromkeys(picked))
    data, extra_data, corpus_data = o.data, list(o.extra_data), list(o.corpus_data)
    if resume and not o.data_only:  # the run's own data sources, unless typed now
        recorded = recorded_sources(out)
        if data is None and "data" not in o.typed and recorded.get("data"):
            data = Path(recorded["data"])
        if "extra_data" not in o.typed and recorded.get("extra_data"):
            extra_data = [Path(f) for f in recorded["extra_data"]]
        if "corpus_data" not in o.typed and recorded.get("corpus_data"):
            corpus_data = [Path(f) for f in recorded["corpus_data"]]
        if data is not None and not (data / "dataset.json").is_file():
            raise OptionError(f"--resume: the run's dataset {str(data)!r} is gone (no dataset.json); give --data")
    for flag, folder in [
        *(("--extra-data", f) for f in extra_data),
        *(("--corpus-data", f) for f in corpus_data),
        ("--prompts-from", o.prompts_from),
    ]:
        if folder is not None and not (folder / "dataset.json").is_file():
            raise OptionError(f"{flag} {str(folder)!r} is not a dataset folder (no dataset.json)")
    source = source_drafter(o.from_drafter) if o.from_drafter else None
    if source is not None and not resume:
        src_taps = tuple(json.loads((source / "config.json").read_text())["dflash_config"]["target_layer_ids"])
        if tap_ids is not None and tap_ids != src_taps:
            raise OptionError(f"--taps {list(tap_ids)} differs from --from-drafter's taps {list(src_taps)}")
        tap_ids = src_taps
    if corpus_data and corpus_grams is None and not resume:
        src_conf = json.loads((source / "config.json").read_text())["dflash_config"] if source is not None else {}
        if not src_conf.get("copy_corpus"):
            raise OptionError(
                "--corpus-data fills a corpus table: give --copy-corpus (or a --from-drafter that has one)"
            )
    if o.layers is not None and o.layers < 1:
        raise OptionError(f"--layers must be >= 1, got {o.layers}")
    if o.anchor_sampling not in ("uniform", "walk"):
        raise OptionError(f"--anchor-sampling takes uniform or walk, got {o.anchor_sampling!r}")
    spec = DrafterSpec(
        num_layers=o.layers or 1,
        block_size=o.block_size,
        taps=tap_ids,
        intermediate_size=o.intermediate_size,
        draft_vocab=vocab_choice,
        max_oov=o.max_oov,
        init=o.init,
        from_drafter=source,
        grow_to=o.layers if source is not None else None,
        copy_ngram=ngram,
        copy_corpus=corpus_grams,
    )
    return spec, data, extra_data, corpus_data, roots


def _train_config(o: TrainOptions, budget: float | None) -> TrainConfig | None:
    """The run's hyper-parameters; None where the run keeps its checkpoint's schedule (--resume
    alone) or does not train (--data-only). A resumed run keeps its own except the options typed now."""
    if o.data_only or (o.steps is None and budget is None):
        return None
    given: dict[str, Any] = {k: getattr(o, k) for k in _HYPER}
    given["eval_every"] = o.eval_every
    given["bf16"] = train_bf16(o.precision, o.device)
    if o.resume and (o.out / "checkpoint" / "config.json").exists():
        typed = {"bf16" if k == "precision" else k for k in o.typed}
        overrides = {k: v for k, v in given.items() if k in typed}
        return replace(saved_config(o.out / "checkpoint"), steps=o.steps, time_budget=budget, **overrides)
    return TrainConfig(steps=o.steps, time_budget=budget, **given)


def _eval_only(o: TrainOptions, hooks: TrainHooks) -> TrainResult:
    """Evaluate the last checkpoint of a run and export it with a fresh model card."""
    out = o.out
    ckpt = out / "checkpoint"
    if not ((ckpt / STATE_JSON).exists() or (ckpt / LEGACY_PICKLE).exists()):
        raise ConfigError(f"{ckpt} has no checkpoint to evaluate; train first")
    blob = load_trainer_state(ckpt)  # never unpickles
    pipe, session = hooks.open_pipeline(o.dtype)
    raw = read_checkpoint_config(out / "checkpoint")
    recorded = raw.get("dflash_training") or {}
    data_dir = recorded.get("dataset")
    if o.ood_eval and pipe.tokenizer is not None:  # runs trained before the OOD set (or with --no-ood-eval)
        taps = raw["dflash_config"]["target_layer_ids"]  # read_checkpoint_config checked it
        prepare_eval_data(pipe.target, pipe.tokenizer, out / "eval-data" / "ood", taps, pipe.stop_token_ids)
    evaluation = evaluate_checkpoint(
        pipe, session, out, o.eval_prompts, o.eval_tokens, hooks.say, Path(data_dir) if data_dir else None, o.ood_eval
    )
    cfg = dict(blob["config"])
    cfg["betas"] = tuple(cfg["betas"])
    assert pipe.drafter is not None  # evaluate_checkpoint loaded the checkpoint
    run = RunRecord(pipe.drafter, TrainState(**blob["state"]), TrainConfig(**cfg), out)
    card = model_card(pipe, run, evaluation, o.argv, data_dir=data_dir)
    return TrainResult(export(out, evaluation, card), exported=True)


def train_dtype(dtype: str, device: str) -> str:
    """--dtype for building data and training: auto stays float32 on CPUs that emulate bf16 matmuls
    (the batched forward of data generation runs transformers' GEMMs, not the decode kernels that
    make bf16 the faster choice for decoding there)."""
    if dtype != "auto":
        return dtype
    return dtype if resolve_device(device).type != "cpu" or cpu_has_fast_bf16() else "float32"


def train_bf16(precision: str, device: str) -> bool:
    """--train-precision: bf16 autocast where bf16 matmuls are native; float32 where they are
    emulated (a CPU without AVX512-BF16/AMX runs bf16 GEMMs several times slower than float32)."""
    if precision != "auto":
        return precision == "bf16"
    dev = resolve_device(device)
    if dev.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    return dev.type == "cpu" and cpu_has_fast_bf16()


def source_drafter(text: str) -> Path:
    """--from-drafter: a drafter folder, or 'embedded' for the drafter shipped in the package."""
    if text.strip().lower() == "embedded":
        return embedded_drafter_dir()
    path = Path(text).expanduser()
    if not (path / "config.json").is_file():
        raise OptionError(f"--from-drafter {text!r} is not a drafter folder (no config.json)")
    try:
        json.loads((path / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    except (ValueError, KeyError, TypeError) as e:
        raise OptionError(f"--from-drafter {text!r}: config.json is not a DFlash drafter config ({e})") from e
    return path
