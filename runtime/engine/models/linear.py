"""Projections of the lean forward: one GEMM per fused group of ``nn.Linear`` layers.

On a CPU, PyTorch's bf16 ``F.linear`` re-lays out the weight for oneDNN on every call; for a
decode step (1-16 rows) that costs more than the multiply itself (and float32 ``F.linear`` goes to
a BLAS whose small-row GEMMs run at half the packed kernel's speed on AVX2 CPUs). ``FusedLinear`` packs the
(concatenated) weight once into oneDNN's blocked layout (``mkldnn._reorder_linear_weight``, the
op torch.compile's CPU backend emits for frozen weights) and calls the packed GEMM
(``mkldnn._linear_pointwise``): same kernel family, same results, several times less time per
call. On CPUs where oneDNN has no native bf16 (AVX2, AVX-512 without BF16: it emulates bf16 GEMMs
several times slower than float32), bf16 weights go to dflash's native bf16 GEMM instead
(``runtime.engine.models.kernels``: the bf16 weights widened to float32 in registers, float32 accumulation,
half float32's bytes read per step). Where neither runs (CUDA, float16) the modules are called as
they are.

int8 weight-only weights (torchao ``Int8Tensor``: int8 values + one scale per output row, what
``--quantize int8`` makes) are fused the same way on a CPU and computed by dflash's native int8 GEMM
(``runtime.engine.models.kernels``: activations rounded per row to 15-bit integers, exact integer dot
products, the int8 weights read directly, a quarter of float32's bytes) or, where it cannot be
built, ATen's ``_weight_int8pack_mm`` (bf16 activations and scales, output rounded to bf16). The
module call (torchao's own linear) de-quantizes the whole weight to the activation dtype on every
call instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from runtime.engine.models.device import cpu_has_fast_bf16


def _plain(t: torch.Tensor | None) -> bool:
    return t is None or type(t.data) is torch.Tensor


def _int8_parts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 values [N, K], per-row scales [N]) of a row-wise int8 weight-only tensor, else None."""
    qdata, scale = getattr(w, "qdata", None), getattr(w, "scale", None)
    if not isinstance(qdata, torch.Tensor) or not isinstance(scale, torch.Tensor):
        return None
    if qdata.dtype != torch.int8 or qdata.dim() != 2 or scale.numel() != qdata.shape[0]:
        return None
    zero = getattr(w, "zero_point", None)
    if getattr(w, "act_quant_kwargs", None) is not None:
        return None  # dynamic activation quantization: not this kernel's math
    if isinstance(zero, torch.Tensor) and bool(zero.any()):
        return None  # asymmetric: not this kernel's math
    return qdata, scale.reshape(-1)


def _native_bf16() -> Any:
    """dflash's bf16 GEMM where oneDNN has no native bf16 on this CPU (else None)."""
    if cpu_has_fast_bf16():
        return None
    from runtime.engine.models.kernels import bf16_gemm

    return bf16_gemm()


def _native_f32() -> Any:
    """dflash's float32 GEMM for decode and verify steps on a CPU (else None: not built here, or
    switched off with ``DFLASH_NATIVE=0``)."""
    from runtime.engine.models.kernels import f32_gemm

    return f32_gemm()


# Float32 steps of at most this many rows run dflash's native GEMM, longer ones (a prompt's prefill)
# the BLAS ``F.linear``. Every decode step and every verify block or tree (at most 65 rows) stays on
# the native kernel, so a row's value never depends on how many rows its step verified.
F32_NATIVE_MAX_ROWS = 128


