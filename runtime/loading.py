"""Find and load the models of a pair: what ``runtime.pipeline.load_pipeline`` is built from.

``resolve_pair`` turns what the user named (a preset, Hub ids, local folders, or nothing: the
embedded default) into local folders; ``place_target`` decides where the target loads;
``load_target_model`` and ``load_tokenizer`` load it; ``make_target`` wraps it in the forward that
runs it (lean, bucketed or transformers'). ``runtime.pipeline`` re-exports these names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runtime.engine.models.drafter_config import read_draft_config
from runtime.engine.models.lean_target import LeanTarget, lean_supported
from runtime.engine.models.target import TargetModel
from runtime.errors import ConfigError, ModelLoadError, UnsupportedModelError
from runtime.models import embedded, presets
from runtime.models.configs import read_target_config
from runtime.models.hub import resolve_model
from runtime.models.placement import Placement, move_rest, place, sized_for

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ModelRef:
    """What the user named. All None means the embedded default pair.

    Attributes:
        preset: a preset name (``runtime.models.presets``).
        target: Hub id or local folder of the target (overrides the preset's).
        drafter: Hub id or local folder of the drafter (overrides the preset's); "none" for no drafter.
    """

    preset: str | None = None
    target: str | None = None
    drafter: str | None = None


@dataclass(frozen=True)
class LoadOptions:
    """Where models come from.

    Attributes:
        models_dir: dflash's own model folder (the embedded target is converted there).
        hf_cache_dir: Hugging Face cache (None: huggingface_hub's default).
        offline: never use the network.
        revision: Hub revision for both models.
        token: Hub token (gated repos).
        quantize: on-the-fly weight-only quantization scheme for the target (None: off).
    """

    models_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "dflash" / "models")
    hf_cache_dir: Path | None = None
    offline: bool = False
    revision: str | None = None
    token: str | None = None
    quantize: str | None = None


@dataclass(frozen=True)
class ResolvedPair:
    """Folders of a pair plus the names to show."""

    target_dir: Path
    drafter_dir: Path | None
    target_name: str
    drafter_name: str | None
    thinking: bool = False


def _preset_for_target(target: str) -> presets.Preset | None:
    for p in presets.PRESETS.values():
        if p.target.lower() == target.lower():
            return p
    return None


def resolve_pair(ref: ModelRef, opts: LoadOptions, progress: Progress | None = None) -> ResolvedPair:
    """Turn a ``ModelRef`` into local folders, downloading Hub models when allowed.

    Raises:
        ModelNotFoundError: an unknown preset, folder or repo, or a missing embedded model.
        ConfigError: a drafter without a target.
    """
    if ref.drafter and ref.drafter != "none" and not ref.target and not ref.preset:
        raise ConfigError("--drafter needs --target (or --model PRESET): a drafter only works with its target")
    preset = presets.get_preset(ref.preset) if ref.preset else None
    if preset is None and ref.target:
        preset = _preset_for_target(ref.target)
    if preset is None and not ref.target:
        preset = presets.get_preset(presets.EMBEDDED)
    target = ref.target or (preset.target if preset else None)
    drafter = ref.drafter or (preset.drafter if preset else None)
    if drafter is None and ref.target:
        from runtime.models.quantized import recorded_drafter

        drafter = recorded_drafter(ref.target)  # a `dflash quantize` folder remembers its drafter
    assert target is not None

    def hub(name: str, kind: str) -> Path:
        return resolve_model(
            name, kind, cache_dir=opts.hf_cache_dir, revision=opts.revision, offline=opts.offline, token=opts.token
        )

    if target == "embedded":
        target_dir = embedded.require_embedded_target(opts.models_dir, progress)
        target_name = embedded.TARGET_NAME
    else:
        target_dir = hub(target, "target")
        target_name = target
    drafter_dir: Path | None = None
    drafter_name: str | None = None
    if drafter == "embedded":
        drafter_dir, drafter_name = embedded.embedded_drafter_dir(), "dflash/" + embedded.DRAFTER_DIR.name
    elif drafter and drafter != "none":
        drafter_dir, drafter_name = hub(drafter, "drafter"), drafter
    thinking = bool(preset.thinking) if preset else False
    return ResolvedPair(target_dir, drafter_dir, target_name, drafter_name, thinking)


def load_target_model(
    target_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    attn: str = "sdpa",
    quantize: str | None = None,
    placement: Placement | None = None,
    progress: Progress | None = None,
) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` with clear errors (no remote code, local files only),
    placed by ``runtime.models.placement`` (straight onto the device, spread over GPUs, or on the
    CPU and quantized Linear by Linear onto the GPU) and quantized as the folder records or as
    ``quantize`` asks."""
    from transformers import AutoModelForCausalLM

    from runtime.models.quantized import apply_saved_quantization, load_q4_folder, prepare_saved_load, stored_by_dflash

    saved = prepare_saved_load(target_dir, device, dtype)  # a `dflash quantize` folder: can it run here?
    if stored_by_dflash(saved):
        return load_q4_folder(target_dir, device, dtype, attn)  # dflash's own q4 layers: not transformers'
    if placement is None:
        placement = place(device, bool(quantize) or (saved is not None and not saved.stored_quantized))
    if progress and placement.note:
        progress(placement.note)
    kw: dict[str, Any] = {"dtype": dtype, "local_files_only": True, "trust_remote_code": False}
    if attn:
        kw["attn_implementation"] = attn
    if placement.device_map is not None:
        kw["device_map"] = placement.device_map  # accelerate: each shard straight onto its device
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(str(target_dir), **kw)
    except torch.OutOfMemoryError:
        raise
    except ValueError as e:
        msg = str(e).splitlines()[0]
        if "Unrecognized" in msg or "not supported" in msg or "does not support" in msg:
            raise UnsupportedModelError(f"cannot load target {target_dir} as a causal LM: {msg}") from e
        raise ModelLoadError(f"cannot load target {target_dir}: {msg}") from e
    except Exception as e:  # safetensors/OS errors for truncated or corrupt files
        raise ModelLoadError(
            f"cannot load target weights from {target_dir}: {str(e).splitlines()[0] if str(e) else type(e).__name__}; "
            "the files may be truncated or corrupt: re-download them"
        ) from e
    apply_saved_quantization(model, target_dir, device)  # schemes stored as float weights
    if quantize:
        from runtime.models.quant_schemes import quantize_model_inplace

        if progress:
            progress(f"quantizing {target_dir.name} ({quantize})")
        quantize_model_inplace(model, quantize, device)
    if placement.device_map is None and device.type != "cpu":
        move_rest(model, device)  # what quantizing left on the CPU (embedding, norms, head)
    return model.eval()


def load_tokenizer(target_dir: Path) -> Any | None:
    """The target's tokenizer, or None when the folder has none (e.g. test fixtures)."""
    if not any((target_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True, trust_remote_code=False)
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer in {target_dir}: {str(e).splitlines()[0]}") from e


def make_target(model: Any, engine: str = "auto", progress: Progress | None = None) -> TargetModel:
    """Wrap a loaded causal LM: the lean forward where it runs (``runtime.engine.models.lean_target``),
    else transformers' own.

    Raises:
        ConfigError: ``engine="lean"`` for a model the lean forward cannot run.
    """
    if engine == "hf":
        return TargetModel(model)
    why = lean_supported(model)
    if why is None:
        cuda = next(model.parameters()).device.type == "cuda"
        if engine == "bucketed" or (engine == "auto" and cuda):
            from runtime.engine.models.bucketed_target import BucketedTarget

            return BucketedTarget(model)  # the capturable step (docs/decoding.md, "On a GPU")
        return LeanTarget(model)
    if engine in ("lean", "bucketed"):
        raise ConfigError(f"--engine {engine} cannot run this target: {why}; use --engine hf")
    if progress:
        progress(f"transformers forward for this target ({why})")
    return TargetModel(model)


def place_target(
    pair: ResolvedPair, device: torch.device, dtype: torch.dtype, quantize: str | None, saved: Any
) -> Placement:
    """Where the pair's target loads (``runtime.models.placement``): its layers and KV cache at
    ``DEFAULT_CONTEXT`` tokens, and the drafter with its cache on the first GPU, against each GPU's
    free memory (sized only where a split is possible: several GPUs, ``cuda`` without an index)."""
    quantize_at_load = bool(quantize) or (saved is not None and saved.scheme is not None and not saved.stored_quantized)
    if quantize_at_load or device.type != "cuda" or device.index is not None or torch.cuda.device_count() < 2:
        return place(device, quantize_at_load)
    from runtime.models.footprint import DEFAULT_CONTEXT, drafter_kv_bytes
    from runtime.models.quant_schemes import folder_weight_bytes

    weights = sized_for(read_target_config(pair.target_dir), dtype, DEFAULT_CONTEXT)
    extra = 0
    if pair.drafter_dir is not None:
        item = torch.empty((), dtype=dtype).element_size()
        extra = folder_weight_bytes(pair.drafter_dir) + drafter_kv_bytes(
            read_draft_config(pair.drafter_dir), DEFAULT_CONTEXT, item
        )
    return place(device, False, weights, extra)
