"""Projections of the lean forward: one GEMM per fused group of ``nn.Linear`` layers.

On a CPU, PyTorch's bf16 ``F.linear`` re-lays out the weight for oneDNN on every call; for a
decode step (1-16 rows) that costs more than the multiply itself (and float32 ``F.linear`` goes to
a BLAS whose small-row GEMMs run at half the packed kernel's speed on AVX2 CPUs). ``FusedLinear`` packs the
(concatenated) weight once into oneDNN's blocked layout (``mkldnn._reorder_linear_weight``, the
op torch.compile's CPU backend emits for frozen weights) and calls the packed GEMM
(``mkldnn._linear_pointwise``): same kernel family, same results, several times less time per
call. bf16 weights on a CPU take one of four paths (``current_bf16_path``): dflash's native bf16
GEMM (``runtime.engine.models.kernels``: the bf16 weights widened to float32 in registers, float32
activations and accumulation, half float32's bytes read per step), its AVX-512-BF16 GEMM
(``vdpbf16ps``, activations rounded per row to bf16) where the CPU has it, its AMX GEMM
(``tdpbf16ps`` tiles, the same rounding) where AMX runs, or oneDNN's packed GEMM
with bf16 activations where oneDNN has native bf16. A bf16 target's path is chosen by measurement at
its first load on a machine (``choose_bf16``: the fastest that computes a verify row exactly as a
one-token row; ``runtime.engine.models.kernels.choice``); without one, oneDNN's where the CPU has native
bf16, else dflash's (oneDNN emulates bf16 several times slower than float32 there). Where nothing
runs (CUDA, float16) the modules are called as they are.

int8 weight-only weights (torchao ``Int8Tensor``: int8 values + one scale per output row, what
``--quantize int8`` makes) are fused the same way on a CPU and computed by dflash's native int8 GEMM
(``runtime.engine.models.kernels``: activations rounded per row to 15-bit integers, exact integer dot
products, the int8 weights read directly, a quarter of float32's bytes) or, where it cannot be
built, ATen's ``_weight_int8pack_mm`` (bf16 activations and scales, output rounded to bf16). The
module call (torchao's own linear) de-quantizes the whole weight to the activation dtype on every
call instead.

Unpacked plain weights (CUDA, and CPUs where nothing packs) are fused too: one concatenated
weight per group (the layers' weights become views into it, no extra memory), one ``F.linear``,
split outputs: q/k/v and gate/up run as one GEMM each instead of three and two.

q4 weights (``Q4Linear``, ``--quantize q4``: 4-bit values in groups of 32 with float16 scales and
minimums, ``runtime.engine.models.q4``) are fused the same way and computed by dflash's native q4
GEMM (row-independent like the int8 one) or, where it does not run, by the de-quantized float32 product.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from runtime.engine.models import kernels
from runtime.engine.models.device import cpu_has_fast_bf16
from runtime.engine.models.int8_head import Int8Head as Int8Head  # re-exported (lean_target, draft_head)
from runtime.engine.models.int8_head import Int8RowWise as Int8RowWise


def _plain(t: torch.Tensor | None) -> bool:
    return t is None or type(getattr(t, "data", None)) is torch.Tensor  # q4 weights (Q4Weight) have no .data


def _q4_parts(w: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(packed 4-bit values [N, K/2], the kernel's scales and minimums) of a ``Q4Linear`` weight, else None."""
    from runtime.engine.models.q4 import Q4Weight, kernel_sm

    if not isinstance(w, Q4Weight):
        return None
    return w.qweight.contiguous(), kernel_sm(w.scales, w.mins)


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


# The bf16 paths (``runtime.engine.models.kernels.choice.PATHS``): dflash's kernels take float32 activations
# (the AVX-512-BF16 one rounds them to bf16 itself), oneDNN's packed GEMM bf16 activations.
DFLASH_BF16_PATHS = ("dflash-avx2", "dflash-avx512bf16", "dflash-amx")
# Each of dflash's bf16 paths: its GEMM (the name of the ``kernels`` getter and of the
# ``torch.ops.dflash`` custom operator alike) and the weights' kind in ``kernels.Proj`` (native layers).
_BF16_GEMMS = {
    "dflash-avx2": ("bf16_gemm", 0),
    "dflash-avx512bf16": ("bf16dp_gemm", 3),
    "dflash-amx": ("bf16amx_gemm", 5),
}
ONEDNN_BF16 = "onednn-bf16"
_process: dict[str, str | None] = {}  # "bf16": the path this process chose (choose_bf16)


def bf16_candidates() -> list[str]:
    """The bf16 paths that run on this CPU: dflash's float32-activation kernel where the native
    kernels build; its AVX-512-BF16 kernel and oneDNN's packed bf16 GEMM where the CPU has native
    bf16 (oneDNN says so, and for the former cpuid reports AVX-512-BF16 too)."""
    from runtime.engine.models import kernels

    out = []
    if kernels.bf16_gemm() is not None:
        out.append("dflash-avx2")
    if cpu_has_fast_bf16():
        if kernels.bf16dp_gemm() is not None:
            out.append("dflash-avx512bf16")
        if kernels.bf16amx_gemm() is not None:
            out.append("dflash-amx")
        if torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
            out.append(ONEDNN_BF16)
    return out


