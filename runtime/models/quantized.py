"""Folders written by `dflash quantize`: record the scheme, detect it, load and save.

config.json records the scheme under ``dflash_quantization`` (scheme, library and version, bits,
float dtype, whether the weights on disk are quantized, the source model). How the weights are
stored depends on what is portable (see ``runtime.models.quant_schemes``):

* int8: quantized, in torchao's safetensors format, written and read by transformers
  (``save_pretrained`` with its torchao quantizer attached / ``from_pretrained``). Any
  transformers + torchao install loads such a folder already quantized, on CPU or CUDA.
* q4 (dflash's own 4-bit format): quantized, as the ``Q4Linear`` buffers (``qweight`` uint8,
  ``scales`` and ``mins`` float16, see ``runtime.engine.models.q4``) in one safetensors file beside
  the float tensors (embedding, norms, biases, and the head unless it is tied to the embedding);
  ``load_q4_folder`` builds the model from config.json without allocating float weights for the
  quantized layers and reads them back (transformers alone cannot: the layers are dflash's).
* int4, bnb-int8, bnb-nf4: float weights, quantized when the folder is loaded, because no stored
  form would be both compact and portable: torchao's CPU int4 layout (for aten's
  ``_weight_int4pack_mm_for_cpu``) is opaque and cannot be serialized, its CUDA int4 layout does not
  run on a CPU, and bitsandbytes quantizes while moving weights onto the GPU. Quantizing is
  deterministic, so such a folder loads to exactly what on-the-fly ``--quantize`` gives.

Drafters are small and always stored in float with their scheme recorded.
A folder with a foreign ``quantization_config`` (GPTQ, AWQ, FP8, ...) counts as already quantized.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runtime.errors import ConfigError, ModelLoadError
from runtime.models.quant_schemes import (
    BUILTIN,
    SCHEMES,
    AlreadyQuantizedError,
    Scheme,
    check_supported,
    get_scheme,
    import_torchao,
    library_version,
    quantize_model_inplace,
    quiet_preimport,
)

QUANT_KEY = "dflash_quantization"


# -- reading what a folder holds -------------------------------------------------------------------


@dataclass(frozen=True)
class SavedQuantization:
    """What a model folder says about its own quantization.

    Attributes:
        scheme: a dflash scheme name, or None for a foreign quantization (GPTQ, AWQ, FP8, ...).
        stored_quantized: the weights on disk are already quantized.
        method: a short description ("int8", or the ``quant_method`` of a foreign config).
    """

    scheme: str | None
    stored_quantized: bool
    method: str


def read_saved_quantization(folder: Path) -> SavedQuantization | None:
    """The quantization recorded in ``folder/config.json`` (None: a float model or no config)."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(raw, dict):
        return None
    ours = raw.get(QUANT_KEY)
    if isinstance(ours, dict) and ours.get("scheme"):
        name = str(ours["scheme"])
        return SavedQuantization(name, bool(ours.get("stored_quantized")), name)
    foreign = raw.get("quantization_config")
    if isinstance(foreign, dict):
        return SavedQuantization(None, True, str(foreign.get("quant_method", "unknown method")))
    return None


def ensure_float_model(folder: Path, what: str = "target") -> None:
    """Raise when ``folder`` already holds a quantized model.

    Raises:
        AlreadyQuantizedError: naming the recorded scheme or method.
    """
    saved = read_saved_quantization(folder)
    if saved is not None:
        raise AlreadyQuantizedError(
            f"the {what} in {folder} is already quantized ({saved.method}); use it as it is, or quantize "
            "the original float model"
        )


def prepare_saved_load(folder: Path, device: torch.device, dtype: torch.dtype) -> SavedQuantization | None:
    """Check, before loading weights, that a dflash-quantized folder can load here.

    Returns:
        The recorded quantization (None for a float model or a foreign quantization, which
        transformers handles itself).

    Raises:
        ConfigError, MissingLibraryError: the device or the installed libraries cannot run it.
        ModelLoadError: the recorded scheme is unknown (a folder from a newer dflash).
    """
    quiet_preimport()
    saved = read_saved_quantization(folder)
    if saved is None or saved.scheme is None:
        return None
    if saved.scheme not in SCHEMES:
        raise ModelLoadError(
            f"{folder} is quantized with scheme {saved.scheme!r}, which this dflash does not know; upgrade dflash"
        )
    check_supported(SCHEMES[saved.scheme], device, dtype)
    if saved.stored_quantized and SCHEMES[saved.scheme].library == "torchao":
        import_torchao()  # transformers needs it to read the quantized tensors
    return saved


