"""`dflash quantize` as one runtime call: load, (measure), quantize, save, reload, (compare).

Steps of ``quantize_pair``:
 1. Resolve the pair and check everything that can fail cheaply (scheme, device, library, an
    already-quantized input, the output folder) before any weight is loaded.
 2. Load the unquantized pair; with ``report``, measure it (``runtime.quantize.report``).
 3. Quantize the target (and the drafter when asked) in place and save it into a temporary folder
    next to ``out``, renamed to ``out`` only when complete (an interrupted run leaves no half folder).
 4. Reload the saved folder through ``load_pipeline`` exactly as `dflash run --target OUT` will,
    and check that it reproduces the in-memory quantized model's logits.
 5. With ``report``, measure the quantized pair on the same prompts and compare.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from runtime.config import RuntimeConfig
from runtime.engine.models.device import dtype_name, resolve_device, resolve_dtype
from runtime.errors import ConfigError
from runtime.models import embedded
from runtime.models.configs import read_target_config
from runtime.models.quant_schemes import (
    LayerProgress,
    check_supported,
    folder_weight_bytes,
    get_scheme,
    library_version,
    quantize_model_inplace,
    quiet_preimport,
    weight_bytes,
)
from runtime.models.quantized import (
    ensure_float_model,
    save_drafter_for_scheme,
    save_float_for_scheme,
    save_quantized_target,
)
from runtime.pipeline import LoadOptions, ModelRef, load_pipeline, resolve_pair
from runtime.quantize.report import QuantReport, compare, measure_pair, report_prompts

Status = Callable[[str], None]
DRAFTER_SUBDIR = "drafter"


@dataclass(frozen=True)
class QuantizeRequest:
    """What to quantize, how, and where to save it.

    Attributes:
        scheme: a name from ``runtime.models.quant_schemes.SCHEMES``.
        out: output folder (the quantized target; a quantized drafter goes to ``out/drafter``).
        ref: the pair (as for ``load_pipeline``).
        runtime: device, dtype, threads.
        load: where models come from (its ``quantize`` must be None).
        quantize_drafter: quantize and save the drafter too.
        force: replace an existing, non-empty ``out``.
        report: measure both pairs and compare them.
        report_tokens: tokens per report run.
        report_prompts: prompts per report (1..5).
    """

    scheme: str
    out: Path
    ref: ModelRef = field(default_factory=ModelRef)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    load: LoadOptions = field(default_factory=LoadOptions)
    quantize_drafter: bool = False
    force: bool = False
    report: bool = False
    report_tokens: int = 64
    report_prompts: int = 3

    def __post_init__(self) -> None:
        get_scheme(self.scheme)
        if self.report_tokens < 1:
            raise ConfigError(f"report tokens must be >= 1, got {self.report_tokens}")
        if not 1 <= self.report_prompts <= 5:
            raise ConfigError(f"report prompts must be in 1..5, got {self.report_prompts}")
        if self.load.quantize:
            raise ConfigError("quantize_pair quantizes by itself; LoadOptions.quantize must be None")


@dataclass(frozen=True)
class QuantizeResult:
    """What ``quantize_pair`` did and measured (sizes in bytes, times in seconds).

    Attributes:
        scheme, library, library_version: how it was quantized.
        device, dtype: where and in which float dtype.
        target, drafter: names of the source models (drafter None without one).
        drafter_dir: folder of the source drafter (None without one).
        out, drafter_out: saved folders (drafter_out None unless the drafter was quantized).
        stored_quantized: the saved weights are quantized tensors (else float, quantized at load).
        disk_before, disk_after: safetensors bytes of the source and saved target folders.
        memory_before, memory_after: target weight bytes in memory.
        drafter_memory_before, drafter_memory_after: the same for a quantized drafter.
        layers_quantized, layers_float: Linear layers quantized / kept in float.
        load_seconds_before, load_seconds_after: time to load the pair, unquantized / saved.
        quantize_seconds, save_seconds: time to quantize and to write the folder.
        reload_max_diff: largest |logit| difference between the reloaded folder and the model
            quantized in memory (0.0: the folder reproduces it exactly).
        report: the comparison (None without ``report``).
    """

    scheme: str
    library: str
    library_version: str | None
    device: str
    dtype: str
    target: str
    drafter: str | None
    drafter_dir: Path | None
    out: Path
    drafter_out: Path | None
    stored_quantized: bool
    disk_before: int
    disk_after: int
    memory_before: int
    memory_after: int
    drafter_memory_before: int | None
    drafter_memory_after: int | None
    layers_quantized: int
    layers_float: int
    load_seconds_before: float
    load_seconds_after: float
    quantize_seconds: float
    save_seconds: float
    reload_max_diff: float
    report: QuantReport | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "report"}
        d["out"] = str(self.out)
        d["drafter_dir"] = str(self.drafter_dir) if self.drafter_dir else None
        d["drafter_out"] = str(self.drafter_out) if self.drafter_out else None
        d["report"] = self.report.to_json() if self.report else None
        return d


MARKER = ".dflash-quantized"  # written into every folder `dflash quantize` saves; --force replaces only those


def _protected(out: Path) -> str | None:
    """Why ``out`` may never be replaced (None: it may be, with a marker and --force)."""
    cwd, home = Path.cwd().resolve(), Path.home().resolve()
    if out == Path(out.anchor):
        return "it is the root folder"
    if out == cwd or out in cwd.parents:
        return "it is the current folder or one of its parents"
    if out == home or out in home.parents:
        return "it is your home folder or one of its parents"
    return None


def _writable_ancestor(path: Path) -> Path:
    """The nearest existing folder at or above ``path``."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _check_out(out: Path, sources: list[Path], force: bool) -> Path:
    """Check ``--out`` before anything loads; returns it resolved (absolute, no ``..``).

    Raises:
        ConfigError: ``out`` overlaps a source, is not a folder, is non-empty without --force, is
            not a folder dflash wrote (no marker) with --force, is protected (cwd, a parent, home,
            root) or cannot be written.
    """
    shown = out
    out = out.expanduser().resolve()
    why = _protected(out)
    if why is not None:
        raise ConfigError(f"--out {shown} cannot be used: {why}; name a new folder such as --out ./quantized")
    for src in sources:
        s = src.resolve()
        if out == s or s in out.parents or out in s.parents:
            raise ConfigError(f"--out {shown} overlaps the model it quantizes ({src}); choose another folder")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {shown} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ConfigError(f"--out {shown} exists and is not empty; pass --force to replace it")
        if not (out / MARKER).is_file():
            raise ConfigError(
                f"--out {shown} is not a folder written by dflash quantize (no {MARKER} file); --force replaces "
                "only those: choose a new or empty folder"
            )
    base = _writable_ancestor(out.parent)
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {shown}: cannot write in {base} (permission denied); choose another folder")
    return out