def current_bf16_path() -> str | None:
    """The bf16 path new projections take: the one this process chose by measurement
    (``choose_bf16``), else oneDNN's where the CPU has native bf16 and dflash's float32-activation
    kernel where it does not (None: neither runs here)."""
    chosen = _process.get("bf16")
    if chosen is not None and chosen in bf16_candidates():
        return chosen
    if cpu_has_fast_bf16():
        return ONEDNN_BF16 if torch.backends.mkldnn.is_available() else None  # type: ignore[no-untyped-call]
    from runtime.engine.models import kernels

    return "dflash-avx2" if kernels.bf16_gemm() is not None else None


def _bf16_kernel(path: str | None) -> Any:
    """dflash's GEMM of a bf16 path (None for oneDNN's, or where it does not run)."""
    from runtime.engine.models import kernels

    if path not in _BF16_GEMMS:
        return None
    return getattr(kernels, _BF16_GEMMS[path][0])()


def _native_bf16() -> Any:
    """dflash's bf16 GEMM where new projections run one (see ``current_bf16_path``), else None."""
    return _bf16_kernel(current_bf16_path())


def _native_f32() -> Any:
    """dflash's float32 GEMM for decode and verify steps on a CPU (else None: not built here, or
    switched off with ``DFLASH_NATIVE=0``)."""
    from runtime.engine.models.kernels import f32_gemm

    return f32_gemm()


def int8_kernel_available(device: torch.device) -> bool:
    """Whether ATen's int8 weight-only GEMM runs on ``device`` (CPU builds of torch >= 2.3)."""
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")


