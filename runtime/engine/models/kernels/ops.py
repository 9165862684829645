"""The native GEMMs (and oneDNN's prepacked GEMM) as PyTorch custom operators, so that
``torch.compile`` traces a step through them: each stays one opaque call while inductor fuses the
norms, rotary embedding, activations and residual adds around it. Eager code calls the kernels
directly (a dispatcher round trip per GEMM costs more than it saves there)."""

from __future__ import annotations

import torch

from runtime.engine.models import kernels


@torch.library.custom_op("dflash::int8_gemm", mutates_args=())
def int8_gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """dflash's int8 GEMM (``kernels.int8_gemm``): y [M, N] float32."""
    fn = kernels.int8_gemm()
    assert fn is not None
    return fn(x, w, scale, bias)


@int8_gemm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)


@torch.library.custom_op("dflash::q4_gemm", mutates_args=())
def q4_gemm(x: torch.Tensor, w: torch.Tensor, sm: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """dflash's 4-bit GEMM (``kernels.q4_gemm``): y [M, N] float32."""
    fn = kernels.q4_gemm()
    assert fn is not None
    return fn(x, w, sm, bias)


@q4_gemm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, sm: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)


@torch.library.custom_op("dflash::bf16_gemm", mutates_args=())
def bf16_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """dflash's bf16-weight GEMM (``kernels.bf16_gemm``): y [M, N] float32."""
    fn = kernels.bf16_gemm()
    assert fn is not None
    return fn(x, w, bias)


@bf16_gemm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)


@torch.library.custom_op("dflash::bf16dp_gemm", mutates_args=())
def bf16dp_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """dflash's AVX-512-BF16 bf16-weight GEMM (``kernels.bf16dp_gemm``): y [M, N] float32."""
    fn = kernels.bf16dp_gemm()
    assert fn is not None
    return fn(x, w, bias)


@bf16dp_gemm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)


@torch.library.custom_op("dflash::bf16amx_gemm", mutates_args=())
def bf16amx_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """dflash's AMX bf16-weight GEMM (``kernels.bf16amx_gemm``): y [M, N] float32."""
    fn = kernels.bf16amx_gemm()
    assert fn is not None
    return fn(x, w, bias)


@bf16amx_gemm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)


@torch.library.custom_op("dflash::f32_linear", mutates_args=())
def f32_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A float32 projection as ``FusedLinear`` computes it (``kernels.f32_project``: dflash's native
    GEMM for a step's rows, the BLAS for a longer prefill). y [M, N] float32."""
    fn = kernels.f32_gemm()
    assert fn is not None
    return kernels.f32_project(fn, x, w, bias)


@f32_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)


@torch.library.custom_op("dflash::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """oneDNN's GEMM over a prepacked weight (``mkldnn._reorder_linear_weight``): y [M, n]."""
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], n))
