"""``run_doctor``: every check of ``dflash doctor`` in report order, stopping early where a later
check cannot run (a bad preset, a drafter without a target)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.config import RuntimeConfig
from runtime.doctor import checks as C
from runtime.doctor import memory as M
from runtime.doctor.locate import Located, files_check, locate
from runtime.doctor.memory import MemoryProbe
from runtime.doctor.report import Check, fail
from runtime.errors import ConfigError, DFlashError
from runtime.models import embedded
from runtime.models.footprint import DEFAULT_CONTEXT


def run_doctor(
    ref: Any,
    runtime: RuntimeConfig,
    opts: Any,
    memory_probe: MemoryProbe | None = None,
    speed_file: Path | None = None,
    kernel_file: Path | None = None,
    context: int = DEFAULT_CONTEXT,
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
        context: tokens the memory estimate sizes both KV caches for.

    Returns:
        The checks in report order; any with status "fail" means the pair will not run as asked.
    """
    from runtime.engine.models.drafter_config import read_draft_config
    from runtime.models.configs import read_target_config

    checks: list[Check] = [C.software()]
    dev_check, device = C.device(runtime)
    dtype_check, dtype = C.dtype(runtime, device)
    checks += [dev_check, dtype_check]
    asked: str | None = None  # --quantize, when this device can run it
    if getattr(opts, "quantize", None):
        from runtime.models.quant_schemes import check_supported, get_scheme

        try:
            spec = get_scheme(opts.quantize)
            check_supported(spec, device, dtype)
            checks.append(Check("quantize", "ok", f"{spec.name}: {spec.description}"))
            asked = spec.name
        except DFlashError as e:
            checks.append(fail("quantize", e, "use --quantize int8 or int4 (torchao), or no --quantize"))

    if ref.drafter and ref.drafter != "none" and not ref.target and not ref.preset:
        checks.append(fail("model", ConfigError("--drafter needs --target (or --model PRESET)")))
        return checks
    preset, bad = C.preset_of(ref)
    if bad is not None:
        checks.append(bad)
        return checks
    target_ref = ref.target or (preset.target if preset else None)
    drafter_ref = ref.drafter or (preset.drafter if preset else None)
    if preset is not None:
        t_name = embedded.TARGET_NAME if preset.target == "embedded" else preset.target
        d_name = "the drafter shipped with dflash" if preset.drafter == "embedded" else preset.drafter
        checks.append(Check("model", "info", f"preset {preset.name}: {t_name} + {d_name}"))

    target = locate(str(target_ref), "target", opts)
    checks += target.checks
    if (c := files_check("target", target)) is not None:
        checks.append(c)
    drafter: Located | None = None
    if drafter_ref and drafter_ref != "none":
        drafter = locate(drafter_ref, "drafter", opts)
        checks += drafter.checks
        if (c := files_check("drafter", drafter)) is not None:
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
            checks.append(fail("target", e, "use a causal LM that transformers supports"))
    if drafter is not None and drafter.folder is not None and (drafter.folder / "config.json").exists():
        try:
            draft_cfg = read_draft_config(drafter.folder)
        except DFlashError as e:
            checks.append(fail("drafter", e, "is this a DFlash drafter? see `dflash models --presets`"))
    if target_cfg is not None and draft_cfg is not None:
        checks += C.pair(target_cfg, draft_cfg)
    if target_cfg is not None and target.folder is not None:
        from runtime.models.quantized import read_saved_quantization

        saved = read_saved_quantization(target.folder)
        scheme = asked or (saved.scheme if saved is not None else None)
        estimate = M.estimate(
            device,
            dtype,
            target_cfg,
            target.report.params if target.report is not None else 0,
            draft_cfg,
            drafter.report.params if drafter is not None and drafter.report is not None else 0,
            scheme,
            scheme is not None and not (saved is not None and saved.stored_quantized),
            context,
        )
        checks.append(M.memory_check(device, estimate, memory_probe or M.device_memory))
    if target.folder is not None:
        checks += C.template(target.folder, preset)
    if speed_file is not None and target_cfg is not None:
        checks.append(
            C.speed(speed_file, embedded.TARGET_NAME if target_ref == "embedded" else str(target_ref), device, dtype)
        )
    if kernel_file is not None and device.type == "cpu":
        checks.append(C.kernels(kernel_file))
    from runtime.models.store import hub_cache_dir

    cache = hub_cache_dir(opts.hf_cache_dir)
    checks.append(Check("hub", "info", f"Hugging Face cache: {cache}; dflash models: {opts.models_dir}"))
    return checks
