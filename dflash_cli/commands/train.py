"""`dflash train`: distil a DFlash drafter for a target (data -> fit -> evaluate -> export)."""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..common import (
    DeviceOpt,
    DtypeChoice,
    DtypeOpt,
    ModelOpt,
    OfflineOpt,
    TargetOpt,
    ThreadsOpt,
    open_pipeline,
    parse_ids,
    session_options,
)
from ..errors import handle_errors

if TYPE_CHECKING:
    from runtime import Pipeline
    from runtime.session import SessionOptions


def _duration(text: str | None) -> float | None:
    """'90s', '45m', '2h', '1h30m' or plain seconds -> seconds."""
    if text is None:
        return None
    import re

    total, rest = 0.0, text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", rest):
        return float(rest)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", rest)
    if not parts or "".join(n + u for n, u in parts) != rest.replace(" ", ""):
        raise typer.BadParameter(f"expected a duration like 90s, 45m, 2h or 1h30m, got {text!r}")
    for n, unit in parts:
        total += float(n) * {"h": 3600, "m": 60, "s": 1}[unit]
    return total


@handle_errors
def train(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option("--out", "-o", help="Run folder (data/, checkpoint/, drafter/).")],
    model: ModelOpt = None,
    target: TargetOpt = None,
    data: Annotated[
        Path | None, typer.Option("--data", help="Dataset folder (default: OUT/data); reused if present.")
    ] = None,
    extra_data: Annotated[
        list[Path] | None,
        typer.Option(
            "--extra-data",
            help="Another dataset folder to train on as well (repeatable; same taps; its last shard is "
            "held out with --data's; a --text-from dataset is trained on whole).",
        ),
    ] = None,
    corpus_data: Annotated[
        list[Path] | None,
        typer.Option(
            "--corpus-data",
            help="Another dataset folder counted into the corpus table (--copy-corpus) but not trained on "
            "(repeatable; every shard; a --text-from dataset counts the target's own choice after the text).",
        ),
    ] = None,
    prompts: Annotated[
        int | None, typer.Option("--prompts", help="Prompts to answer for the dataset (default: all).")
    ] = None,
    prompts_from: Annotated[
        Path | None,
        typer.Option(
            "--prompts-from",
            help="Build a new dataset's prompts on the code of this earlier dataset's answers (edits, "
            "tests, ports, explanations and follow-ups in every language; generator 'answers').",
        ),
    ] = None,
    text_from: Annotated[
        list[str] | None,
        typer.Option(
            "--text-from",
            help="Build a teacher-forced text dataset instead: chunks of the source files under this folder "
            "('auto': the standard library, site-packages and the system's JS/C/shell/SQL sources; repeatable), "
            "scored by the target in one forward pass each, no generation (generator 'text'; "
            "--answer-tokens caps a chunk, --gen-batch sets chunks per shard).",
        ),
    ] = None,
    self_instruct: Annotated[
        bool,
        typer.Option(
            "--self-instruct",
            help="Build a new dataset on requests the target writes itself (sampled from a few-shot page of "
            "example requests: every language x kind of request, varied topics), then answers greedily "
            "(generator 'self').",
        ),
    ] = False,
    answer_tokens: Annotated[int, typer.Option("--answer-tokens", help="Max tokens per generated answer.")] = 320,
    gen_batch: Annotated[int, typer.Option("--gen-batch", help="Answers generated together.")] = 32,
    data_seed: Annotated[
        int,
        typer.Option(
            "--data-seed",
            help="Prompt sampling seed of a new dataset: another seed draws other prompts from the same "
            "sources (an existing dataset keeps its own).",
        ),
    ] = 0,
    layers: Annotated[
        int | None,
        typer.Option(
            "--layers",
            help="Drafter decoder layers (default 1; with --from-drafter, more than its own appends new "
            "layers that start as the identity).",
        ),
    ] = None,
    block_size: Annotated[int, typer.Option("--block-size", "-b", help="Drafter block size.")] = 8,
    taps: Annotated[str | None, typer.Option("--taps", help="Target layers to tap, e.g. 1,6,11,16,21.")] = None,
    intermediate_size: Annotated[int | None, typer.Option("--intermediate-size", help="Drafter MLP width.")] = None,
    draft_vocab: Annotated[
        str,
        typer.Option(
            "--draft-vocab",
            help="Draft vocabulary: auto (smallest N with <= --max-oov of held-out answer tokens outside), N, or full.",
        ),
    ] = "auto",
    max_oov: Annotated[float, typer.Option("--max-oov", help="OOV share --draft-vocab auto aims for.")] = 0.01,
    distill: Annotated[
        str, typer.Option("--distill", help="hard: greedy labels; soft: plus the target's top-k distribution.")
    ] = "hard",
    soft_weight: Annotated[float, typer.Option("--soft-weight", help="Share of the soft term (--distill soft).")] = 0.5,
    topk: Annotated[
        int, typer.Option("--topk", help="Target log-probabilities kept per answer token in new datasets (0: none).")
    ] = 8,
    init: Annotated[
        str, typer.Option("--init", help="random, or target: copy the target's last layer(s) where shapes allow.")
    ] = "random",
    from_drafter: Annotated[
        str | None,
        typer.Option(
            "--from-drafter",
            help="Start from an existing drafter (a folder, or 'embedded' for the shipped one) and fine-tune it "
            "on this run's data; it keeps its architecture; the draft vocabulary is chosen anew, its own ids first.",
        ),
    ] = None,
    copy_inputs: Annotated[
        bool,
        typer.Option(
            "--copy-inputs",
            help="Give the drafter copy inputs: each slot also sees the token a 1-4-gram lookup into the "
            "context proposes for it, and that token's draft logit gets a learnt bias (a pointer; scored from the "
            "full head when outside the draft vocabulary). Zero-initialised: a --from-drafter drafts as before "
            "until trained.",
        ),
    ] = False,
    copy_ngram: Annotated[
        str | None,
        typer.Option(
            "--copy-ngram",
            help="Shortest,longest context n-gram the copy inputs match (default 1,4; longer matches are tried "
            "first and get their own learnt weights). Implies --copy-inputs.",
        ),
    ] = None,
    copy_corpus: Annotated[
        str | None,
        typer.Option(
            "--copy-corpus",
            help="Shortest,longest n-gram (e.g. 2,4) of a corpus table counted over the training answers: where "
            "the context has no 2-token match, the copy inputs show what the target most often wrote after the "
            "last tokens, with their own learnt weights per size and confidence. Needs copy inputs; shipped next "
            "to the weights (corpus.safetensors).",
        ),
    ] = None,
    eval_every: Annotated[
        int, typer.Option("--eval-every", help="Steps between held-out evaluations (OUT/eval.jsonl).")
    ] = 200,
    ood_eval: Annotated[
        bool, typer.Option("--ood-eval/--no-ood-eval", help="Evaluate on the hand-written OOD set too.")
    ] = True,
    steps: Annotated[int | None, typer.Option("--steps", help="Optimiser steps.")] = None,
    time_budget: Annotated[str | None, typer.Option("--time-budget", help="Wall-clock budget, e.g. 45m, 2h.")] = None,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate.")] = 1e-3,
    copy_lr: Annotated[
        float | None,
        typer.Option(
            "--copy-lr",
            help="Peak learning rate of the copy inputs (default 100 x --lr); with a low --lr they learn while "
            "the drafter's layers move little.",
        ),
    ] = None,
    anchors: Annotated[int, typer.Option("--anchors", help="Blocks per sequence per step.")] = 48,
    anchor_sampling: Annotated[
        str,
        typer.Option(
            "--anchor-sampling",
            help="uniform: blocks anchored anywhere in the answer; walk: a window of --anchors consecutive "
            "anchors per sequence, trained only where the chain decoder would anchor with the drafter as it is.",
        ),
    ] = "uniform",
    seqs_per_step: Annotated[int, typer.Option("--seqs-per-step", help="Sequences per step.")] = 2,
    max_len: Annotated[int, typer.Option("--max-len", help="Tokens per training sequence.")] = 640,
    precision: Annotated[
        str,
        typer.Option(
            "--train-precision",
            help="auto (bf16 autocast on GPUs and CPUs with native bf16, float32 on others), bf16 or fp32.",
        ),
    ] = "auto",
    resume: Annotated[
        bool,
        typer.Option(
            "--resume", help="Continue OUT/checkpoint with its recorded settings (flags given now override them)."
        ),
    ] = False,
    extend: Annotated[
        bool, typer.Option("--extend", help="With --resume: a new warm-up + cosine segment (continue a finished run).")
    ] = False,
    data_only: Annotated[bool, typer.Option("--data-only", help="Only build the dataset.")] = False,
    eval_only: Annotated[
        bool, typer.Option("--eval-only", help="Evaluate OUT/checkpoint and export it again; no training.")
    ] = False,
    eval_prompts: Annotated[
        int, typer.Option("--eval-prompts", help="Prompts per evaluation set (in-distribution and OOD).")
    ] = 8,
    eval_tokens: Annotated[int, typer.Option("--eval-tokens", help="Tokens per evaluation generation.")] = 96,
    no_eval: Annotated[bool, typer.Option("--no-eval", help="Skip the final evaluation.")] = False,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = DtypeChoice.auto,
    threads: ThreadsOpt = None,
    offline: OfflineOpt = False,
) -> None:
    """Train a DFlash drafter for a target on its own answers to coding prompts.

    The drafter is saved in the published DFlash layout (config.json + model.safetensors) with a
    model card, so `dflash run --drafter OUT/drafter` and other engines load it.
    """
    from runtime.train.api import (
        COPY_NGRAM,
        DataSpec,
        DrafterSpec,
        data_report,
        export,
        fit,
        prepare_data,
        prepare_eval_data,
        saved_config,
    )
    from runtime.train.lock import RunFolderLock
    from runtime.train.state import read_checkpoint_config
    from runtime.train.trainer import TrainConfig

    budget = _duration(time_budget)
    ctx.with_resource(RunFolderLock(out))  # one command per run folder, held until this one ends
    if (resume or eval_only) and (out / "checkpoint" / "config.json").exists():
        read_checkpoint_config(out / "checkpoint")  # a damaged one stops here, before anything is written
    if eval_only:
        return _eval_only(out, model, target, device, dtype, offline, threads, eval_prompts, eval_tokens, ood_eval)
    vocab_choice = _draft_vocab(draft_vocab)
    if distill not in ("hard", "soft"):
        raise typer.BadParameter(f"--distill must be hard or soft, got {distill!r}")
    ngram = _ngram_sizes(copy_ngram) if copy_ngram is not None else COPY_NGRAM if copy_inputs else None
    corpus_grams = _ngram_sizes(copy_corpus, "--copy-corpus") if copy_corpus is not None else None
    if init not in ("random", "target"):
        raise typer.BadParameter(f"--init must be random or target, got {init!r}")
    if precision not in ("auto", "bf16", "fp32"):
        raise typer.BadParameter(f"--train-precision must be auto, bf16 or fp32, got {precision!r}")
    if not data_only and not resume and steps is None and budget is None:
        raise typer.BadParameter("give --steps or --time-budget (or --data-only)")
    tap_ids = tuple(parse_ids(taps)) if taps else None
    if sum(map(bool, (text_from, prompts_from, self_instruct))) > 1:
        raise typer.BadParameter("--text-from, --prompts-from and --self-instruct cannot be combined")
    roots: tuple[Path, ...] = ()
    if text_from:
        from runtime.train.text import default_roots

        picked = [r for t in text_from for r in (default_roots() if t == "auto" else [Path(t)])]
        for r in picked:
            if not r.is_dir():
                raise typer.BadParameter(f"--text-from {str(r)!r} is not a folder")
        roots = tuple(dict.fromkeys(picked))
    if resume and not data_only:  # the run's own data sources, unless typed now
        recorded = _recorded_sources(out)
        if data is None and not _typed(ctx, "data") and recorded.get("data"):
            data = Path(recorded["data"])
        if not _typed(ctx, "extra_data") and recorded.get("extra_data"):
            extra_data = [Path(f) for f in recorded["extra_data"]]
        if not _typed(ctx, "corpus_data") and recorded.get("corpus_data"):
            corpus_data = [Path(f) for f in recorded["corpus_data"]]
        if data is not None and not (data / "dataset.json").is_file():
            raise typer.BadParameter(f"--resume: the run's dataset {str(data)!r} is gone (no dataset.json); give --data")
    for flag, folder in [
        *(("--extra-data", f) for f in extra_data or []),
        *(("--corpus-data", f) for f in corpus_data or []),
        ("--prompts-from", prompts_from),
    ]:
        if folder is not None and not (folder / "dataset.json").is_file():
            raise typer.BadParameter(f"{flag} {str(folder)!r} is not a dataset folder (no dataset.json)")
    source = _source_drafter(from_drafter) if from_drafter else None
    if source is not None and not resume:
        src_taps = tuple(json.loads((source / "config.json").read_text())["dflash_config"]["target_layer_ids"])
        if tap_ids is not None and tap_ids != src_taps:
            raise typer.BadParameter(f"--taps {list(tap_ids)} differs from --from-drafter's taps {list(src_taps)}")
        tap_ids = src_taps
    if corpus_data and corpus_grams is None and not resume:
        src_conf = json.loads((source / "config.json").read_text())["dflash_config"] if source is not None else {}
        if not src_conf.get("copy_corpus"):
            raise typer.BadParameter(
                "--corpus-data fills a corpus table: give --copy-corpus (or a --from-drafter that has one)"
            )
    if layers is not None and layers < 1:
        raise typer.BadParameter(f"--layers must be >= 1, got {layers}")
    if anchor_sampling not in ("uniform", "walk"):
        raise typer.BadParameter(f"--anchor-sampling takes uniform or walk, got {anchor_sampling!r}")
    spec = DrafterSpec(
        num_layers=layers or 1,
        block_size=block_size,
        taps=tap_ids,
        intermediate_size=intermediate_size,
        draft_vocab=vocab_choice,
        max_oov=max_oov,
        init=init,
        from_drafter=source,
        grow_to=layers if source is not None else None,
        copy_ngram=ngram,
        copy_corpus=corpus_grams,
    )
    cfg = None
    if not data_only and (steps is not None or budget is not None):  # --resume alone keeps the run's schedule
        given: dict[str, Any] = {
            "lr": lr,
            "copy_lr": copy_lr,
            "anchors": anchors,
            "anchor_sampling": anchor_sampling,
            "seqs_per_step": seqs_per_step,
            "max_len": max_len,
            "distill": distill,
            "soft_weight": soft_weight,
            "eval_every": eval_every,
            "bf16": _train_bf16(precision, device),
        }
        if resume and (out / "checkpoint" / "config.json").exists():
            # a resumed run keeps its own hyper-parameters; only the flags typed now change them
            typed = {"bf16" if k == "precision" else k for k in ctx.params if _typed(ctx, k)}
            overrides = {k: v for k, v in given.items() if k in typed}
            cfg = replace(saved_config(out / "checkpoint"), steps=steps, time_budget=budget, **overrides)
        else:
            cfg = TrainConfig(steps=steps, time_budget=budget, **given)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = data or out / "data"
    session = session_options(model, target, "none", device, _train_dtype(dtype, device), offline, threads=threads)
    pipe = open_pipeline(session)
    if pipe.tokenizer is None:
        raise typer.BadParameter("the target has no tokenizer; dflash train needs one to build prompts")
    _record_command(out, sys.argv)  # only invocations that got as far as building data or training
    say = _printer()
    from runtime.engine.models.drafter_config import default_target_layer_ids

    data_taps = tap_ids or tuple(default_target_layer_ids(pipe.target.num_layers, layers or 1))
    if resume and (out / "checkpoint" / "config.json").exists():
        raw = read_checkpoint_config(out / "checkpoint")
        data_taps = tuple(raw["dflash_config"]["target_layer_ids"])
    if not data_only:
        _record_sources(out, data_dir, extra_data or [], corpus_data or [])
    say(f"dataset {data_dir} (taps {list(data_taps)})")
    prepare_data(
        pipe.target,
        pipe.tokenizer,
        data_dir,
        data_taps,
        DataSpec(
            num_prompts=prompts,
            max_new_tokens=answer_tokens,
            batch_size=gen_batch,
            seed=data_seed,
            topk=topk,
            generator="answers" if prompts_from else "text" if roots else "self" if self_instruct else "v2",
            source=prompts_from,
            text_roots=roots,
        ),
        pipe.stop_token_ids,
        progress=lambda p: say(
            f"  requests written {p['requests_sampled']}/{p['of']} ({p['requests_kept']} kept)"
            if "requests_sampled" in p
            else f"  shard {p['shard'] + 1}/{p['shards']}: {p['tokens']} tokens this run, {p['seconds']:.0f}s"
        ),
    )
    report = data_report(data_dir)
    (out / DATA_REPORT).write_text(json.dumps(report, indent=2))
    for line in _mix_lines(report):
        say(line)
    if data_only:
        print(data_dir)
        return
    eval_sets = {}
    if ood_eval:
        say("OOD evaluation set: the target's answers to the hand-written OOD prompts")
        eval_sets["ood"] = prepare_eval_data(
            pipe.target,
            pipe.tokenizer,
            out / "eval-data" / "ood",
            data_taps,
            pipe.stop_token_ids,
            max_new_tokens=answer_tokens,
            topk=topk,
        )
    trainer = fit(
        pipe.target,
        pipe.tokenizer,
        data_dir,
        out,
        spec,
        cfg,
        resume=resume,
        extend=extend,
        device=pipe.device,
        progress=_train_progress(say, None if resume else out),
        eval_sets=eval_sets,
        extra_data=extra_data or [],
        corpus_data=corpus_data or [],
    )
    evaluation = None
    if not no_eval and eval_prompts > 0:
        evaluation = _evaluate(pipe, session, out, eval_prompts, eval_tokens, say, data_dir, ood_eval)
    card = model_card(pipe, trainer, evaluation, sys.argv, data_dir=data_dir)
    path = export(out, evaluation, card)
    say(f"drafter saved to {path}")
    print(path)


