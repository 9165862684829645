"""`dflash doctor`: can this machine run this pair, and if not, what to change.

Every check reads files and asks torch about the device; no weights are loaded and nothing is
downloaded or converted, so it answers in a second or two. Each ``Check`` carries a status, a
one-line message and, when something is off, the fix. A failed check also carries the exit code
the same problem gets elsewhere (3 not found, 4 unusable files, 5 incompatible pair, 6 memory,
2 configuration).
"""

from __future__ import annotations

import json
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from runtime.config import RuntimeConfig
from runtime.engine.models.device import (
    cpu_bf16_decodes_fast,
    device_description,
    dtype_name,
    resolve_device,
    resolve_dtype,
)
from runtime.engine.models.drafter_config import DraftModelConfig
from runtime.errors import ConfigError, DFlashError, ModelLoadError, ModelNotFoundError
from runtime.models import embedded, presets
from runtime.models.compat import FIX as PAIR_FIX
from runtime.models.compat import check_pair, target_dims
from runtime.models.files import FolderReport, inspect_folder
from runtime.models.hub import PartialDownloadError, download_model, looks_like_repo_id

Status = Literal["ok", "warn", "fail", "info"]
MemoryProbe = Callable[[torch.device], "tuple[int, int] | None"]
CONTEXT_TOKENS = 4096  # KV cache budget the memory estimate assumes


@dataclass(frozen=True)
class Check:
    """One line of the doctor's report.

    Attributes:
        area: what was checked ("device", "dtype", "memory", "target", "vocab", ...).
        status: "ok", "warn" (works, but worse than it could), "fail" (will not work) or "info".
        message: what was found.
        fix: what to do about it (empty when nothing needs doing).
        exit_code: for failures, the exit code the CLI uses for this kind of problem.
    """

    area: str
    status: Status
    message: str
    fix: str = ""
    exit_code: int = 0

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``dflash doctor --json``)."""
        return {"area": self.area, "status": self.status, "message": self.message, "fix": self.fix}


def _fail(area: str, err: DFlashError | str, fix: str = "", code: int | None = None) -> Check:
    exit_code = code if code is not None else (err.exit_code if isinstance(err, DFlashError) else 1)
    return Check(area, "fail", str(err), fix, exit_code)


@dataclass
class _Model:
    """A located model folder (or why it could not be located)."""

    name: str
    folder: Path | None = None
    report: FolderReport | None = None
    checks: list[Check] = field(default_factory=list)


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(total, available) bytes of memory on ``device``, or None when unknown."""
    try:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            return int(total), int(free)
        if device.type == "mps":
            total = int(torch.mps.recommended_max_memory())
            return total, total - int(torch.mps.driver_allocated_memory())
    except (RuntimeError, AttributeError):
        return None
    info: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
        return info["MemTotal"], info.get("MemAvailable", info["MemTotal"])
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(total), int(total)
    except (ValueError, OSError, AttributeError):
        return None


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


# -- locating the pair (cache only: the doctor never downloads) ------------------------------------
def _locate_hub(repo: str, what: str, cache_dir: Path | None, revision: str | None) -> _Model:
    from runtime.models.store import _expected_files

    m = _Model(repo)
    fix = f"dflash download {repo}"
    try:
        folder = download_model(repo, what, cache_dir=cache_dir, revision=revision, offline=True)
    except PartialDownloadError as e:
        m.checks.append(_fail(what, e, f"run `{fix}` to finish the download", 3))
        return m
    if folder is None:
        m.checks.append(_fail(what, f"{what} {repo} is not in the Hugging Face cache", f"run `{fix}`", 3))
        return m
    m.folder = folder
    m.report = inspect_folder(folder, _expected_files(folder.parent.parent, folder.name))
    return m


def _locate(ref: str, what: str, opts: Any) -> _Model:
    """Find ``ref`` (a folder, a Hub id, or "embedded") without downloading or converting."""
    if ref == "embedded":
        if what == "target":
            m = _Model(embedded.TARGET_NAME)
            if embedded.is_installed(opts.models_dir):
                m.folder = embedded.embedded_target_dir(opts.models_dir)
            else:
                try:
                    embedded.part_paths()
                    m.checks.append(
                        Check(
                            what,
                            "warn",
                            f"the embedded target {embedded.TARGET_NAME} is not converted yet "
                            "(first use converts it, about a minute)",
                            "run `dflash setup` now",
                        )
                    )
                except DFlashError as e:
                    m.checks.append(_fail(what, e, f"run: {embedded.INSTALL_HINT}"))
        else:
            m = _Model("dflash/" + embedded.DRAFTER_DIR.name)
            try:
                m.folder = embedded.embedded_drafter_dir()
            except DFlashError as e:
                m.checks.append(_fail(what, e, "reinstall dflash (the drafter ships as package data)"))
        if m.folder is not None:
            m.report = inspect_folder(m.folder)
        return m
    path = Path(ref).expanduser()
    if path.is_dir():
        return _Model(ref, path, inspect_folder(path))
    if looks_like_repo_id(ref):
        return _locate_hub(ref, what, opts.hf_cache_dir, opts.revision)
    m = _Model(ref)
    m.checks.append(
        _fail(what, ModelNotFoundError(f"{what} {ref!r} is neither a local folder nor a Hub id (org/name)"))
    )
    return m


