"""`dflash train`: distil a DFlash drafter for a target (data -> fit -> evaluate -> export).

The options become one ``TrainOptions`` for ``runtime.train.job.run_training``; this module
renders its progress and maps a bad option to click's usage error (exit 2).
"""

from __future__ import annotations

import json
import sys
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
    session_options,
)
from ..errors import handle_errors

if TYPE_CHECKING:
    from runtime import Pipeline
    from runtime.session import SessionOptions


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
    fim_from: Annotated[
        list[str] | None,
        typer.Option(
            "--fim-from",
            help="Build a fill-in-the-middle dataset: holes cut from the source files under this folder as "
            "editors cut them (rest of a line, lines, a block, a function body; 'auto' as for --text-from; "
            "a dataset folder: the code blocks of the target's answers in it; repeatable), middles answered "
            "greedily by the target in its FIM layout (generator 'fim'; --answer-tokens caps a middle).",
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
    file_requests: Annotated[
        bool,
        typer.Option(
            "--file-requests",
            help="Build a new dataset on requests for whole application source files (20-60 lines, every "
            "language, varied topics), answered greedily (generator 'files'): code for --fim-from DATASET "
            "to cut holes in.",
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
    from runtime.train.job import TrainHooks, run_training
    from runtime.train.options import OptionError, TrainOptions

    options = TrainOptions(
        out=out,
        model=model,
        target=target,
        data=data,
        extra_data=tuple(extra_data or ()),
        corpus_data=tuple(corpus_data or ()),
        prompts=prompts,
        prompts_from=prompts_from,
        text_from=tuple(text_from or ()),
        fim_from=tuple(fim_from or ()),
        self_instruct=self_instruct,
        file_requests=file_requests,
        answer_tokens=answer_tokens,
        gen_batch=gen_batch,
        data_seed=data_seed,
        layers=layers,
        block_size=block_size,
        taps=taps,
        intermediate_size=intermediate_size,
        draft_vocab=draft_vocab,
        max_oov=max_oov,
        distill=distill,
        soft_weight=soft_weight,
        topk=topk,
        init=init,
        from_drafter=from_drafter,
        copy_inputs=copy_inputs,
        copy_ngram=copy_ngram,
        copy_corpus=copy_corpus,
        eval_every=eval_every,
        ood_eval=ood_eval,
        steps=steps,
        time_budget=time_budget,
        lr=lr,
        copy_lr=copy_lr,
        anchors=anchors,
        anchor_sampling=anchor_sampling,
        seqs_per_step=seqs_per_step,
        max_len=max_len,
        precision=precision,
        resume=resume,
        extend=extend,
        data_only=data_only,
        eval_only=eval_only,
        eval_prompts=eval_prompts,
        eval_tokens=eval_tokens,
        no_eval=no_eval,
        device=device,
        dtype=getattr(dtype, "value", dtype),
        threads=threads,
        offline=offline,
        argv=tuple(sys.argv),
        typed=frozenset(k for k in ctx.params if _typed(ctx, k)),
    )
    say = _printer()

    def show_mix(report: dict[str, Any]) -> None:
        for line in _mix_lines(report):
            say(line)

    def open_target(dtype_choice: str) -> tuple[Pipeline, SessionOptions]:
        session = session_options(model, target, "none", device, dtype_choice, offline, threads=threads)
        return open_pipeline(session), session

    hooks = TrainHooks(
        open_pipeline=open_target,
        say=say,
        data_progress=lambda p: say(
            f"  requests written {p['requests_sampled']}/{p['of']} ({p['requests_kept']} kept)"
            if "requests_sampled" in p
            else f"  shard {p['shard'] + 1}/{p['shards']}: {p['tokens']} tokens this run, {p['seconds']:.0f}s"
        ),
        data_report=show_mix,
        step=_train_progress(say, None if resume else out),
    )
    try:
        result = run_training(options, hooks)
    except OptionError as e:  # a bad option value or combination: click's usage error, exit 2
        raise typer.BadParameter(str(e)) from None
    if result.exported:
        say(f"drafter saved to {result.path}")
    print(result.path)


def _typed(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` was given on the command line (not its default)."""
    source = ctx.get_parameter_source(name)  # an enum of typer's own click: compared by name
    return getattr(source, "name", None) in ("COMMANDLINE", "ENVIRONMENT")


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
