"""The doctor's checks of this machine and the pair: software versions, device, dtype, the pair's
compatibility, the chat template, a preset's name and the measured speed. Each returns ``Check``s."""

from __future__ import annotations

import json
import platform
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from runtime.config import RuntimeConfig
from runtime.doctor.report import Check, fail
from runtime.engine.models.device import (
    cpu_bf16_decodes_fast,
    device_description,
    dtype_name,
    resolve_device,
    resolve_dtype,
)
from runtime.engine.models.drafter_config import DraftModelConfig
from runtime.errors import ConfigError, ModelNotFoundError
from runtime.models import presets
from runtime.models.compat import FIX as PAIR_FIX
from runtime.models.compat import check_pair, target_dims


def software() -> Check:
    import transformers

    try:
        import huggingface_hub

        hub = huggingface_hub.__version__
    except ImportError:  # pragma: no cover
        hub = "missing"
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    return Check(
        "software",
        "info",
        f"python {platform.python_version()}, torch {torch.__version__} ({build}), "
        f"transformers {transformers.__version__}, huggingface_hub {hub}",
    )


def device(runtime: RuntimeConfig) -> tuple[Check, torch.device]:
    cuda_fix = "use --device cpu, or install a CUDA build of torch (https://pytorch.org/get-started/locally/)"
    try:
        device = resolve_device(runtime.device)
    except ConfigError as e:
        return fail("device", e, cuda_fix if "cuda" in runtime.device else "use --device cpu"), torch.device("cpu")
    desc = f"{device}: {device_description(device)}"
    if device.type == "cpu" and runtime.device == "auto":
        if torch.version.cuda is None and (shutil.which("nvidia-smi") or Path("/dev/nvidia0").exists()):
            return Check(
                "device", "warn", desc + "; an NVIDIA GPU is present but torch is a CPU build", cuda_fix
            ), device
        return Check("device", "ok", desc + " (no CUDA or MPS device: running on the CPU)"), device
    return Check("device", "ok", desc), device


def dtype(runtime: RuntimeConfig, device: torch.device) -> tuple[Check, torch.dtype]:
    try:
        dtype = resolve_dtype(runtime.dtype, device)
    except ConfigError as e:
        return fail("dtype", e, "use --dtype auto, bfloat16 or float32"), torch.float32
    name = dtype_name(dtype)
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_bf16_decodes_fast():
        return (
            Check("dtype", "warn", f"{name} on a CPU without native bf16 is slow", "use --dtype float32 (or auto)"),
            dtype,
        )
    how = " (auto)" if runtime.dtype == "auto" else ""
    if device.type != "cpu" and dtype == torch.float32:
        return Check("dtype", "warn", f"{name} on {device.type} doubles memory and time", "use --dtype auto"), dtype
    return Check("dtype", "ok", name + how), dtype


def pair(target_cfg: Any, drafter: DraftModelConfig) -> list[Check]:
    hidden, vocab, layers = target_dims(target_cfg)
    d = drafter.dflash
    problems = {p.field: p for p in check_pair(target_cfg, drafter)}
    out = []

    def row(area: str, fields: tuple[str, ...], ok: str) -> None:
        bad = [problems[f] for f in fields if f in problems]
        if bad:
            out.append(Check(area, "fail", "; ".join(p.message for p in bad), PAIR_FIX, 5))
        else:
            out.append(Check(area, "ok", ok))

    row("vocab", ("vocab_size",), f"target and drafter share a {vocab}-token vocabulary")
    row("hidden size", ("hidden_size",), f"target and drafter hidden size {hidden}")
    row(
        "layer ids",
        ("target_layer_ids", "num_target_layers"),
        f"drafter taps target layers {list(d.target_layer_ids)} of {layers}",
    )
    row("mask id", ("mask_token_id",), f"mask token id {d.mask_token_id} is inside the target vocabulary")
    out.append(Check("block size", "info", f"drafter block size {d.block_size} ({d.block_size - 1} drafts per step)"))
    return out