def _files_check(what: str, m: _Model) -> Check | None:
    if m.folder is None or m.report is None:
        return None
    r = m.report
    if not r.ok:
        hub = looks_like_repo_id(m.name) and not Path(m.name).exists()
        fix = f"run `dflash download {m.name}` to fetch what is missing" if hub else "copy or re-download the folder"
        return _fail(what, f"{what} {m.name}: {'; '.join(r.problems)}", fix, ModelLoadError.exit_code)
    return Check(what, "ok", f"{what} {m.name}: {r.params / 1e6:,.1f}M parameters in {m.folder}")


# -- the checks ------------------------------------------------------------------------------------
def _software() -> Check:
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


def _device(runtime: RuntimeConfig) -> tuple[Check, torch.device]:
    cuda_fix = "use --device cpu, or install a CUDA build of torch (https://pytorch.org/get-started/locally/)"
    try:
        device = resolve_device(runtime.device)
    except ConfigError as e:
        return _fail("device", e, cuda_fix if "cuda" in runtime.device else "use --device cpu"), torch.device("cpu")
    desc = f"{device}: {device_description(device)}"
    if device.type == "cpu" and runtime.device == "auto":
        if torch.version.cuda is None and (shutil.which("nvidia-smi") or Path("/dev/nvidia0").exists()):
            return Check(
                "device", "warn", desc + "; an NVIDIA GPU is present but torch is a CPU build", cuda_fix
            ), device
        return Check("device", "ok", desc + " (no CUDA or MPS device: running on the CPU)"), device
    return Check("device", "ok", desc), device


def _dtype(runtime: RuntimeConfig, device: torch.device) -> tuple[Check, torch.dtype]:
    try:
        dtype = resolve_dtype(runtime.dtype, device)
    except ConfigError as e:
        return _fail("dtype", e, "use --dtype auto, bfloat16 or float32"), torch.float32
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


def _kv_bytes(target_cfg: Any, dtype: torch.dtype) -> int:
    c = target_cfg.get_text_config() if hasattr(target_cfg, "get_text_config") else target_cfg
    heads = int(getattr(c, "num_attention_heads", 1) or 1)
    kv = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    item = torch.empty((), dtype=dtype).element_size()
    return 2 * int(c.num_hidden_layers) * kv * head_dim * item * CONTEXT_TOKENS


def _memory(device: torch.device, dtype: torch.dtype, params: int, kv: int, probe: MemoryProbe) -> Check:
    item = torch.empty((), dtype=dtype).element_size()
    weights = params * item
    need = int((weights + kv) * 1.1)  # 10% for activations and allocator slack
    what = (
        f"needs about {_gb(need)} ({_gb(weights)} weights in {dtype_name(dtype)} "
        f"+ {_gb(kv)} KV cache at {CONTEXT_TOKENS} tokens)"
    )
    mem = probe(device)
    if mem is None:
        return Check("memory", "info", what + "; the device's memory is unknown")
    total, available = mem
    where = f"{device.type} has {_gb(total)}, {_gb(available)} free"
    fix = "use a smaller model, --quantize int8 (or int4), or a device with more memory"
    if need > total:
        return Check("memory", "fail", f"{what}; {where}", fix, 6)
    if need > available:
        return Check("memory", "warn", f"{what}; {where}", "close other programs using the memory, or " + fix)
    return Check("memory", "ok", f"{what}; {where}")


def _pair(target_cfg: Any, drafter: DraftModelConfig) -> list[Check]:
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


def _chat_template(folder: Path) -> str | None:
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


def _template(folder: Path, preset: presets.Preset | None) -> list[Check]:
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
    tpl = _chat_template(folder)
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


def _preset_of(ref: Any) -> tuple[presets.Preset | None, Check | None]:
    if ref.preset:
        try:
            return presets.get_preset(ref.preset), None
        except ModelNotFoundError as e:
            return None, _fail("model", e, "see `dflash models --presets`")
    if ref.target:
        for p in presets.PRESETS.values():
            if p.target.lower() == ref.target.lower():
                return p, None
        return None, None
    return presets.get_preset(presets.EMBEDDED), None