def stored_by_dflash(saved: SavedQuantization | None) -> bool:
    """Whether a folder holds weights in one of dflash's own formats (``load_q4_folder`` reads them)."""
    return (
        saved is not None
        and saved.stored_quantized
        and saved.scheme in SCHEMES
        and SCHEMES[saved.scheme].library == BUILTIN
    )


def check_quantize_request(scheme: str, target_dir: Path, device: torch.device, dtype: torch.dtype) -> Scheme:
    """Validate on-the-fly quantization (``LoadOptions.quantize``) before any weight is loaded.

    Raises:
        ConfigError: unknown scheme, or one this device cannot run.
        AlreadyQuantizedError: the target folder is already quantized.
        MissingLibraryError: the library is not installed.
    """
    spec = get_scheme(scheme)
    ensure_float_model(target_dir)
    check_supported(spec, device, dtype)
    return spec


def recorded_drafter(target: str) -> str | None:
    """The drafter `dflash quantize` recorded for a saved target folder (None: none recorded).

    A subfolder name (the quantized drafter saved next to the target) becomes its full path;
    anything else (Hub id, absolute folder, "embedded") is returned as recorded.
    """
    folder = Path(target).expanduser()
    if not folder.is_dir():
        return None
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    rec = raw.get(QUANT_KEY) if isinstance(raw, dict) else None
    drafter = rec.get("drafter") if isinstance(rec, dict) else None
    if not isinstance(drafter, str) or not drafter:
        return None
    local = folder / drafter
    return str(local) if "/" not in drafter and local.is_dir() else drafter


def apply_saved_quantization(model: nn.Module, folder: Path, device: torch.device) -> SavedQuantization | None:
    """After loading a folder's (float) weights, quantize them as its config records.

    Folders stored quantized come out of ``from_pretrained`` already quantized; this is a no-op
    for them and for float models.
    """
    saved = read_saved_quantization(folder)
    if saved is not None and saved.scheme in SCHEMES and not saved.stored_quantized:
        quantize_model_inplace(model, saved.scheme, device)
    return saved


# -- saving ----------------------------------------------------------------------------------------

_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.pt", "*.pth", "*.gguf", "config.json")


def _copy_side_files(src: Path, dst: Path) -> None:
    """Copy tokenizer, chat template, generation config, licence... (everything but weights and config)."""
    skip = {p.name for pattern in _WEIGHT_FILES for p in src.glob(pattern)}
    for f in src.iterdir():
        if f.is_file() and f.name not in skip and not (dst / f.name).exists():
            shutil.copy2(f, dst / f.name)


def _record(
    config_path: Path,
    scheme: Scheme,
    stored_quantized: bool,
    dtype: torch.dtype,
    source: str,
    drafter: str | None = None,
) -> None:
    raw = json.loads(config_path.read_text())
    raw[QUANT_KEY] = {
        "scheme": scheme.name,
        "library": scheme.library,
        "library_version": library_version(scheme.library),
        "bits": scheme.bits,
        "stored_quantized": stored_quantized,
        "dtype": str(dtype).removeprefix("torch."),
        "source": source,
        "skipped": ["lm_head"],
    }
    if drafter:
        raw[QUANT_KEY]["drafter"] = drafter
    config_path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def save_float_for_scheme(
    model: nn.Module, src: Path, out: Path, scheme: str, source: str, drafter: str | None = None
) -> None:
    """Save a float target that is quantized at load (int4, bitsandbytes): weights + recorded scheme.

    Call it before quantizing ``model`` in place. ``drafter`` (a Hub id, folder, "embedded", or a
    subfolder name of ``out``) becomes the folder's default drafter (``recorded_drafter``).
    """
    spec = get_scheme(scheme)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))  # type: ignore[operator]
    _copy_side_files(src, out)
    _record(out / "config.json", spec, False, dtype, source, drafter)


def save_quantized_target(
    model: nn.Module, src: Path, out: Path, scheme: str, source: str, drafter: str | None = None
) -> None:
    """Save a target quantized in place with int8 in torchao's safetensors format.

    transformers writes the tensors (``save_pretrained`` with its torchao quantizer attached, as
    ``from_pretrained(quantization_config=TorchAoConfig(...))`` would have) and reads them back.
    """
    spec = get_scheme(scheme)
    if not spec.stored_quantized:
        raise ConfigError(f"scheme {scheme} is stored as float weights; use save_float_for_scheme")
    if spec.library == BUILTIN:
        _save_q4(model, src, out, spec, source, drafter)
        return
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig
    from transformers.quantizers import AutoHfQuantizer

    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    qc = TorchAoConfig(Int8WeightOnlyConfig(set_inductor_config=False))
    model.hf_quantizer = AutoHfQuantizer.from_config(qc, pre_quantized=False)
    model.config.quantization_config = qc  # type: ignore[union-attr]
    try:
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(out))  # type: ignore[operator]
    finally:
        model.hf_quantizer = None  # type: ignore[assignment]
        del model.config.quantization_config  # type: ignore[union-attr]
    _copy_side_files(src, out)
    _record(out / "config.json", spec, True, dtype, source, drafter)


