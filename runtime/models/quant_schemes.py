"""Weight-only quantization of targets and drafters with maintained libraries (never by hand).

Schemes (``SCHEMES``):
  int8      torchao ``Int8WeightOnlyConfig``: per-channel symmetric int8 weights; CPU and CUDA.
  int4      torchao int4 weight-only, asymmetric, groups of 128 input features (64/32 where 128
            does not divide a layer): on CPU the packed layout of aten's
            ``_weight_int4pack_mm_for_cpu`` (torchao ``PrototypeInt4WeightOnlyConfig``), on CUDA
            the tinygemm layout (``Int4WeightOnlyConfig``, bfloat16, compute capability >= 8.0).
  q4        dflash's own 4-bit weights (``runtime.engine.models.q4``): groups of 32 input features,
            asymmetric, a float16 scale and minimum per group (5.0 bits per weight), computed by
            dflash's native q4 kernel (row-independent, like the int8 one); CPU only; no library.
  bnb-int8  bitsandbytes LLM.int8() (``Linear8bitLt``); CUDA only.
  bnb-nf4   bitsandbytes 4-bit NF4 (``Linear4bit``); CUDA only.

Every ``nn.Linear`` is quantized except the output head (``lm_head``): the drafter borrows the
target's head (and embedding, which is not a Linear) to score its drafts, and keeping both in
float is what transformers' torchao integration does too.

Saved folders (what they store and why) are ``runtime.models.quantized``'s business.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runtime.config import DISTRIBUTION
from runtime.errors import ConfigError

INT4_GROUP_SIZES = (128, 64, 32)

LayerProgress = Callable[[int, int], None]
BUILTIN = "dflash"  # the "library" of schemes dflash implements itself (nothing to install)


class MissingLibraryError(ConfigError):
    """The quantization library a scheme needs is not installed (the message has the install command)."""


class AlreadyQuantizedError(ConfigError):
    """The model is already quantized; quantize the float original instead."""


@dataclass(frozen=True)
class Scheme:
    """A weight-only quantization scheme.

    Attributes:
        name: the user-facing name (``--scheme`` / ``--quantize``).
        library: the Python package that does the work.
        bits: bits per quantized weight.
        devices: device types it runs on.
        stored_quantized: True when saved folders hold quantized tensors, False when they hold
            float weights that are quantized at load (see the module docstring).
        install: the command that installs the library.
        description: one line for help texts and summaries.
    """

    name: str
    library: str
    bits: int
    devices: tuple[str, ...]
    stored_quantized: bool
    install: str
    description: str


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme(
            "int8",
            "torchao",
            8,
            ("cpu", "cuda"),
            True,
            f"pip install '{DISTRIBUTION}[quantize]'  (or: pip install torchao)",
            "torchao int8 weight-only, per channel",
        ),
        Scheme(
            "int4",
            "torchao",
            4,
            ("cpu", "cuda"),
            False,
            f"pip install '{DISTRIBUTION}[quantize]'  (or: pip install torchao)",
            "torchao int4 weight-only, groups of 128",
        ),
        Scheme(
            "q4",
            BUILTIN,
            4,
            ("cpu",),
            True,
            "",
            "dflash 4-bit, groups of 32 with float16 scales and minimums (5 bits/weight)",
        ),
        Scheme(
            "bnb-int8",
            "bitsandbytes",
            8,
            ("cuda",),
            False,
            "pip install bitsandbytes",
            "bitsandbytes LLM.int8(), CUDA only",
        ),
        Scheme(
            "bnb-nf4",
            "bitsandbytes",
            4,
            ("cuda",),
            False,
            "pip install bitsandbytes",
            "bitsandbytes 4-bit NF4, CUDA only",
        ),
    )
}


def get_scheme(name: str) -> Scheme:
    """The scheme called ``name``.

    Raises:
        ConfigError: an unknown name (the message lists the known ones).
    """
    scheme = SCHEMES.get(name.strip().lower())
    if scheme is None:
        raise ConfigError(f"unknown quantization scheme {name!r}; use one of {', '.join(SCHEMES)}")
    return scheme


def library_installed(library: str) -> bool:
    """True when ``library`` can be imported (checked without importing it; dflash's own: always)."""
    return library == BUILTIN or importlib.util.find_spec(library) is not None


def library_version(library: str) -> str | None:
    """Installed version of ``library`` (None when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION if library == BUILTIN else library)
    except PackageNotFoundError:
        return None


def check_supported(scheme: Scheme, device: torch.device, dtype: torch.dtype) -> None:
    """Fail early, before any weight is loaded, when ``scheme`` cannot run here.

    Raises:
        ConfigError: the device (or dtype) does not support the scheme.
        MissingLibraryError: the library is not installed.
    """
    if device.type not in scheme.devices:
        if "cuda" in scheme.devices and len(scheme.devices) == 1:
            need = f"needs a CUDA GPU and this run is on {device.type}"
        else:
            need = f"does not run on {device.type} (it runs on {', '.join(scheme.devices)})"
        hint = (
            "; on a CPU use --scheme int8 or int4 (torchao) or q4 (dflash)"
            if device.type == "cpu"
            else "; use --device cpu (on CUDA: --scheme int8 or int4)"
        )
        raise ConfigError(f"quantization scheme {scheme.name} ({scheme.library}) {need}{hint}")
    if scheme.name == "int4" and device.type == "cuda":
        if dtype != torch.bfloat16:
            raise ConfigError("int4 on CUDA runs on bfloat16 activations only; add --dtype bfloat16")
        major, _minor = torch.cuda.get_device_capability(device)
        if major < 8:
            raise ConfigError(
                f"int4 on CUDA needs compute capability 8.0 or newer (this GPU has {major}.x); use --scheme int8"
            )
    if not library_installed(scheme.library):
        raise MissingLibraryError(
            f"quantization scheme {scheme.name} needs the {scheme.library} library, which is not installed; "
            f"install it with: {scheme.install}"
        )


# -- quantizing ------------------------------------------------------------------------------------


@contextmanager
def _quiet_import() -> Iterator[None]:
    """Silence the import-time noise of torchao on CPU-only torch builds (missing CUDA kernels)."""
    names = ("torchao", "torch.utils._pytree")
    levels = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for n, lvl in levels.items():
            logging.getLogger(n).setLevel(lvl)


def quiet_preimport() -> None:
    """Import torchao (when installed) without its import-time warnings.

    transformers imports torchao while loading any model once it is installed; on a CPU-only torch
    build torchao then logs that its CUDA kernels cannot load. Importing it first, quietly, keeps
    stderr clean for the CLI and the TUI.
    """
    if library_installed("torchao"):
        import_torchao()


def import_torchao() -> Any:
    """Import torchao quietly.

    Raises:
        MissingLibraryError: it is not installed (the message has the install command).
    """
    if not library_installed("torchao"):
        raise MissingLibraryError(
            "torchao is not installed; install it with: " + SCHEMES["int8"].install.split("  ")[0]
        )
    with _quiet_import():
        import torchao
        import torchao.quantization

        try:  # what transformers' torchao integration imports (it registers more types)
            import torchao.prototype.safetensors.safetensors_support  # noqa: F401
        except ImportError:
            pass
    return torchao


def quantizable_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` modules a scheme quantizes: all but the output head, still in float."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    out: list[tuple[str, nn.Linear]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module is head:
            continue
        if type(module.weight) not in (nn.Parameter, torch.Tensor) or type(module.weight.data) is not torch.Tensor:
            continue  # already a quantized tensor (torchao subclass, bitsandbytes parameter)
        out.append((name, module))
    return out


def _int4_group(in_features: int) -> int | None:
    return next((g for g in INT4_GROUP_SIZES if in_features % g == 0), None)


def _torchao_config(scheme: str, device: torch.device, in_features: int) -> Any | None:
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig

    if scheme == "int8":
        return Int8WeightOnlyConfig(set_inductor_config=False)
    group = _int4_group(in_features)
    if group is None:
        return None
    if device.type == "cpu":
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        return PrototypeInt4WeightOnlyConfig(group_size=group, set_inductor_config=False)
    from torchao.quantization.quantize_.workflows import Int4PackingFormat

    return Int4WeightOnlyConfig(  # tinygemm: needs no extra kernel package (the plain layout needs mslk)
        group_size=group, int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D, set_inductor_config=False
    )


def _bnb_module(scheme: str, linear: nn.Linear, device: torch.device) -> nn.Module:
    import bitsandbytes as bnb

    bias = linear.bias is not None
    if scheme == "bnb-int8":
        new: nn.Module = bnb.nn.Linear8bitLt(
            linear.in_features, linear.out_features, bias=bias, has_fp16_weights=False, threshold=6.0
        )
    else:
        new = bnb.nn.Linear4bit(
            linear.in_features, linear.out_features, bias=bias, compute_dtype=linear.weight.dtype, quant_type="nf4"
        )
    # bitsandbytes quantizes float weights while moving them from the CPU to the GPU
    new.load_state_dict({k: v.detach().cpu() for k, v in linear.state_dict().items()})
    return new.to(device)


@dataclass(frozen=True)
class QuantizeSummary:
    """What ``quantize_model_inplace`` did.

    Attributes:
        scheme: the scheme applied.
        quantized: Linear layers quantized.
        kept_float: Linear layers left in float (the output head, layers whose width the
            scheme's groups do not divide).
        bytes_before: weight bytes (parameters and buffers) before.
        bytes_after: weight bytes after.
    """

    scheme: str
    quantized: int
    kept_float: int
    bytes_before: int
    bytes_after: int


def quantize_model_inplace(
    model: nn.Module, scheme: str, device: torch.device | str, progress: LayerProgress | None = None
) -> QuantizeSummary:
    """Quantize the Linear weights of ``model`` (on ``device``, or on the CPU: each Linear then
    moves to ``device`` as it is quantized; the rest is ``placement.move_rest``'s job) in place.

    Args:
        model: a transformers causal LM or a DFlash drafter.
        scheme: a name from ``SCHEMES``.
        device: where the model lives (and runs).
        progress: called with (layers handled, layers to handle) after each layer.

    Returns:
        Counts and weight sizes.

    Raises:
        ConfigError, MissingLibraryError: the scheme cannot run on this device or is not installed.
    """
    spec = get_scheme(scheme)
    device = torch.device(device)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    check_supported(spec, device, dtype)
    before = weight_bytes(model)
    all_linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    targets = quantizable_linears(model)
    done = 0
    if spec.library == BUILTIN:
        from runtime.engine.models.q4 import Q4Linear, supports

        for i, (name, linear) in enumerate(targets):
            if supports(linear.in_features):  # whole groups of 32; others stay in float
                model.set_submodule(name, Q4Linear.from_linear(linear))
                done += 1
            if progress:
                progress(i + 1, len(targets))
    elif spec.library == "torchao":
        import_torchao()
        from torchao.quantization import quantize_

        for i, (_name, linear) in enumerate(targets):
            cfg = _torchao_config(spec.name, device, linear.in_features)
            if cfg is not None:
                linear.to(device)  # a model loaded on the CPU comes to the GPU one Linear at a time
                quantize_(linear, cfg)  # a leaf Linear: replaces its weight with a quantized tensor
                done += 1
            if progress:
                progress(i + 1, len(targets))
    else:
        for name, linear in targets:
            model.set_submodule(name, _bnb_module(spec.name, linear, device))
            done += 1
            if progress:
                progress(done, len(targets))
    return QuantizeSummary(spec.name, done, len(all_linears) - done, before, weight_bytes(model))


# -- sizes -----------------------------------------------------------------------------------------


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds, counting the inner tensors of quantized tensor subclasses."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None and type(t) not in (torch.Tensor, nn.Parameter):
        names, _ctx = flatten()
        return sum(tensor_bytes(getattr(t, n)) for n in names if isinstance(getattr(t, n, None), torch.Tensor))
    extra = 0
    state = getattr(t, "quant_state", None)  # bitsandbytes 4-bit statistics
    absmax = getattr(state, "absmax", None)
    if isinstance(absmax, torch.Tensor):
        extra += absmax.numel() * absmax.element_size()
    return t.numel() * t.element_size() + extra


def weight_bytes(model: nn.Module) -> int:
    """Bytes of all parameters and buffers of ``model`` (shared tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += tensor_bytes(t)
    return total


def folder_weight_bytes(folder: Path) -> int:
    """Bytes of the safetensors weight files in ``folder``."""
    return sum(f.stat().st_size for f in folder.glob("*.safetensors") if f.is_file())
