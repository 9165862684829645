"""`dflash train`: distil a DFlash drafter for a target (data -> fit -> evaluate -> export)."""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable
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
    out: Annotated[Path, typer.Option("--out", "-o", help="Run folder (data/, checkpoint/, drafter/).")],
    model: ModelOpt = None,
    target: TargetOpt = None,
    data: Annotated[
        Path | None, typer.Option("--data", help="Dataset folder (default: OUT/data); reused if present.")
    ] = None,
    prompts: Annotated[
        int | None, typer.Option("--prompts", help="Prompts to answer for the dataset (default: all).")
    ] = None,
    answer_tokens: Annotated[int, typer.Option("--answer-tokens", help="Max tokens per generated answer.")] = 320,
    gen_batch: Annotated[int, typer.Option("--gen-batch", help="Answers generated together.")] = 32,
    layers: Annotated[int, typer.Option("--layers", help="Drafter decoder layers.")] = 1,
    block_size: Annotated[int, typer.Option("--block-size", "-b", help="Drafter block size.")] = 8,
    taps: Annotated[str | None, typer.Option("--taps", help="Target layers to tap, e.g. 1,6,11,16,21.")] = None,
    intermediate_size: Annotated[int | None, typer.Option("--intermediate-size", help="Drafter MLP width.")] = None,
    draft_vocab: Annotated[int, typer.Option("--draft-vocab", help="Reduced draft vocabulary (0 = full).")] = 16384,
    steps: Annotated[int | None, typer.Option("--steps", help="Optimiser steps.")] = None,
    time_budget: Annotated[str | None, typer.Option("--time-budget", help="Wall-clock budget, e.g. 45m, 2h.")] = None,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate.")] = 1e-3,
    anchors: Annotated[int, typer.Option("--anchors", help="Blocks per sequence per step.")] = 48,
    seqs_per_step: Annotated[int, typer.Option("--seqs-per-step", help="Sequences per step.")] = 2,
    max_len: Annotated[int, typer.Option("--max-len", help="Tokens per training sequence.")] = 640,
    resume: Annotated[bool, typer.Option("--resume", help="Continue OUT/checkpoint.")] = False,
    extend: Annotated[
        bool, typer.Option("--extend", help="With --resume: a new warm-up + cosine segment (continue a finished run).")
    ] = False,
    data_only: Annotated[bool, typer.Option("--data-only", help="Only build the dataset.")] = False,
    eval_only: Annotated[
        bool, typer.Option("--eval-only", help="Evaluate OUT/checkpoint and export it again; no training.")
    ] = False,
    eval_prompts: Annotated[int, typer.Option("--eval-prompts", help="Held-out prompts for the final evaluation.")] = 8,
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
    from runtime.train.api import DataSpec, DrafterSpec, export, fit, prepare_data
    from runtime.train.trainer import TrainConfig

    budget = _duration(time_budget)
    if eval_only:
        return _eval_only(out, model, target, device, dtype, offline, threads, eval_prompts, eval_tokens)
    if not data_only and not resume and steps is None and budget is None:
        raise typer.BadParameter("give --steps or --time-budget (or --data-only)")
    tap_ids = tuple(parse_ids(taps)) if taps else None
    spec = DrafterSpec(
        num_layers=layers,
        block_size=block_size,
        taps=tap_ids,
        intermediate_size=intermediate_size,
        draft_vocab=draft_vocab,
    )
    cfg = None
    if not data_only and (steps is not None or budget is not None):  # --resume alone keeps the run's schedule
        cfg = TrainConfig(
            steps=steps, time_budget=budget, lr=lr, anchors=anchors, seqs_per_step=seqs_per_step, max_len=max_len
        )
    out.mkdir(parents=True, exist_ok=True)
    data_dir = data or out / "data"
    session = session_options(model, target, "none", device, dtype, offline, threads=threads)
    pipe = open_pipeline(session)
    if pipe.tokenizer is None:
        raise typer.BadParameter("the target has no tokenizer; dflash train needs one to build prompts")
    _record_command(out, sys.argv)  # only invocations that got as far as building data or training
    say = _printer()
    from runtime.engine.drafter import default_target_layer_ids

    data_taps = tap_ids or tuple(default_target_layer_ids(pipe.target.num_layers, layers))
    if resume and (out / "checkpoint" / "config.json").exists():
        raw = json.loads((out / "checkpoint" / "config.json").read_text())
        data_taps = tuple(raw["dflash_config"]["target_layer_ids"])
    say(f"dataset {data_dir} (taps {list(data_taps)})")
    prepare_data(
        pipe.target,
        pipe.tokenizer,
        data_dir,
        data_taps,
        DataSpec(num_prompts=prompts, max_new_tokens=answer_tokens, batch_size=gen_batch),
        pipe.stop_token_ids,
        progress=lambda p: say(
            f"  shard {p['shard'] + 1}/{p['shards']}: {p['tokens']} tokens this run, {p['seconds']:.0f}s"
        ),
    )
    if data_only:
        print(data_dir)
        return
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
        progress=_train_progress(say),
    )
    evaluation = None
    if not no_eval and eval_prompts > 0:
        evaluation = _evaluate(pipe, session, out, eval_prompts, eval_tokens, say)
    card = model_card(pipe, trainer, evaluation, sys.argv, data_dir=data_dir)
    path = export(out, evaluation, card)
    say(f"drafter saved to {path}")
    print(path)


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
) -> None:
    """Evaluate the last checkpoint of a run and export it with a fresh model card."""
    import torch

    from runtime.errors import ConfigError
    from runtime.train.api import export
    from runtime.train.trainer import TrainConfig, TrainState

    ckpt = out / "checkpoint" / "trainer_state.pt"
    if not ckpt.exists():
        raise ConfigError(f"{ckpt.parent} has no checkpoint to evaluate; train first")
    blob = torch.load(ckpt, map_location="cpu", weights_only=False)
    session = session_options(model, target, "none", device, dtype, offline, threads=threads)
    pipe = open_pipeline(session)
    say = _printer()
    evaluation = _evaluate(pipe, session, out, eval_prompts, eval_tokens, say)
    cfg = dict(blob["config"])
    cfg["betas"] = tuple(cfg["betas"])
    assert pipe.drafter is not None  # _evaluate loaded the checkpoint
    run = _RunRecord(pipe.drafter, TrainState(**blob["state"]), TrainConfig(**cfg), out)
    recorded = pipe.drafter.config.raw.get("dflash_training") or {}  # the checkpoint's config, loaded by _evaluate
    card = model_card(pipe, run, evaluation, sys.argv, data_dir=recorded.get("dataset"))
    path = export(out, evaluation, card)
    say(f"drafter saved to {path}")
    print(path)