def _speed(speed_file: Path, target_name: str, device: torch.device, dtype: torch.dtype) -> Check:
    from runtime.bench.probe import describe, load_result, probe_key

    stored = load_result(speed_file, probe_key(target_name, str(device), dtype_name(dtype)))
    if stored is None:
        return Check("speed", "info", "not measured on this machine yet", "`dflash doctor --speed` measures it")
    when = time.strftime("%Y-%m-%d", time.localtime(stored.measured_at))
    return Check("speed", "info", f"{describe(stored)} (measured {when})")


def _kernels(kernel_file: Path) -> Check:
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


def run_doctor(
    ref: Any,
    runtime: RuntimeConfig,
    opts: Any,
    memory_probe: MemoryProbe | None = None,
    speed_file: Path | None = None,
    kernel_file: Path | None = None,
) -> list[Check]:
    """Check device, dtype, memory, the pair's files and compatibility, and the chat template.

    Args:
        ref: a ``ModelRef`` (all None: the embedded default pair).
        runtime: device and dtype to check.
        opts: ``LoadOptions`` (cache folders, revision); ``offline`` is implied.
        memory_probe: returns (total, available) bytes of a device (default ``device_memory``).
        speed_file: where ``dflash doctor --speed`` keeps its measurements (None: no speed line).
        kernel_file: where the bf16 GEMM choices are kept (``kernels.choice.choice_file``; None: no
            kernels line; shown on a CPU only).

    Returns:
        The checks in report order; any with status "fail" means the pair will not run as asked.
    """
    from runtime.engine.models.drafter_config import read_draft_config
    from runtime.models.configs import read_target_config

    checks: list[Check] = [_software()]
    dev_check, device = _device(runtime)
    dtype_check, dtype = _dtype(runtime, device)
    checks += [dev_check, dtype_check]

    if ref.drafter and ref.drafter != "none" and not ref.target and not ref.preset:
        checks.append(_fail("model", ConfigError("--drafter needs --target (or --model PRESET)")))
        return checks
    preset, bad = _preset_of(ref)
    if bad is not None:
        checks.append(bad)
        return checks
    target_ref = ref.target or (preset.target if preset else None)
    drafter_ref = ref.drafter or (preset.drafter if preset else None)
    if preset is not None:
        t_name = embedded.TARGET_NAME if preset.target == "embedded" else preset.target
        d_name = "the drafter shipped with dflash" if preset.drafter == "embedded" else preset.drafter
        checks.append(Check("model", "info", f"preset {preset.name}: {t_name} + {d_name}"))

    target = _locate(str(target_ref), "target", opts)
    checks += target.checks
    if (c := _files_check("target", target)) is not None:
        checks.append(c)
    drafter: _Model | None = None
    if drafter_ref and drafter_ref != "none":
        drafter = _locate(drafter_ref, "drafter", opts)
        checks += drafter.checks
        if (c := _files_check("drafter", drafter)) is not None:
            checks.append(c)
    else:
        checks.append(
            Check(
                "drafter",
                "warn",
                "no drafter: plain decoding only, no speed-up",
                "name one with --drafter, or train one with `dflash train`",
            )
        )

    target_cfg = draft_cfg = None
    if target.folder is not None and (target.folder / "config.json").exists():
        try:
            target_cfg = read_target_config(target.folder)
        except DFlashError as e:
            checks.append(_fail("target", e, "use a causal LM that transformers supports"))
    if drafter is not None and drafter.folder is not None and (drafter.folder / "config.json").exists():
        try:
            draft_cfg = read_draft_config(drafter.folder)
        except DFlashError as e:
            checks.append(_fail("drafter", e, "is this a DFlash drafter? see `dflash models --presets`"))
    if target_cfg is not None and draft_cfg is not None:
        checks += _pair(target_cfg, draft_cfg)
    if target_cfg is not None and target.report is not None:
        params = target.report.params + (drafter.report.params if drafter and drafter.report else 0)
        checks.append(_memory(device, dtype, params, _kv_bytes(target_cfg, dtype), memory_probe or device_memory))
    if target.folder is not None:
        checks += _template(target.folder, preset)
    if speed_file is not None and target_cfg is not None:
        checks.append(
            _speed(speed_file, embedded.TARGET_NAME if target_ref == "embedded" else str(target_ref), device, dtype)
        )
    if kernel_file is not None and device.type == "cpu":
        checks.append(_kernels(kernel_file))
    from runtime.models.store import hub_cache_dir

    cache = hub_cache_dir(opts.hf_cache_dir)
    checks.append(Check("hub", "info", f"Hugging Face cache: {cache}; dflash models: {opts.models_dir}"))
    return checks


def exit_code(checks: list[Check]) -> int:
    """The exit code of the first failed check (0 when none failed)."""
    for c in checks:
        if c.status == "fail":
            return c.exit_code or 1
    return 0