def _typed(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` was given on the command line (not its default)."""
    source = ctx.get_parameter_source(name)  # an enum of typer's own click: compared by name
    return getattr(source, "name", None) in ("COMMANDLINE", "ENVIRONMENT")


def _train_dtype(dtype: Any, device: str) -> Any:
    """--dtype for building data and training: auto stays float32 on CPUs that emulate bf16 matmuls
    (the batched forward of data generation runs transformers' GEMMs, not the decode kernels that
    make bf16 the faster choice for decoding there)."""
    if getattr(dtype, "value", dtype) != "auto":
        return dtype
    from runtime.engine.models.device import cpu_has_fast_bf16, resolve_device

    return dtype if resolve_device(device).type != "cpu" or cpu_has_fast_bf16() else "float32"


def _train_bf16(precision: str, device: str) -> bool:
    """--train-precision: bf16 autocast where bf16 matmuls are native; float32 where they are
    emulated (a CPU without AVX512-BF16/AMX runs bf16 GEMMs several times slower than float32)."""
    if precision != "auto":
        return precision == "bf16"
    from runtime.engine.models.device import cpu_has_fast_bf16, resolve_device

    dev = resolve_device(device)
    if dev.type == "cuda":
        import torch

        return bool(torch.cuda.is_bf16_supported())
    return dev.type == "cpu" and cpu_has_fast_bf16()


def _source_drafter(text: str) -> Path:
    """--from-drafter: a drafter folder, or 'embedded' for the drafter shipped in the package."""
    if text.strip().lower() == "embedded":
        from runtime.models.embedded import embedded_drafter_dir

        return embedded_drafter_dir()
    path = Path(text).expanduser()
    if not (path / "config.json").is_file():
        raise typer.BadParameter(f"--from-drafter {text!r} is not a drafter folder (no config.json)")
    try:
        json.loads((path / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    except (ValueError, KeyError, TypeError) as e:
        raise typer.BadParameter(f"--from-drafter {text!r}: config.json is not a DFlash drafter config ({e})") from e
    return path


def _init_line(init: dict[str, Any]) -> str:
    """The model card's initialisation line."""
    kind, rep = init.get("kind", "random"), init.get("report") or {}
    if kind == "drafter" and rep:
        return (
            f"fine-tuned from the drafter `{rep.get('source')}` ({rep.get('source_steps')} steps, "
            f"{rep.get('source_train_seconds')} s of earlier training, draft vocabulary "
            f"{rep.get('source_draft_vocab')} ids before this run"
            + (
                f"; grown from {rep['grown_from_layers']} to {rep['grown_from_layers'] + rep['added_layers']} layers, "
                "the new ones starting as the identity)"
                if rep.get("added_layers")
                else ")"
            )
        )
    if rep and "source_layers" in rep:
        return (
            f"{kind} (target layers {rep['source_layers']}; {len(rep['copied'])} tensors copied, "
            f"{len(rep['pruned'])} MLP pruned, {len(rep['skipped'])} skipped)"
        )
    return str(kind)


def _draft_vocab(text: str) -> int | str:
    """--draft-vocab: auto, full (or 0) or a size."""
    t = text.strip().lower()
    if t in ("auto", "full"):
        return t if t == "auto" else 0
    if t.isdigit():
        return int(t)
    raise typer.BadParameter(f"--draft-vocab must be auto, full or a number of ids, got {text!r}")


def _eval_only(
    out: Path,
    model: str | None,
    target: str | None,
    device: str,
    dtype: DtypeChoice,
    offline: bool,
    threads: int | None,
    eval_prompts: int,
    eval_tokens: int,
    ood_eval: bool = True,
) -> None:
    """Evaluate the last checkpoint of a run and export it with a fresh model card."""
    from runtime.errors import ConfigError
    from runtime.train.api import export
    from runtime.train.state import LEGACY_PICKLE, STATE_JSON, load_trainer_state, read_checkpoint_config
    from runtime.train.trainer import TrainConfig, TrainState

    ckpt = out / "checkpoint"
    if not ((ckpt / STATE_JSON).exists() or (ckpt / LEGACY_PICKLE).exists()):
        raise ConfigError(f"{ckpt} has no checkpoint to evaluate; train first")
    blob = load_trainer_state(ckpt)  # never unpickles
    session = session_options(model, target, "none", device, dtype, offline, threads=threads)
    pipe = open_pipeline(session)
    say = _printer()
    raw = read_checkpoint_config(out / "checkpoint")
    recorded = raw.get("dflash_training") or {}
    data_dir = recorded.get("dataset")
    if ood_eval and pipe.tokenizer is not None:  # runs trained before the OOD set (or with --no-ood-eval)
        from runtime.train.api import prepare_eval_data

        taps = raw["dflash_config"]["target_layer_ids"]  # read_checkpoint_config checked it
        prepare_eval_data(pipe.target, pipe.tokenizer, out / "eval-data" / "ood", taps, pipe.stop_token_ids)
    evaluation = _evaluate(
        pipe, session, out, eval_prompts, eval_tokens, say, Path(data_dir) if data_dir else None, ood_eval
    )
    cfg = dict(blob["config"])
    cfg["betas"] = tuple(cfg["betas"])
    assert pipe.drafter is not None  # _evaluate loaded the checkpoint
    run = _RunRecord(pipe.drafter, TrainState(**blob["state"]), TrainConfig(**cfg), out)
    card = model_card(pipe, run, evaluation, sys.argv, data_dir=data_dir)
    path = export(out, evaluation, card)
    say(f"drafter saved to {path}")
    print(path)


class _RunRecord:
    """What the model card reads of a trainer, rebuilt from a checkpoint."""

    def __init__(self, drafter: Any, state: Any, cfg: Any, out_dir: Path) -> None:
        self.drafter, self.state, self.cfg, self.out_dir = drafter, state, cfg, out_dir


COMMANDS_FILE = "commands.txt"
DATA_REPORT = "data-report.json"
DATA_SOURCES = "data-sources.json"


def _mix_lines(report: dict[str, Any]) -> list[str]:
    """Dataset size and mix, one line per prompt kind."""
    if report.get("labels") == "teacher-forced":
        lines = [
            f"dataset: {report['sequences']} text chunks in {report['shards']} shards, {report['answer_tokens']} "
            f"scored tokens (+ {report['prompt_tokens']} context tokens), generator text; labels: the target's "
            f"argmax on the real text (top-{report['topk']} log-probabilities), the text agrees with it at "
            f"{report.get('target_agreement', 0):.1%} of the tokens"
        ]
    else:
        lines = [
            f"dataset: {report['sequences']} answered prompts in {report['shards']} shards, "
            f"{report['answer_tokens']} answer tokens (+ {report['prompt_tokens']} prompt tokens), generator "
            f"{report.get('generator', 'v1')}, soft labels: "
            + (f"top-{report['topk']} log-probabilities" if report.get("topk") else "none (hard labels only)")
        ]
    total = max(report["sequences"], 1)
    for kind, row in report.get("mix", {}).items():
        lines.append(
            f"  {kind:<18} {row['sequences']:>7} prompts ({row['sequences'] / total:6.1%}) "
            f"{row['answer_tokens']:>9} answer tokens"
        )
    return lines


def _vocab_lines(out: Path) -> list[str]:
    """The draft vocabulary coverage report (OUT/vocab-coverage.json) as text."""
    path = out / "vocab-coverage.json"
    if not path.exists():
        return []
    rep = json.loads(path.read_text())
    ch = rep["chosen"]
    lines = [
        f"draft vocabulary: {'full' if ch['full'] else ch['n']} ids ({ch['rule']}); held-out OOV share "
        f"{ch['oov_share']:.2%} over {rep['heldout_answer_tokens']} held-out answer tokens",
        "  N ids    OOV share  head MFLOP/slot  head share of drafter compute",
    ]
    for r in rep["rows"]:
        lines.append(f"  {r['n']:>7}  {r['oov_share']:9.2%}  {r['head_mflops_per_slot']:15.1f}  {r['head_share']:.0%}")
    return lines


def _dataset_lines(data_dir: Path | str | None) -> list[str]:
    """The dataset's size and mix for the model card."""
    from runtime.train.api import data_report

    if not data_dir or not Path(data_dir).is_dir():
        return []
    s = data_report(Path(data_dir))
    if s.get("labels") == "teacher-forced":
        lines = [
            "",
            f"Dataset: {s['sequences']} chunks of real source files in {s['shards']} shards, {s['answer_tokens']} "
            f"scored tokens (+ {s['prompt_tokens']} context tokens), no generation (generator text, "
            "`runtime/train/text.py`): labels are the target's argmax on the text, slot k only while the text "
            f"follows the target (it does at {s.get('target_agreement', 0):.1%} of the tokens); trained on whole, "
            "never part of the held-out sets.",
        ]
    else:
        lines = [
            "",
            f"Dataset: {s['sequences']} answered prompts in {s['shards']} shards, {s['answer_tokens']} answer tokens "
            f"(+ {s['prompt_tokens']} prompt tokens); anchors are drawn from the answers. Prompt generator "
            f"{s['generator']}; soft labels: " + (f"top-{s['topk']} log-probabilities." if s["topk"] else "none."),
        ]
    if s.get("mix"):
        lines += ["", "| kind | prompts | answer tokens |", "|---|---|---|"]
        lines += [f"| {k} | {r['sequences']} | {r['answer_tokens']} |" for k, r in s["mix"].items()]
    return lines


def _portable_arg(arg: str, base: Path) -> str:
    """An absolute path in a recorded command, made relative to the run folder's parent (else its
    last two parts), so that no machine-specific path reaches a shipped model card."""
    if not arg.startswith("/"):
        return arg
    p = Path(arg)
    try:
        return str(p.resolve().relative_to(base.resolve().parent)) or "."
    except ValueError:
        return str(Path(*p.parts[-2:]))


def _recorded_out(cmds: list[str]) -> str | None:
    """The run folder as the last recorded command names it (``--out X``, ``-o X`` or ``--out=X``), so that
    the card's continue line runs from the same folder as the commands above it."""
    for c in reversed(cmds):
        args = shlex.split(c)
        for i, a in enumerate(args):
            if a in ("--out", "-o") and i + 1 < len(args):
                return args[i + 1]
            if a.startswith("--out="):
                return a.split("=", 1)[1]
    return None


def _command_line(argv: list[str]) -> str:
    return "dflash " + " ".join(shlex.quote(a) for a in argv[1:])


def _record_sources(out: Path, data: Path, extra: Sequence[Path], corpus: Sequence[Path]) -> None:
    """Keep the run's dataset folders (absolute) in OUT/data-sources.json, for --resume."""
    doc = {
        "data": str(data.resolve()),
        "extra_data": [str(f.resolve()) for f in extra],
        "corpus_data": [str(f.resolve()) for f in corpus],
    }
    (out / DATA_SOURCES).write_text(json.dumps(doc, indent=2) + "\n")


def _recorded_sources(out: Path) -> dict[str, Any]:
    """The dataset folders a run trained on: OUT/data-sources.json, or for runs older than that
    file the last training command in OUT/commands.txt (its relative paths taken from here)."""
    path = out / DATA_SOURCES
    if path.exists():
        return _read_sources(path)
    lines = (out / COMMANDS_FILE).read_text().splitlines() if (out / COMMANDS_FILE).is_file() else []
    for line in reversed(lines):
        args = shlex.split(line)
        if "--resume" in args or "--eval-only" in args or "--data-only" in args:
            continue
        found: dict[str, Any] = {"extra_data": [], "corpus_data": []}
        for flag, value in zip(args, args[1:], strict=False):
            if flag == "--data":
                found["data"] = value
            elif flag in ("--extra-data", "--corpus-data"):
                found[flag[2:].replace("-", "_")].append(value)
        return found
    return {}


def _read_sources(path: Path) -> dict[str, Any]:
    """OUT/data-sources.json as ``_record_sources`` wrote it.

    Raises:
        ModelLoadError: the file is not JSON, not an object, or a field has another type (names the file).
    """
    from runtime.errors import ModelLoadError

    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(f"{path} is damaged (not readable JSON: {e}); fix or delete it, or give --data") from None
    if not isinstance(doc, dict):
        raise ModelLoadError(f"{path} is damaged: a JSON object was expected, not {type(doc).__name__}")
    data = doc.get("data")
    if data is not None and not (isinstance(data, str) and data):
        raise ModelLoadError(f"{path} is damaged: 'data' must be a folder name, got {data!r}")
    for key in ("extra_data", "corpus_data"):
        value = doc.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ModelLoadError(f"{path} is damaged: {key!r} must be a list of folder names, got {value!r}")
    return dict(doc)


def _record_command(out: Path, argv: list[str]) -> None:
    """Append this invocation to OUT/commands.txt, which the model card quotes (training and
    evaluation may span several runs: --resume, --extend, --eval-only)."""
    with (out / COMMANDS_FILE).open("a") as f:
        f.write(_command_line(argv) + "\n")


def _printer() -> Any:
    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    return say


def _train_progress(say: Any, out: Path | None = None) -> Any:
    state = {"last": 0.0, "vocab_shown": out is None}

    def show(info: dict[str, Any]) -> None:
        import time

        if not state["vocab_shown"] and out is not None:  # fit() wrote it before the first step
            state["vocab_shown"] = True
            for line in _vocab_lines(out):
                say(line)
        now = time.monotonic()
        if "val" in info or now - state["last"] > 10:
            state["last"] = now
            acc = " ".join(f"{a:.2f}" for a in info["slot_acc"])
            line = (
                f"step {info['step']:>6} | {info['progress'] * 100:5.1f}% | loss {info['loss']:.3f} | lr {info['lr']:.2e}"
                f" | slot acc {acc} | {info['slots_per_s']:.0f} slots/s"
            )
            if "val" in info and info["val"]:
                v = info["val"]
                line += f" | val loss {v['val_loss']:.3f} tau_tf {v['tau_tf']:.2f} (K=3: {v['tau_tf_k3']:.2f})"
                if "tau_walk" in v:
                    line += f" walk {v['tau_walk']:.2f}"
            for name, m in (info.get("evals") or {}).items():
                if m:
                    line += f" | {name} tau_tf {m['tau_tf']:.2f} top1@1 {m['topk_coverage']['top1'][0]:.2f}"
                    if "tau_walk" in m:
                        line += f" walk {m['tau_walk']:.2f}"
            say(line)

    return show


def _in_distribution_prompts(data_dir: Path | None, n: int) -> tuple[str, list[Any]]:
    """Prompts of the dataset's held-out (validation) shard, never trained on; the hand-written
    held-out list when the dataset is not on this machine."""
    from runtime.train.evaluate import IdPrompt
    from runtime.train.heldout import HELDOUT

    shards = sorted(Path(data_dir).glob("shard-*.safetensors")) if data_dir and Path(data_dir).is_dir() else []
    if len(shards) < 2:
        return "held-out prompts (hand-written, runtime/train/heldout.py)", list(HELDOUT[:n])
    from runtime.train.data import load_shard

    shard = load_shard(shards[-1])
    out = []
    for j in range(min(n, shard.num_sequences)):
        a = int(shard.offsets[j])
        ids = tuple(shard.tokens[a : a + int(shard.prompt_len[j])].tolist())
        src = shard.sources[j] if j < len(shard.sources) else "heldout-shard"
        out.append(IdPrompt(ids, not src.startswith(("stdlib-raw", "raw-file")), src))
    return "the generator's prompts in the dataset's held-out shard (never trained on)", out


def _teacher_forced(pipe: Any, out: Path, sets: dict[str, Path | None]) -> dict[str, Any]:
    """Top-k coverage per slot, OOV share and teacher-forced tau of the checkpoint on datasets of
    target answers (the validation shard, the OOD answers)."""
    from runtime.engine.models.drafter_io import load_draft_model
    from runtime.errors import ConfigError
    from runtime.train.api import frozen_weights, open_datasets, open_eval_set
    from runtime.train.trainer import TrainConfig, Trainer

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
        cfg = TrainConfig(steps=1, bf16=pipe.dtype != __import__("torch").float32)
        tr = Trainer(drafter, embed, head, data, data, cfg, out, "cpu")
        res[name] = tr.validate(max_seqs=64, dataset=data, name=name)
    return res


def _evaluate(
    pipe: Pipeline,
    session: SessionOptions,
    out: Path,
    n: int,
    tokens: int,
    say: Any,
    data_dir: Path | None = None,
    ood: bool = True,
) -> dict[str, Any]:
    """Real-decoder evaluation on the in-distribution and OOD sets, side by side, plus the
    teacher-forced top-k coverage and OOV share on the target's answers to both."""
    import torch

    from runtime.engine.models.drafter_io import load_draft_model
    from runtime.session import calibrate
    from runtime.train.evaluate import EvalResult, evaluate
    from runtime.train.heldout import ood_prompts

    pipe.drafter = load_draft_model(out / "checkpoint", pipe.device, pipe.dtype)
    pipe.target.set_taps(pipe.drafter.dflash.target_layer_ids)
    if session.calibration_file is not None:  # the verify length comes from this machine's costs, as in `dflash run`
        calibrate(pipe, session.calibration_file, say)
    what, in_dist = _in_distribution_prompts(data_dir, n)
    sets = {"in_distribution": (what, in_dist)}
    if ood:
        sets["ood"] = ("hand-written OOD chat requests (runtime/assets/prompts/ood-chat.jsonl)", ood_prompts()[:n])
    results, summary = {}, {}
    from runtime.train.evaluate import encode

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
    tf = _teacher_forced(pipe, out, {"in_distribution": data_dir, "ood": out / "eval-data" / "ood"})
    for name, m in tf.items():
        say(f"{name} teacher-forced: " + json.dumps(m))
    return {**pooled, "sets": summary, "teacher_forced": tf}


def _side_by_side(pipe: Any, evaluation: dict[str, Any]) -> list[str]:
    sets = evaluation.get("sets") or {}
    tf = evaluation.get("teacher_forced") or {}
    names = [n for n in ("in_distribution", "ood") if n in sets or n in tf]
    if not names:
        return []
    dtype = str(pipe.dtype).removeprefix("torch.")
    lines = [
        f"Real decoder, greedy, device {pipe.device}, dtype {dtype}, verify length chosen by the runtime:",
        "",
        "| | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]

    def row(label: str, get: Any) -> str:
        vals = []
        for n in names:
            try:
                vals.append(str(get(n)))
            except (KeyError, TypeError, IndexError):
                vals.append("-")
        return f"| {label} | " + " | ".join(vals) + " |"

    lines += [
        row("prompts", lambda n: sets[n]["prompts"]),
        row("pooled tau", lambda n: sets[n]["pooled_tau"]),
        row("median tau (whole block)", lambda n: f"{sets[n]['median_tau']} ({sets[n]['median_tau_full_block']})"),
        row("median speed-up", lambda n: f"{sets[n]['median_speedup']}x"),
        row("plain -> DFlash tok/s", lambda n: f"{sets[n]['median_ar_tok_s']} -> {sets[n]['median_dflash_tok_s']}"),
        row("identical to plain greedy", lambda n: sets[n]["identical_to_plain"]),
        row("target tokens outside the draft vocab", lambda n: f"{sets[n]['oov_share']:.1%}"),
    ]
    if tf:
        lines += [
            "",
            "Teacher-forced on the target's own answers to the same kinds of prompts: share of positions where the",
            "target's token is the drafter's top-1/2/4/8 at slots 1, 2, 3, and the share outside the draft vocabulary.",
            "",
            "| | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
            row("tau_tf (whole block)", lambda n: tf[n]["tau_tf"]),
        ]
        if all("tau_walk" in tf[n] for n in names):
            lines.append(row("tau_walk (whole block, as the decoder walks)", lambda n: tf[n]["tau_walk"]))
        for k in range(3):
            lines.append(
                row(
                    f"slot {k + 1}: top-1 / 2 / 4 / 8",
                    lambda n, k=k: " / ".join(f"{tf[n]['topk_coverage'][f'top{t}'][k]:.0%}" for t in (1, 2, 4, 8)),
                )
            )
        lines.append(row("OOV share", lambda n: f"{tf[n]['oov_share']:.1%}"))
    return lines


def _ngram_sizes(text: str, flag: str = "--copy-ngram") -> tuple[int, int]:
    """``--copy-ngram`` / ``--copy-corpus`` "SHORTEST,LONGEST" -> (shortest, longest), 1 <= shortest <= longest <= 16."""
    parts = text.split(",")
    try:
        lo, hi = (int(p) for p in parts)
    except ValueError:
        raise typer.BadParameter(f"{flag} takes SHORTEST,LONGEST like 1,4, got {text!r}") from None
    if not 1 <= lo <= hi <= 16:
        raise typer.BadParameter(f"{flag} needs 1 <= shortest <= longest <= 16, got {text!r}")
    return lo, hi


def _copy_lines(drafter: Any) -> list[str]:
    """The card's line on copy inputs (none for a drafter without them)."""
    ngram = drafter.dflash.copy_ngram
    if ngram is None or drafter.copy_scale is None:
        return []
    rows = drafter.copy_scale.detach().float().abs().mean(dim=1).tolist()
    scales = ", ".join(f"{n}-gram {rows[n]:.2f}" for n in range(ngram[0], ngram[1] + 1))
    lines = [
        f"- copy inputs: each slot also sees the token a {ngram[0]}-{ngram[1]}-gram lookup into the context "
        f"proposes for it, scaled per matched size (mean |scale|: {scales})"
    ]
    if drafter.copy_bias is not None:
        bias = drafter.copy_bias.detach().float().tolist()
        pointer = ", ".join(f"{n}-gram {bias[n]:+.2f}" for n in range(ngram[0], ngram[1] + 1))
        lines.append(
            "- copy pointer: the proposal's draft logit gets a learnt bias per matched size, and a proposal "
            f"outside the draft vocabulary is scored from the target's full head ({pointer})"
        )
    grams = drafter.dflash.copy_corpus
    if grams is not None and drafter.copy_bias is not None:
        from runtime.engine.models.corpus import CORPUS_FILE, LEVELS

        bias = drafter.copy_bias.detach().float().tolist()
        first = ngram[1] + 1
        learnt = "; ".join(
            f"{n}-gram " + " / ".join(f"{bias[first + LEVELS * (n - grams[0]) + c]:+.2f}" for c in range(LEVELS))
            for n in range(grams[0], grams[1] + 1)
        )
        size = len(drafter.corpus) if drafter.corpus is not None else 0
        lines.append(
            f"- corpus table ({CORPUS_FILE}, {size:,} {grams[0]}-{grams[1]}-grams seen at least twice in the "
            "training answers): where the context's match is shorter than 2 tokens, the copy inputs show what "
            "the target most often wrote next, with their own learnt bias per size and confidence level "
            f"(share of that continuation < 1/2 / >= 1/2 / >= 4/5: {learnt})"
        )
    return lines


def model_card(
    pipe: Any, trainer: Any, evaluation: dict[str, Any] | None, argv: list[str], data_dir: Path | str | None = None
) -> str:
    """Markdown model card: data, steps, hours, hyper-parameters, measured tau and speed on the
    in-distribution and OOD sets side by side, and the commands (paths made portable)."""
    s = trainer.state
    d = trainer.drafter
    cfg = d.config
    params = sum(p.numel() for p in d.parameters())
    last = s.history[-1] if s.history else {}
    out = Path(trainer.out_dir)
    recorded = out / COMMANDS_FILE
    cmds = [c for c in recorded.read_text().splitlines() if c.strip()] if recorded.exists() else []
    cmds = cmds or [_command_line(argv)]
    cmds = [" ".join(shlex.quote(_portable_arg(a, out)) for a in shlex.split(c)) for c in cmds]
    ckpt_cfg = out / "checkpoint" / "config.json"  # the record fit() wrote (init, draft vocabulary)
    training = json.loads(ckpt_cfg.read_text()).get("dflash_training") if ckpt_cfg.exists() else None
    training = training or cfg.raw.get("dflash_training") or {}
    init = training.get("init") or {"kind": "random"}
    vocab = training.get("draft_vocab") or {}
    hp = dict(trainer.cfg.__dict__)
    soft = hp.get("distill") == "soft"
    lines = [
        f"# DFlash drafter for {_portable_arg(str(pipe.pair.target_name), out)}",
        "",
        "Trained with `dflash train` (frozen target embedding and head, features of the tapped target layers,",
        "random anchors, block-sparse attention, position-decayed cross-entropy, AdamW + cosine).",
        "",
        "## Architecture",
        f"- {cfg.num_hidden_layers} Qwen3-style layer(s), hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads "
        f"({cfg.num_key_value_heads} KV), MLP {cfg.intermediate_size}; {params / 1e6:.2f}M trainable parameters",
        f"- block size {d.dflash.block_size}, mask token id {d.dflash.mask_token_id}, "
        f"target layers {list(d.dflash.target_layer_ids)}",
        f"- draft vocabulary: {d.draft_vocab_ids.numel() if d.draft_vocab_ids is not None else 'full'} token ids"
        + (f" ({vocab['rule']}; held-out OOV share {vocab['oov_share']:.2%})" if "rule" in vocab else ""),
        f"- initialisation: {_init_line(init)}",
        *_copy_lines(d),
        "",
        "## Data",
        "The target's own greedy answers (chat template, thinking off) to coding prompts built offline",
        "(`runtime/train/generator.py`: code edits, explanations, multi-turn follow-ups, raw completion of real",
        "source files, stdlib docstring requests and everyday tasks in every language of the task list, with every",
        "evaluation prompt removed; generator `answers`, `runtime/train/answers.py`: edits, tests, ports,",
        "explanations and follow-ups on the code of an earlier dataset's answers, in every language); the hidden states of the tapped layers were captured while the answers were",
        "generated. Labels are exactly the target's greedy choices"
        + ("; the soft term distils its top-k distribution." if soft else "."),
        *_dataset_lines(data_dir),
        *(line for extra in training.get("extra_datasets") or [] for line in _dataset_lines(extra)),
        "",
        "## Training",
        f"- steps: {s.step} over {s.segments} schedule segment(s), {s.elapsed / 3600:.2f} h of training",
        f"- labels: {'soft (top-k distribution, weight ' + str(hp.get('soft_weight')) + ') + hard' if soft else 'hard (greedy tokens)'}",
        f"- hyper-parameters: {json.dumps(hp)}",
        f"- last validation (teacher-forced, held-out shard): {json.dumps(last)}",
        "- held-out evaluation during training: `eval.jsonl` in the run folder (in-distribution and OOD)",
        "",
        "## Measured",
    ]
    if evaluation:
        side = _side_by_side(pipe, evaluation)
        lines += side or [
            f"- held-out prompts: {evaluation['prompts']}, device {pipe.device}, dtype {str(pipe.dtype).removeprefix('torch.')}",
        ]
        lines += [
            "",
            f"- all prompts pooled: median tau at the runtime's verify length: {evaluation['median_tau']} "
            f"(whole block: {evaluation['median_tau_full_block']})",
            f"- median speed-up over plain decoding: {evaluation['median_speedup']}x "
            f"({evaluation['median_ar_tok_s']} -> {evaluation['median_dflash_tok_s']} tok/s)",
            f"- identical to plain greedy decoding: {evaluation['identical_to_plain']}",
            f"- per-slot acceptance (drafts 1..k all accepted): {evaluation['cumulative_acceptance']}",
        ]
    else:
        lines.append("- not evaluated (--no-eval)")
    lines += [
        "",
        "## Reproduce or continue",
        "The commands that produced this run, in order (a `--resume` continues the checkpoint before it;",
        "absolute paths are shown relative to the run folder's parent):",
        "```",
        *cmds,
        "# continue from the last checkpoint with a new schedule segment:",
        f"dflash train --out {shlex.quote(_recorded_out(cmds) or _portable_arg(str(out.resolve()), out))} "
        "--resume --extend --time-budget 1h",
        "```",
        "",
    ]
    return "\n".join(lines)