class _RunRecord:
    """What the model card reads of a trainer, rebuilt from a checkpoint."""

    def __init__(self, drafter: Any, state: Any, cfg: Any, out_dir: Path) -> None:
        self.drafter, self.state, self.cfg, self.out_dir = drafter, state, cfg, out_dir


COMMANDS_FILE = "commands.txt"


def _dataset_lines(data_dir: Path | str | None) -> list[str]:
    """The dataset's size for the model card."""
    from runtime.train.data import dataset_summary

    if not data_dir or not Path(data_dir).is_dir():
        return []
    s = dataset_summary(Path(data_dir))
    return [
        "",
        f"Dataset: {s['sequences']} answered prompts in {s['shards']} shards, {s['answer_tokens']} answer tokens "
        f"(+ {s['prompt_tokens']} prompt tokens); anchors are drawn from the answers.",
    ]


def _command_line(argv: list[str]) -> str:
    return "dflash " + " ".join(shlex.quote(a) for a in argv[1:])


def _record_command(out: Path, argv: list[str]) -> None:
    """Append this invocation to OUT/commands.txt, which the model card quotes (training and
    evaluation may span several runs: --resume, --extend, --eval-only)."""
    with (out / COMMANDS_FILE).open("a") as f:
        f.write(_command_line(argv) + "\n")


def _printer() -> Any:
    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    return say


