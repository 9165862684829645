"""Device and dtype resolution ("auto" picks sensibly per device)."""

from __future__ import annotations

import torch

from runtime.errors import ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str = "auto") -> torch.device:
    """Map "auto"/"cpu"/"cuda[:N]"/"mps" to an available ``torch.device``. "auto" and "cuda" give
    ``cuda`` without an index: the loader may then spread a target that does not fit one GPU over
    all of them (``runtime.models.placement``); "cuda:N" keeps it on GPU N.

    Raises:
        ConfigError: the device is not available on this machine.
    """
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device {name!r} requested but CUDA is not available (torch {torch.__version__}); use --device cpu"
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise ConfigError(f"device {name!r} does not exist: this machine has {n} GPU(s), cuda:0 to cuda:{n - 1}")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {name!r} requested but MPS is not available; use --device cpu")
    return dev


def cpu_has_fast_bf16() -> bool:
    """True when oneDNN reports native bf16 support (AVX512-BF16 / AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def cpu_bf16_decodes_fast() -> bool:
    """True when bf16 weights decode faster than float32 on this CPU: oneDNN has native bf16, or
    dflash's native bf16 GEMM runs here (AVX2 CPUs: half float32's bytes read per step, at
    float32's arithmetic). Training keeps ``cpu_has_fast_bf16`` (its batched GEMMs need native bf16)."""
    if cpu_has_fast_bf16():
        return True
    from runtime.engine.models import kernels

    return kernels.bf16_gemm() is not None


def resolve_dtype(name: str, device: torch.device, quantized: bool = False) -> torch.dtype:
    """Map a dtype name to a ``torch.dtype``; "auto" = bf16 on CUDA (fp16 without bf16), fp16 on
    MPS, bf16 on CPUs where it decodes faster than float32 (``cpu_bf16_decodes_fast``) and float32
    on others. With ``quantized`` weights (int8/int4: the float dtype is only the activations'),
    "auto" on a CPU is bf16 only where bf16 arithmetic is native: the quantized kernels compute in
    float32 there anyway.

    Raises:
        ConfigError: an unknown name, or float16 on CPU (too slow and inexact there).
    """
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "mps":
            return torch.float16
        fast = cpu_has_fast_bf16() if quantized else cpu_bf16_decodes_fast()
        return torch.bfloat16 if fast else torch.float32
    if name not in _DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
    if name == "float16" and device.type == "cpu":
        raise ConfigError("float16 is not supported on CPU; use --dtype bfloat16 or float32")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """ "bfloat16" for torch.bfloat16 etc."""
    return str(dtype).removeprefix("torch.")


def device_description(device: torch.device) -> str:
    """Human name of the device (GPU model or CPU capability)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple MPS"
    import platform

    cap = torch.backends.cpu.get_cpu_capability()
    return f"{platform.processor() or platform.machine()} CPU ({cap}, {torch.get_num_threads()} threads)"