def save_drafter_for_scheme(drafter: Any, out: Path, scheme: str, source: str) -> None:
    """Save a float drafter with its scheme recorded; it is quantized when the pipeline loads it.

    Drafters are small (tens of MB), so they are kept in float on disk whatever the scheme.
    """
    from runtime.engine.models.drafter_io import save_draft_model

    spec = get_scheme(scheme)
    dtype = next(p.dtype for p in drafter.parameters() if p.is_floating_point())
    save_draft_model(drafter, out)
    _record(out / "config.json", spec, False, dtype, source)


# -- dflash's own q4 folders -----------------------------------------------------------------------

Q4_FILE = "model.safetensors"


def _save_q4(model: nn.Module, src: Path, out: Path, spec: Scheme, source: str, drafter: str | None) -> None:
    """Write a model quantized in place with q4: its state dict (``Q4Linear`` buffers and the float
    tensors; a head tied to the embedding is stored once, as the embedding) and config.json."""
    from safetensors.torch import save_file

    from runtime.engine.models.q4 import Q4Linear

    if not any(isinstance(m, Q4Linear) for m in model.modules()):
        raise ConfigError("nothing to save in q4: no layer of this model was quantized")
    cfg: Any = getattr(model, "config", None)
    state = model.state_dict()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    embed = getattr(model, "get_input_embeddings", lambda: None)()
    if head is not None and embed is not None and head.weight is embed.weight:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}  # tied: tie_weights restores it
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, str(out / Q4_FILE), metadata={"format": "pt", "dflash_quantization": spec.name})
    cfg.save_pretrained(str(out))
    _copy_side_files(src, out)
    _record(out / "config.json", spec, True, dtype, source, drafter)


class _ParamsOnMeta:
    """Create parameters on the meta device (no memory, no initialisation) and buffers as usual
    (rotary tables and other non-persistent buffers are computed, not stored), while a model is built."""

    def __enter__(self) -> None:
        self._register = nn.Module.register_parameter
        register = self._register

        def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            register(module, name, param)
            if param is not None and param.device.type != "meta":
                p = module._parameters[name]
                assert p is not None
                module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

        nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]

    def __exit__(self, *exc: object) -> None:
        nn.Module.register_parameter = self._register  # type: ignore[method-assign]


def load_q4_folder(folder: Path, device: torch.device, dtype: torch.dtype, attn: str = "sdpa") -> Any:
    """Load a folder saved with the q4 scheme: the model built from its config.json, its linear
    layers replaced by ``Q4Linear`` where the file holds q4 tensors, every tensor read from the file.

    Raises:
        ModelLoadError: missing, unreadable or mismatched tensors (a damaged or foreign folder).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from runtime.engine.models.drafter_io import read_safetensors
    from runtime.engine.models.q4 import Q4Linear

    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read the config of {folder}: {str(e).splitlines()[0]}") from e
    state = read_safetensors(folder)
    kw: dict[str, Any] = {"dtype": dtype}
    if attn:
        kw["attn_implementation"] = attn
    with _ParamsOnMeta():
        model: Any = AutoModelForCausalLM.from_config(config, **kw)
    for key in [k for k in state if k.endswith(".qweight")]:
        name = key.removesuffix(".qweight")
        try:
            old = model.get_submodule(name)
        except AttributeError:
            old = None
        if not isinstance(old, nn.Linear):
            raise ModelLoadError(f"{folder}: q4 tensors for {name}, which is not a linear layer of this model")
        model.set_submodule(name, Q4Linear(old.in_features, old.out_features, old.bias is not None, dtype))
    for k, v in state.items():
        if v.is_floating_point() and not k.endswith((".scales", ".mins")):
            state[k] = v.to(dtype)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # shapes that do not match the config
        raise ModelLoadError(f"{folder}: its tensors do not fit its config.json: {str(e).splitlines()[-1]}") from e
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" in missing:
        model.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        what = f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(unexpected[:3])}"
        raise ModelLoadError(f"{folder}: its weights do not match its config.json ({what})")
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise ModelLoadError(f"{folder}: no weights for {', '.join(left[:3])}")
    return model.to(device).eval()