def _train_progress(say: Any) -> Any:
    state = {"last": 0.0}

    def show(info: dict[str, Any]) -> None:
        import time

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
            say(line)

    return show


def _evaluate(
    pipe: Pipeline, session: SessionOptions, out: Path, n: int, tokens: int, say: Callable[[str], None]
) -> dict[str, Any]:
    import torch

    from runtime.engine.drafter import load_draft_model
    from runtime.session import calibrate
    from runtime.train.evaluate import evaluate
    from runtime.train.heldout import HELDOUT

    pipe.drafter = load_draft_model(out / "checkpoint", pipe.device, pipe.dtype)
    pipe.target.set_taps(pipe.drafter.dflash.target_layer_ids)
    if session.calibration_file is not None:  # the verify length comes from this machine's costs, as in `dflash run`
        calibrate(pipe, session.calibration_file, say)
    torch.manual_seed(0)
    say(f"evaluating on {min(n, len(HELDOUT))} held-out prompts ({tokens} tokens each, plain vs DFlash)")
    result = evaluate(pipe, HELDOUT[:n], max_new_tokens=tokens, progress=say)
    summary = result.summary()
    say("evaluation: " + json.dumps(summary))
    return summary


def model_card(
    pipe: Any, trainer: Any, evaluation: dict[str, Any] | None, argv: list[str], data_dir: Path | str | None = None
) -> str:
    """Markdown model card: data, steps, hyper-parameters, measured tau and speed, how to reproduce."""
    s = trainer.state
    d = trainer.drafter
    cfg = d.config
    params = sum(p.numel() for p in d.parameters())
    last = s.history[-1] if s.history else {}
    recorded = trainer.out_dir / COMMANDS_FILE
    cmds = [c for c in recorded.read_text().splitlines() if c.strip()] if recorded.exists() else []
    cmds = cmds or [_command_line(argv)]
    lines = [
        f"# DFlash drafter for {pipe.pair.target_name}",
        "",
        "Trained with `dflash train` (frozen target embedding and head, features of the tapped target layers,",
        "random anchors, block-sparse attention, position-decayed cross-entropy, AdamW + cosine).",
        "",
        "## Architecture",
        f"- {cfg.num_hidden_layers} Qwen3-style layer(s), hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads "
        f"({cfg.num_key_value_heads} KV), MLP {cfg.intermediate_size}; {params / 1e6:.2f}M trainable parameters",
        f"- block size {d.dflash.block_size}, mask token id {d.dflash.mask_token_id}, "
        f"target layers {list(d.dflash.target_layer_ids)}",
        f"- draft vocabulary: {d.draft_vocab_ids.numel() if d.draft_vocab_ids is not None else 'full'} token ids",
        "",
        "## Data",
        "The target's own greedy answers (chat template, thinking off) to coding prompts built offline from the",
        "Python standard library (function/class docstrings as requests, and raw function headers to complete)",
        "plus everyday programming tasks in ten languages; the hidden states of the tapped layers were captured",
        "while the answers were generated. Labels are therefore exactly the target's greedy choices.",
        *_dataset_lines(data_dir),
        "",
        "## Training",
        f"- steps: {s.step} over {s.segments} schedule segment(s), {s.elapsed / 60:.1f} min of training",
        f"- hyper-parameters: {json.dumps({k: v for k, v in trainer.cfg.__dict__.items()})}",
        f"- last validation (teacher-forced, held-out shard): {json.dumps(last)}",
        "",
        "## Measured",
    ]
    if evaluation:
        lines += [
            f"- held-out prompts: {evaluation['prompts']}, device {pipe.device}, dtype {str(pipe.dtype).removeprefix('torch.')}",
            f"- median tau at the runtime's verify length: {evaluation['median_tau']} "
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
        "The commands that produced this run, in order (a `--resume` continues the checkpoint before it):",
        "```",
        *cmds,
        "# continue from the last checkpoint with a new schedule segment:",
        f"dflash train --out {shlex.quote(str(trainer.out_dir))} --resume --extend --time-budget 1h",
        "```",
        "",
    ]
    return "\n".join(lines)