def _replace_folder(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out``; an old ``out`` (checked: a dflash folder) goes only after."""
    if not out.exists():
        tmp.rename(out)
        return
    if any(out.iterdir()) and not (out / MARKER).is_file():  # re-checked: never delete a foreign folder
        raise ConfigError(f"--out {out} changed while quantizing and is not a dflash folder; nothing was replaced")
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _check_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        device = next(p for p in model.parameters()).device
        return model(input_ids=torch.tensor([ids], device=device)).logits[0].float().cpu()


def _drafter_ref(req: QuantizeRequest, drafter_dir: Path | None, drafter_name: str | None) -> str | None:
    """What the saved target records as its drafter, so that `dflash run --target OUT` finds it."""
    if drafter_dir is None:
        return None
    if req.quantize_drafter:
        return DRAFTER_SUBDIR
    if drafter_dir == embedded.DRAFTER_DIR:
        return "embedded"
    name = drafter_name or str(drafter_dir)
    local = Path(name).expanduser()
    return str(local.resolve()) if local.is_dir() else name  # a Hub id stays an id


def _warm_imports(target_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    quiet_preimport()
    try:
        AutoModelForCausalLM._model_mapping[type(read_target_config(target_dir))]  # imports the modeling module
    except Exception:  # an unsupported config fails properly in load_pipeline
        pass


def _collect() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def quantize_pair(
    req: QuantizeRequest, status: Status | None = None, layers: LayerProgress | None = None
) -> QuantizeResult:
    """Quantize a target (and optionally its drafter), save it, reload it and optionally compare.

    Args:
        req: what to do.
        status: one-line progress messages.
        layers: (done, total) after each quantized layer, for a progress bar.

    Returns:
        Sizes, times, the reload check and the report.

    Raises:
        ConfigError: bad scheme/device/output folder, or an already-quantized input.
        MissingLibraryError: the scheme's library is not installed.
        ModelNotFoundError, ModelLoadError, IncompatibleDraftError: as ``load_pipeline``.
    """
    say = status or (lambda _m: None)
    spec = get_scheme(req.scheme)
    device = resolve_device(req.runtime.device)
    dtype = resolve_dtype(req.runtime.dtype, device, quantized=True)  # as the saved folder reloads
    check_supported(spec, device, dtype)
    pair = resolve_pair(req.ref, req.load, status)
    if req.quantize_drafter and pair.drafter_dir is None:
        raise ConfigError("there is no drafter to quantize; name one with --drafter")
    ensure_float_model(pair.target_dir, "target")
    if req.quantize_drafter and pair.drafter_dir is not None:
        ensure_float_model(pair.drafter_dir, "drafter")
    out = _check_out(req.out, [p for p in (pair.target_dir, pair.drafter_dir) if p is not None], req.force)

    # 2. the unquantized pair (and its measurements); import the model code first so that the two
    #    load times compare loading, not Python imports
    _warm_imports(pair.target_dir)
    # both pairs with the activation dtype the saved folder reloads with (auto: float32 on CPUs
    # without native bf16), so that the report and the reload check compare like with like
    runtime = replace(req.runtime, dtype=dtype_name(dtype))
    base = load_pipeline(req.ref, runtime, req.load, progress=status)
    load_before = base.load_seconds
    prompts = report_prompts(base, req.report_prompts) if req.report else []
    base_report = None
    if req.report:
        say(f"measuring the unquantized pair ({len(prompts)} prompts x {req.report_tokens} tokens)")
        base_report = measure_pair(base, prompts, req.report_tokens)

    # 3. quantize + save into a temporary sibling folder
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model = base.target.model
    source = pair.target_name
    mem_before = weight_bytes(model)
    check_ids = (prompts[0] if prompts else list(range(1, 9)))[:16]
    default_drafter = _drafter_ref(req, pair.drafter_dir, pair.drafter_name)
    d_before = d_after = None
    try:
        save_s = 0.0
        if not spec.stored_quantized:
            say(f"saving float weights to be quantized at load ({spec.name})")
            t = time.perf_counter()
            save_float_for_scheme(model, pair.target_dir, tmp, spec.name, source, default_drafter)
            save_s += time.perf_counter() - t
        if req.quantize_drafter and base.drafter is not None:
            t = time.perf_counter()
            save_drafter_for_scheme(base.drafter, tmp / DRAFTER_SUBDIR, spec.name, base.pair.drafter_name or "")
            save_s += time.perf_counter() - t
        say(f"quantizing {source} ({spec.description})")
        t = time.perf_counter()
        summary = quantize_model_inplace(model, spec.name, device, progress=layers)
        if req.quantize_drafter and base.drafter is not None:
            d_sum = quantize_model_inplace(base.drafter, spec.name, device)
            d_before, d_after = d_sum.bytes_before, d_sum.bytes_after
        quantize_s = time.perf_counter() - t
        if spec.stored_quantized:
            say(f"saving {out}")
            t = time.perf_counter()
            save_quantized_target(model, pair.target_dir, tmp, spec.name, source, default_drafter)
            save_s += time.perf_counter() - t
        reference = _check_logits(model, check_ids)
        (tmp / MARKER).write_text(f"written by dflash quantize ({spec.name}); dflash quantize --force may replace it\n")
        _replace_folder(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    drafter_name = base.pair.drafter_name
    drafter_src = base.pair.drafter_dir
    del model, base  # free the float pair before loading the quantized one
    _collect()

    # 4. reload as `dflash run --target OUT` does
    drafter_out = out / DRAFTER_SUBDIR if req.quantize_drafter else None
    say(f"loading the quantized pair from {out}")
    quant = load_pipeline(
        ModelRef(target=str(out), drafter=None if default_drafter else "none"),  # the recorded drafter
        runtime,
        LoadOptions(models_dir=req.load.models_dir, hf_cache_dir=req.load.hf_cache_dir, offline=True),
        progress=status,
    )
    diff = float((_check_logits(quant.target.model, check_ids) - reference).abs().max())

    # 5. compare
    report = None
    if base_report is not None:
        say("measuring the quantized pair")
        report = compare(base_report, quant, prompts, req.report_tokens)
    result = QuantizeResult(
        scheme=spec.name,
        library=spec.library,
        library_version=library_version(spec.library),
        device=str(device),
        dtype=dtype_name(dtype),
        target=source,
        drafter=drafter_name,
        drafter_dir=drafter_src,
        out=out,
        drafter_out=drafter_out,
        stored_quantized=spec.stored_quantized,
        disk_before=folder_weight_bytes(pair.target_dir),
        disk_after=folder_weight_bytes(out),
        memory_before=mem_before,
        memory_after=summary.bytes_after,
        drafter_memory_before=d_before,
        drafter_memory_after=d_after,
        layers_quantized=summary.quantized,
        layers_float=summary.kept_float,
        load_seconds_before=load_before,
        load_seconds_after=quant.load_seconds,
        quantize_seconds=quantize_s,
        save_seconds=save_s,
        reload_max_diff=diff,
        report=report,
    )
    del quant
    _collect()
    return result