def f32_project(fn: Any, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A float32 projection: ``fn`` (dflash's float32 GEMM) for a step's rows, the BLAS above
    ``F32_NATIVE_MAX_ROWS`` rows. y [M, N]."""
    if x.shape[0] <= F32_NATIVE_MAX_ROWS:
        y: torch.Tensor = fn(x, w, bias)
        return y
    return nn.functional.linear(x, w, bias)


def int8_kernel_available(device: torch.device) -> bool:
    """Whether ATen's int8 weight-only GEMM runs on ``device`` (CPU builds of torch >= 2.3)."""
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")


class Int8RowWise:
    """A symmetric per-row int8 copy of a float weight (``qdata``, ``scale``: what ``FusedLinear``
    reads of a torchao ``Int8Tensor``), for a layer the quantizer leaves in float (the output head)."""

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        self.qdata = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8)
        self.scale = scale
        self.shape = self.qdata.shape
        self.device = weight.device


class Int8Head:
    """An output head computed with int8 weights (module-like: ``weight``, ``bias``, call)."""

    def __init__(self, linear: Any) -> None:
        self.weight = Int8RowWise(linear.weight)
        self.bias = getattr(linear, "bias", None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        y = (x.float() @ (w.qdata.float() * w.scale[:, None]).T).to(x.dtype)  # the reference math
        return y + self.bias if self.bias is not None else y


class FusedLinear:
    """``len(modules)`` linear layers over the same input, computed as one GEMM.

    Args:
        modules: ``nn.Linear`` layers with the same ``in_features``.
        pack: pack for oneDNN (see ``can_pack``); ignored for weights that are not plain tensors.
        native_f32: float32 weights on a CPU run dflash's native float32 GEMM (where it builds)
            instead of oneDNN's packed one: for steps bound by weight reads (see ``LeanTarget``).
    """

    def __init__(self, modules: Sequence[Any], pack: bool, native_f32: bool = False) -> None:
        self.modules: list[Any] = list(modules)  # nn.Linear or anything with .weight/.bias and a call
        weights = [m.weight for m in self.modules]
        biases = [getattr(m, "bias", None) for m in self.modules]
        self.sizes = [int(w.shape[0]) for w in weights]
        self.packed = pack and all(_plain(w) for w in weights) and all(_plain(b) for b in biases)
        self.bf16: Any = None  # bf16 mode: dflash's native bf16 GEMM (CPUs without oneDNN bf16)
        if self.packed and weights[0].dtype == torch.bfloat16 and weights[0].device.type == "cpu":
            self.bf16 = _native_bf16()
            self.packed = self.bf16 is not None or cpu_has_fast_bf16()
        self.f32: Any = None  # float32 mode: dflash's native float32 GEMM for steps (see F32_NATIVE_MAX_ROWS)
        if native_f32 and self.packed and weights[0].dtype == torch.float32 and weights[0].device.type == "cpu":
            self.f32 = _native_f32()
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None  # int8 mode: per-row scales (bf16)
        parts = [_int8_parts(w) for w in weights]
        self.int8 = (
            all(p is not None for p in parts)
            and all(_plain(b) for b in biases)
            and int8_kernel_available(weights[0].device)
        )
        self.native: Any = None  # int8 mode: the compiled kernel (runtime.engine.models.kernels), else ATen's
        if self.int8:
            from runtime.engine.models.kernels import int8_gemm

            self.native = int8_gemm()
            scale_dtype = torch.float32 if self.native is not None else torch.bfloat16
            with torch.no_grad():
                self.weight = torch.cat([p[0] for p in parts if p is not None]).contiguous()
                self.scale = torch.cat([p[1] for p in parts if p is not None]).to(scale_dtype).contiguous()
                bias = self._cat_bias(biases, self.weight.new_zeros(0, dtype=torch.float32))
                self.bias = bias.float().contiguous() if bias is not None else None
        if self.packed:
            with torch.no_grad():
                w = torch.cat([x.detach() for x in weights]) if len(weights) > 1 else weights[0].detach()
                if self.bf16 is not None or self.f32 is not None:
                    self.weight = w.contiguous()
                    bias = self._cat_bias(biases, w)
                    self.bias = bias.float().contiguous() if bias is not None else None
                else:
                    self.weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1)
                    self.bias = self._cat_bias(biases, w)

    def _cat_bias(self, biases: Sequence[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor | None:
        """The layers' biases concatenated (zeros for layers without), or None if none has one."""
        if all(b is None for b in biases):
            return None
        dtype = next(b.dtype for b in biases if b is not None)
        return torch.cat(
            [
                b.detach() if b is not None else like.new_zeros(n, dtype=dtype)
                for b, n in zip(biases, self.sizes, strict=True)
            ]
        )

    @staticmethod
    def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
        """True where packed GEMMs run: a CPU with oneDNN and float32 weights; bf16 weights where
        oneDNN has native bf16 (AVX512-BF16/AMX) or else dflash's native bf16 kernel builds. Packed
        float32 runs a decode step's small GEMMs about twice as fast as ``F.linear`` on an AVX2 CPU,
        measured (docs/speed.md)."""
        if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return False
        if dtype == torch.bfloat16 and _native_bf16() is not None:
            return True
        if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
            return False
        return dtype == torch.float32 or cpu_has_fast_bf16()

    @staticmethod
    def native_bf16_runs(device: torch.device) -> bool:
        """True where bf16 weights run on dflash's native bf16 GEMM (a CPU without oneDNN bf16 where
        the kernel builds): it takes float32 rows, so float32 activations cost nothing extra there."""
        return device.type == "cpu" and _native_bf16() is not None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Outputs of every layer for input rows ``x`` [T, in_features] -> ([T, out_i], ...)."""
        if torch.compiler.is_compiling() and (self.native is not None or self.bf16 is not None or self.packed):
            return self._traced(x)
        if self.f32 is not None:
            assert self.weight is not None
            y = f32_project(self.f32, x, self.weight, self.bias)
            return tuple(torch.split(y, self.sizes, dim=-1)) if len(self.sizes) > 1 else (y,)
        if self.int8:
            if self.native is not None:
                y = self.native(x, self.weight, self.scale, self.bias).to(x.dtype)
            else:
                y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scale).to(x.dtype)
                if self.bias is not None:
                    y = y + self.bias.to(x.dtype)
            return tuple(y.split(self.sizes, dim=-1)) if len(self.sizes) > 1 else (y,)
        if self.bf16 is not None:
            y = self.bf16(x, self.weight, self.bias).to(x.dtype)
            return tuple(y.split(self.sizes, dim=-1)) if len(self.sizes) > 1 else (y,)
        if self.packed:
            y = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
            return tuple(y.split(self.sizes, dim=-1)) if len(self.sizes) > 1 else (y,)
        return tuple(m(x) for m in self.modules)

    def _traced(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``__call__`` under ``torch.compile``: the same kernels as custom operators
        (``runtime.engine.models.kernels.ops``), which the compiler keeps as opaque calls."""
        ops = torch.ops.dflash
        if self.native is not None:
            y = ops.int8_gemm(x.float().contiguous(), self.weight, self.scale, self.bias).to(x.dtype)
        elif self.bf16 is not None:
            y = ops.bf16_gemm(x.float().contiguous(), self.weight, self.bias).to(x.dtype)
        elif self.f32 is not None:
            y = ops.f32_linear(x.contiguous(), self.weight, self.bias)
        else:
            y = ops.packed_linear(x.contiguous(), self.weight, self.bias, sum(self.sizes))
        return tuple(y.split(self.sizes, dim=-1)) if len(self.sizes) > 1 else (y,)


class PackedLinear(nn.Module):
    """An ``nn.Linear`` computed with its weight packed for oneDNN (inference only).

    The original ``weight``/``bias`` stay registered (state dicts and saving are unchanged); the
    packed copy is used by ``forward``. Built by ``pack_linears``.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._fused = FusedLinear([linear], pack=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] through the packed GEMM."""
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return nn.functional.linear(x, self.weight, self.bias)  # training: keep autograd
        lead = x.shape[:-1]
        (y,) = self._fused(x.reshape(-1, self.in_features))
        return y.view(*lead, self.out_features)


def pack_linears(module: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` inside ``module`` by a ``PackedLinear`` where packing runs.

    Returns:
        How many layers were packed (0 when the device/dtype cannot pack).
    """
    params = list(module.parameters())
    if not params or not FusedLinear.can_pack(params[0].device, params[0].dtype):
        return 0
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and _plain(child.weight) and _plain(child.bias):
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count


def all_linears_packed(module: nn.Module) -> bool:
    """True when ``module`` holds no ``nn.Linear`` that ``pack_linears`` left unpacked."""
    return not any(type(m) is nn.Linear for m in module.modules())


def activations_in(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast the parameters that are not packed projections (norm scales, biases of other layers)
    to ``dtype``, so that a module with packed bf16 projections runs on ``dtype`` activations (the
    packed GEMMs return their input's dtype; the registered bf16 weights stay as they are)."""
    for sub in module.modules():
        if isinstance(sub, PackedLinear | Int8Linear):
            continue
        for name, param in list(sub.named_parameters(recurse=False)):
            if param.is_floating_point() and param.dtype != dtype:
                setattr(sub, name, nn.Parameter(param.detach().to(dtype), requires_grad=False))


class Int8Linear(nn.Module):
    """An ``nn.Linear`` computed with a per-row int8 copy of its weight (inference only; the float
    ``weight``/``bias`` stay registered). Built by ``int8_linears``."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._fused = FusedLinear([Int8Head(linear)], pack=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] through the int8 GEMM."""
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return nn.functional.linear(x, self.weight, self.bias)  # training: keep autograd
        lead = x.shape[:-1]
        (y,) = self._fused(x.reshape(-1, self.in_features))
        return y.view(*lead, self.out_features)


def int8_linears(module: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` inside ``module`` by an ``Int8Linear`` (a drafter beside an
    int8 target: its proposals need not be exact, only cheap; the output stays lossless).

    Returns:
        How many layers were replaced (0 where the int8 kernel does not run).
    """
    params = list(module.parameters())
    if not params or not int8_kernel_available(params[0].device):
        return 0
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and _plain(child.weight) and _plain(child.bias):
                setattr(parent, name, Int8Linear(child))
                count += 1
    return count