class FusedLinear:
    """``len(modules)`` linear layers over the same input, computed as one GEMM.

    Args:
        modules: ``nn.Linear`` layers with the same ``in_features``.
        pack: pack for oneDNN (see ``can_pack``); ignored for weights that are not plain tensors.
        native_f32: float32 weights on a CPU run dflash's native float32 GEMM (where it builds)
            instead of oneDNN's packed one: for steps bound by weight reads (see ``LeanTarget``).
        bf16_path: the path of packed bf16 weights on a CPU (``DFLASH_BF16_PATHS`` or
            ``ONEDNN_BF16``); None: the process's (``current_bf16_path``).
    """

    def __init__(
        self, modules: Sequence[Any], pack: bool, native_f32: bool = False, bf16_path: str | None = None
    ) -> None:
        self.modules: list[Any] = list(modules)  # nn.Linear or anything with .weight/.bias and a call
        weights = [m.weight for m in self.modules]
        biases = [getattr(m, "bias", None) for m in self.modules]
        self.sizes = [int(w.shape[0]) for w in weights]
        self.packed = pack and all(_plain(w) for w in weights) and all(_plain(b) for b in biases)
        self.bf16: Any = None  # bf16 mode: dflash's native bf16 GEMM of the path (bf16_path)
        self.bf16_path: str | None = None
        if self.packed and weights[0].dtype == torch.bfloat16 and weights[0].device.type == "cpu":
            path = bf16_path if bf16_path is not None else current_bf16_path()
            self.bf16 = _bf16_kernel(path)
            if self.bf16 is None and path in DFLASH_BF16_PATHS:
                path = None  # asked for a dflash path that does not run here
            self.packed = path is not None
            self.bf16_path = path
        self.f32: Any = None  # float32 mode: dflash's native float32 GEMM for steps (see kernels.F32_NATIVE_MAX_ROWS)
        if native_f32 and self.packed and weights[0].dtype == torch.float32 and weights[0].device.type == "cpu":
            self.f32 = _native_f32()
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None  # int8 mode: per-row scales (bf16); q4 mode: q4.kernel_sm
        parts = [_int8_parts(w) for w in weights]
        self.int8 = (
            all(p is not None for p in parts)
            and all(_plain(b) for b in biases)
            and int8_kernel_available(weights[0].device)
        )
        self.native: Any = None  # int8 mode: the compiled kernel (runtime.engine.models.kernels), else ATen's
        q4 = [_q4_parts(w) for w in weights]
        # q4 mode (runtime.engine.models.q4): dflash's 4-bit kernel, else the de-quantized product
        self.q4 = all(p is not None for p in q4) and all(_plain(b) for b in biases)
        self.q4_native: Any = None
        if self.q4:
            from runtime.engine.models.kernels import q4_gemm

            self.q4_native = q4_gemm() if weights[0].device.type == "cpu" else None
            with torch.no_grad():
                self.weight = torch.cat([p[0] for p in q4 if p is not None]).contiguous()
                self.scale = torch.cat([p[1] for p in q4 if p is not None]).contiguous()
                bias = self._cat_bias(biases, torch.zeros(0, dtype=torch.float32, device=self.weight.device))
                self.bias = bias.float().contiguous() if bias is not None else None
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
        self.cat = False  # unpacked plain weights (CUDA): one concatenated weight, one F.linear
        if not self.packed and not self.int8 and len(weights) > 1 and all(_plain(w) for w in weights):
            self._concatenate(weights, biases)

    def _concatenate(self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]) -> None:
        """One weight for the group (CUDA and other unpacked plain weights): the layers' own weights
        become views into it, so the group costs no extra memory and runs as one GEMM."""
        if len({(w.dtype, w.device, int(w.shape[1])) for w in weights}) != 1 or not all(_plain(b) for b in biases):
            return
        with torch.no_grad():
            w = torch.cat([x.detach() for x in weights])
            bias = self._cat_bias(biases, w)
            at = 0
            for m, n in zip(self.modules, self.sizes, strict=True):
                m.weight.data = w[at : at + n]
                if getattr(m, "bias", None) is not None and bias is not None:
                    m.bias.data = bias[at : at + n]
                at += n
        self.weight, self.bias, self.cat = w, bias, True

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

    @property
    def native_kind(self) -> int:
        """The weights' kind for ``kernels.Proj`` (the native layers): 0 = bf16 (float32
        activations), 1 = int8, 2 = float32, 3 = bf16 on the AVX-512-BF16 path, 4 = q4, 5 = bf16 on
        AMX tiles."""
        if self.q4:
            return 4
        if self.int8:
            return 1
        if self.f32 is not None:
            return 2
        return _BF16_GEMMS[self.bf16_path][1] if self.bf16_path in _BF16_GEMMS else 0

    @staticmethod
    def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
        """True where packed GEMMs run: a CPU with oneDNN and float32 weights; bf16 weights where a
        bf16 path runs (``current_bf16_path``: chosen by measurement, see ``choose_bf16``). Packed float32
        runs a decode step's small GEMMs about twice as fast as ``F.linear`` on an AVX2 CPU,
        measured (docs/speed.md)."""
        if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return False
        if dtype == torch.bfloat16:
            return current_bf16_path() is not None
        return bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]

    @staticmethod
    def takes_float32_rows(weight: Any) -> bool:
        """True where a projection weight runs on one of dflash's native kernels, which take float32
        rows: a plain bf16 weight where the process's bf16 path is dflash's (``native_bf16_runs``), an
        int8 or q4 weight where dflash's int8 or q4 kernel runs. A body of such weights wants float32
        activations (its verify rows then equal its one-token rows, and its layers run natively);
        any other weight (torchao's int4 over bf16, for one) keeps its own activation dtype."""
        device = getattr(weight, "device", torch.device("meta"))
        if device.type != "cpu":
            return False
        if _plain(weight):
            return weight.dtype == torch.bfloat16 and FusedLinear.native_bf16_runs(device)
        from runtime.engine.models.kernels import int8_gemm, q4_gemm

        if _int8_parts(weight) is not None:
            return int8_kernel_available(weight.device) and int8_gemm() is not None
        return _q4_parts(weight) is not None and q4_gemm() is not None

    @staticmethod
    def native_bf16_runs(device: torch.device) -> bool:
        """True where new bf16 projections run on one of dflash's bf16 GEMMs (``current_bf16_path``): they
        take float32 rows, so float32 activations cost nothing extra there."""
        return device.type == "cpu" and _native_bf16() is not None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Outputs of every layer for input rows ``x`` [T, in_features] -> ([T, out_i], ...)."""
        if torch.compiler.is_compiling() and (
            self.native is not None or self.bf16 is not None or self.packed or self.q4_native is not None
        ):
            return self._traced(x)
        if self.q4:
            from runtime.engine.models.q4 import q4_matmul

            assert self.weight is not None and self.scale is not None
            y = q4_matmul(x, self.weight, self.scale, self.bias, self.q4_native).to(x.dtype)
            return tuple(torch.split(y, self.sizes, dim=-1)) if len(self.sizes) > 1 else (y,)
        if self.f32 is not None:
            assert self.weight is not None
            y = kernels.f32_project(self.f32, x, self.weight, self.bias)
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
        if self.cat:
            assert self.weight is not None
            y = torch.nn.functional.linear(x, self.weight, self.bias)
            return tuple(torch.split(y, self.sizes, dim=-1))
        return tuple(m(x) for m in self.modules)

    def _traced(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``__call__`` under ``torch.compile``: the same kernels as custom operators
        (``runtime.engine.models.kernels.ops``), which the compiler keeps as opaque calls."""
        ops = torch.ops.dflash
        if self.q4_native is not None:
            y = ops.q4_gemm(x.float().contiguous(), self.weight, self.scale, self.bias).to(x.dtype)
        elif self.native is not None:
            y = ops.int8_gemm(x.float().contiguous(), self.weight, self.scale, self.bias).to(x.dtype)
        elif self.bf16 is not None:
            op = getattr(ops, _BF16_GEMMS[self.bf16_path or "dflash-avx2"][0])
            y = op(x.float().contiguous(), self.weight, self.bias).to(x.dtype)
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
