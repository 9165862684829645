"""The checked ctypes wrappers of the native GEMMs (int8, q4, bf16 and float32 weights): every tensor handed
to C is checked for dtype, shape and layout first (``ValueError`` otherwise)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

Int8Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
Bf16Gemm = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
Q4Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _f32(name: str, x: torch.Tensor) -> torch.Tensor:
    """The activations ``x`` [M, K] as contiguous float32 rows on the CPU (converted from another
    float dtype or layout)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point() or x.device.type != "cpu":
        raise ValueError(f"{name}: x must be a 2-D float tensor [M, K] on the CPU, {_described(x)}")
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()


def _described(t: object) -> str:
    if not isinstance(t, torch.Tensor):
        return f"got {type(t).__name__}"
    return f"got {str(t.dtype).removeprefix('torch.')} {list(t.shape)} on {t.device}" + (
        "" if t.is_contiguous() else " (not contiguous)"
    )


def _need(name: str, what: str, t: object, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Raise a clear error unless ``t`` is a contiguous CPU tensor of ``dtype`` and ``shape`` (-1:
    any size): the C kernels read raw pointers and trust these."""
    ok = (
        isinstance(t, torch.Tensor)
        and t.dtype == dtype
        and t.device.type == "cpu"
        and t.is_contiguous()
        and t.dim() == len(shape)
        and all(want in (-1, got) for want, got in zip(shape, t.shape, strict=True))
    )
    if not ok:
        dims = ", ".join("?" if d == -1 else str(d) for d in shape)
        kind = str(dtype).removeprefix("torch.")
        raise ValueError(f"{name}: {what} must be a contiguous {kind} tensor [{dims}] on the CPU, {_described(t)}")


def _int8_weights(name: str, w: torch.Tensor, scale: torch.Tensor, k: int) -> None:
    _need(name, "w", w, torch.int8, (-1, k))
    _need(name, "scale", scale, torch.float32, (w.shape[0],))


def _q4_weights(name: str, w: torch.Tensor, sm: torch.Tensor, k: int) -> None:
    if k % 32 != 0:
        raise ValueError(f"{name}: K must be a multiple of 32, got {k}")
    _need(name, "w", w, torch.uint8, (-1, k // 2))
    _need(name, "sm", sm, torch.float16, (w.shape[0], 2 * 8 * ((k // 32 + 7) // 8)))


def _launch(
    name: str,
    c_fn: ctypes._NamedFuncPointer,
    x: torch.Tensor,
    w: torch.Tensor,
    scales: torch.Tensor | None,
    bias: torch.Tensor | None,
    check: Callable[[int], None],
    returns_rc: bool,
) -> torch.Tensor:
    """y [M, N] float32 = x [M, K] . w^T through the C GEMM ``c_fn`` (arguments x, M, K, w, [scales,]
    bias, N, y, threads): ``x`` as float32 rows, ``check(K)`` validates the weights (and scales)
    before any pointer is read; ``returns_rc``: the C function returns 0, or -1 without memory for
    its activation buffer."""
    x = _f32(name, x)
    m, k = x.shape
    check(k)
    n = w.shape[0]
    if bias is not None:
        _need(name, "bias", bias, torch.float32, (n,))
    y = torch.empty((m, n), dtype=torch.float32)
    scale_ptr = () if scales is None else (scales.data_ptr(),)
    bias_ptr = bias.data_ptr() if bias is not None else None
    rc = c_fn(x.data_ptr(), m, k, w.data_ptr(), *scale_ptr, bias_ptr, n, y.data_ptr(), torch.get_num_threads())
    if returns_rc and rc != 0:
        raise MemoryError(f"{name}: no memory for a {m}x{k} activation buffer")
    return y


def _wrap_scaled(
    name: str, check: Callable[[str, torch.Tensor, torch.Tensor, int], None]
) -> Callable[[ctypes._NamedFuncPointer], Int8Gemm]:
    """The wrapper of a GEMM over quantized weights with per-row or per-group scales (int8, q4):
    ``check`` validates the weights and scales for K; the C function returns 0, or -1 without memory
    for its activation buffer."""

    def wrap(c_fn: ctypes._NamedFuncPointer) -> Int8Gemm:
        c_fn.restype = ctypes.c_int
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        c_fn.argtypes = [p, i64, i64, p, p, p, i64, p, ctypes.c_int]

        def gemm(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return _launch(name, c_fn, x, w, scales, bias, lambda k: check(name, w, scales, k), True)

        return gemm

    return wrap


_wrap_int8 = _wrap_scaled("int8 GEMM", _int8_weights)
_wrap_q4: Callable[[ctypes._NamedFuncPointer], Q4Gemm] = _wrap_scaled("q4 GEMM", _q4_weights)


def _wrap_float(weights: torch.dtype, returns_rc: bool = False) -> Callable[[ctypes._NamedFuncPointer], Bf16Gemm]:
    """The wrapper of a GEMM over ``weights`` (bfloat16 or float32) weights (``returns_rc``: the C
    function returns 0, or -1 without memory for its activation buffer)."""
    name = f"{str(weights).removeprefix('torch.')} GEMM"

    def wrap(c_fn: ctypes._NamedFuncPointer) -> Bf16Gemm:
        c_fn.restype = ctypes.c_int if returns_rc else None
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        c_fn.argtypes = [p, i64, i64, p, p, i64, p, ctypes.c_int]

        def gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return _launch(name, c_fn, x, w, None, bias, lambda k: _need(name, "w", w, weights, (-1, k)), returns_rc)

        return gemm

    return wrap
