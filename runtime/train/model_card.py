"""The exported drafter's model card (``OUT/drafter/README.md``): architecture, data, training,
the measured speed-up in- and out-of-distribution side by side, and the commands that made it."""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runtime.engine.models.corpus import CORPUS_FILE, LEVELS
from runtime.train.datasets import data_report
from runtime.train.run_folder import COMMANDS_FILE, command_line, portable_arg, recorded_out


class RunRecord:
    """What the model card reads of a trainer, rebuilt from a checkpoint."""

    def __init__(self, drafter: Any, state: Any, cfg: Any, out_dir: Path) -> None:
        self.drafter, self.state, self.cfg, self.out_dir = drafter, state, cfg, out_dir


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


def _dataset_lines(data_dir: Path | str | None) -> list[str]:
    """The dataset's size and mix for the model card."""
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
    pipe: Any, trainer: Any, evaluation: dict[str, Any] | None, argv: Sequence[str], data_dir: Path | str | None = None
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
    cmds = cmds or [command_line(argv)]
    cmds = [" ".join(shlex.quote(portable_arg(a, out)) for a in shlex.split(c)) for c in cmds]
    ckpt_cfg = out / "checkpoint" / "config.json"  # the record fit() wrote (init, draft vocabulary)
    training = json.loads(ckpt_cfg.read_text()).get("dflash_training") if ckpt_cfg.exists() else None
    training = training or cfg.raw.get("dflash_training") or {}
    init = training.get("init") or {"kind": "random"}
    vocab = training.get("draft_vocab") or {}
    hp = dict(trainer.cfg.__dict__)
    soft = hp.get("distill") == "soft"
    lines = [
        f"# DFlash drafter for {portable_arg(str(pipe.pair.target_name), out)}",
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
        f"dflash train --out {shlex.quote(recorded_out(cmds) or portable_arg(str(out.resolve()), out))} "
        "--resume --extend --time-budget 1h",
        "```",
        "",
    ]
    return "\n".join(lines)