def chat_template(folder: Path) -> str | None:
    """The chat template text of a target folder, read from files (no tokenizer is built)."""
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(errors="replace")
    for name in ("chat_template.json", "tokenizer_config.json"):
        try:
            tpl = json.loads((folder / name).read_text()).get("chat_template")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(tpl, list):  # named templates: [{"name": ..., "template": ...}]
            tpl = "\n".join(str(t.get("template", "")) for t in tpl if isinstance(t, dict))
        if tpl:
            return str(tpl)
    return None


def template(folder: Path, preset: presets.Preset | None) -> list[Check]:
    tok_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((folder / f).exists() for f in tok_files):
        return [
            Check(
                "tokenizer",
                "warn",
                "the target has no tokenizer files: only token ids work (dflash run --prompt-ids)",
                "use a target folder that includes its tokenizer",
            )
        ]
    out = [Check("tokenizer", "ok", "tokenizer files present")]
    tpl = chat_template(folder)
    if tpl is None:
        out.append(
            Check(
                "chat template",
                "warn",
                "the target has no chat template: prompts are sent as plain completions",
                "use the instruct/chat variant of the target for chat, or pass --raw",
            )
        )
        return out
    out.append(Check("chat template", "ok", "chat template present"))
    if "enable_thinking" in tpl:
        out.append(
            Check(
                "thinking mode",
                "ok",
                "the template can think; dflash turns thinking off (enable_thinking=False), as drafters are trained",
            )
        )
    elif "<think>" in tpl or (preset is not None and preset.thinking):
        out.append(
            Check(
                "thinking mode",
                "warn",
                "the chat template always thinks and cannot switch it off: acceptance drops sharply",
                "use a non-thinking (instruct) variant of the target, or a template with enable_thinking",
            )
        )
    else:
        out.append(Check("thinking mode", "ok", "no thinking mode in the template"))
    return out


def preset_of(ref: Any) -> tuple[presets.Preset | None, Check | None]:
    if ref.preset:
        try:
            return presets.get_preset(ref.preset), None
        except ModelNotFoundError as e:
            return None, fail("model", e, "see `dflash models --presets`")
    if ref.target:
        for p in presets.PRESETS.values():
            if p.target.lower() == ref.target.lower():
                return p, None
        return None, None
    return presets.get_preset(presets.EMBEDDED), None


def speed(speed_file: Path, target_name: str, device: torch.device, dtype: torch.dtype) -> Check:
    from runtime.bench.probe import describe, load_result, probe_key

    stored = load_result(speed_file, probe_key(target_name, str(device), dtype_name(dtype)))
    if stored is None:
        return Check("speed", "info", "not measured on this machine yet", "`dflash doctor --speed` measures it")
    when = time.strftime("%Y-%m-%d", time.localtime(stored.measured_at))
    return Check("speed", "info", f"{describe(stored)} (measured {when})")


def kernels(kernel_file: Path) -> Check:
    """The bf16 GEMM path chosen by measurement on this machine (the newest choice: one per target
    shape), with every candidate's times."""
    from runtime.engine.models.kernels.choice import describe, machine_key, read_choices

    choices, problem = read_choices(kernel_file)
    if problem is not None:
        return Check("kernels", "warn", f"ignoring {kernel_file} ({problem})", "the next bf16 load measures again")
    here = machine_key() + "|"
    mine = [c for key, c in choices.items() if key.startswith(here)]
    if not mine:
        return Check(
            "kernels", "info", "bf16 GEMM: not measured on this machine yet", "`dflash doctor --speed` measures it"
        )
    newest = max(mine, key=lambda c: c.measured_at)
    when = time.strftime("%Y-%m-%d", time.localtime(newest.measured_at))
    return Check("kernels", "info", f"{describe(newest)}; target {newest.shapes} (measured {when})")
