"""Projections of the lean forward: one GEMM per fused group of ``nn.Linear`` layers.

On a CPU, PyTorch's bf16 ``F.linear`` re-lays out the weight for oneDNN on every call; for a
decode step (1-16 rows) that costs more than the multiply itself (and float32 ``F.linear`` goes to
a BLAS whose small-row GEMMs run at half the packed kernel's speed on AVX2 CPUs). ``FusedLinear`` packs the
(concatenated) weight once into oneDNN's blocked layout (``mkldnn._reorder_linear_weight``, the
op torch.compile's CPU backend emits for frozen weights) and calls the packed GEMM
(``mkldnn._linear_pointwise``): same kernel family, same results, several times less time per
call. bf16 weights on a CPU take one of three paths (``current_bf16_path``): dflash's native bf16
GEMM (``runtime.engine.models.kernels``: the bf16 weights widened to float32 in registers, float32
activations and accumulation, half float32's bytes read per step), its AVX-512-BF16 GEMM
(``vdpbf16ps``, activations rounded per row to bf16) where the CPU has it, or oneDNN's packed GEMM
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
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
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


# The bf16 paths (``runtime.engine.models.kernels.choice.PATHS``): dflash's kernels take float32 activations
# (the AVX-512-BF16 one rounds them to bf16 itself), oneDNN's packed GEMM bf16 activations.
DFLASH_BF16_PATHS = ("dflash-avx2", "dflash-avx512bf16")
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

    if path == "dflash-avx2":
        return kernels.bf16_gemm()
    if path == "dflash-avx512bf16":
        return kernels.bf16dp_gemm()
    return None


def _native_bf16() -> Any:
    """dflash's bf16 GEMM where new projections run one (see ``current_bf16_path``), else None."""
    return _bf16_kernel(current_bf16_path())


# How many layers' weights at most (bytes) and how many head weights at most (elements) the bf16
# timing reads: enough to stream from memory as a step does, little enough to copy for oneDNN.
_SAMPLE_BYTES = 128 << 20
_HEAD_MAX = 64 << 20


class _HeadRows:
    """The first ``rows`` rows of an output head (module-like, for timing a huge head)."""

    def __init__(self, linear: Any, rows: int) -> None:
        self.weight = linear.weight.detach()[:rows]
        bias = getattr(linear, "bias", None)
        self.bias = bias.detach()[:rows] if bias is not None else None


def _step_groups(model: nn.Module) -> tuple[list[tuple[list[Any], float]], str] | None:
    """The projections of a Llama-family target's step as ``LeanTarget`` fuses them (q/k/v, o,
    gate/up, down per layer, then the head), sampled: (modules, how many GEMMs of the step each
    stands for), and the shapes' signature. None for another model or weights that are not plain
    bf16 tensors."""
    inner: Any = getattr(model, "model", None)
    layers: Any = getattr(inner, "layers", None)
    head: Any = getattr(model, "lm_head", None)
    if layers is None or head is None or len(layers) == 0:
        return None
    per_layer: list[list[Any]] = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        per_layer.append(
            [[attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]]
        )
    mods = [m for groups in per_layer for g in groups for m in g] + [head]
    if not all(_plain(m.weight) and m.weight.dtype == torch.bfloat16 for m in mods):
        return None
    layer_bytes = sum(m.weight.numel() * 2 for g in per_layer[0] for m in g)
    sample = max(1, min(len(per_layer), _SAMPLE_BYTES // max(layer_bytes, 1)))
    scale = len(per_layer) / sample
    groups: list[tuple[list[Any], float]] = [(g, scale) for groups in per_layer[:sample] for g in groups]
    n_head, k_head = head.weight.shape
    rows = min(int(n_head), max(1, _HEAD_MAX // int(k_head)))
    groups.append(([head if rows == n_head else _HeadRows(head, rows)], n_head / rows))
    sig = ",".join(f"{sum(int(m.weight.shape[0]) for m in g)}x{int(g[0].weight.shape[1])}" for g in per_layer[0])
    return groups, f"L{len(per_layer)}:{sig}|head:{int(n_head)}x{int(k_head)}"


def _first_layer(model: Any) -> Any:
    """``model`` with its first decoder layer only (a shallow copy sharing every module and weight)."""
    inner: Any = copy.copy(model.model)
    inner._modules = dict(inner._modules)
    inner._modules["layers"] = nn.ModuleList([inner.layers[0]])
    cfg = copy.copy(model.config)
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:1]
    outer: Any = copy.copy(model)
    outer._modules = dict(outer._modules)
    outer._modules["model"] = inner
    outer.__dict__["config"] = cfg
    inner.__dict__["config"] = cfg
    return outer


@torch.inference_mode()
def _step_rows_match(model: nn.Module, path: str, rows: int = 8) -> bool:
    """Whether a ``rows``-token verify through the lean forward on ``path`` (the first decoder layer
    and the head of ``model``) gives, row for row, the logits and layer output of ``rows`` one-token
    steps from the same cache: the GEMMs and everything between them (with bf16 activations that
    is PyTorch's layers, whose one-row attention is not SDPA's)."""
    from runtime.engine.models.lean_target import LeanTarget, lean_supported

    shallow = _first_layer(model)
    if lean_supported(shallow) is not None:
        return False
    before = _process.get("bf16")
    _process["bf16"] = path
    try:
        lean = LeanTarget(shallow, pack=True)
    finally:
        _process["bf16"] = before
    lean.set_taps([0])
    g = torch.Generator().manual_seed(3)
    vocab = min(lean.vocab_size, 1000)
    prompt, block = torch.randint(0, vocab, (1, 6), generator=g), torch.randint(0, vocab, (1, rows), generator=g)
    c1, c2 = lean.new_cache(), lean.new_cache()
    lean.forward(prompt, c1, logits_to_keep=1)
    lean.forward(prompt, c2, logits_to_keep=1)
    logits, feats = lean.forward(block, c1)
    for i in range(rows):
        one, f1 = lean.forward(block[:, i : i + 1], c2)
        if (
            not torch.equal(logits[i : i + 1], one)
            or feats is None
            or f1 is None
            or not torch.equal(feats[:, i : i + 1], f1)
        ):
            return False
    return True


def remeasure_bf16() -> None:
    """Make every later ``choose_bf16`` of this process measure again instead of reading a stored
    choice (``dflash doctor --speed``)."""
    _process["remeasure"] = "yes"


def choose_bf16(model: nn.Module, cache_file: Path | None = None, remeasure: bool = False) -> Any:
    """Choose by measurement the bf16 path of a bf16 target on a CPU (see
    ``runtime.engine.models.kernels.choice``): new projections of this process take it (``current_bf16_path``).

    Args:
        model: a transformers causal LM (Llama family) with plain bf16 weights on the CPU; for any
            other model (or device, dtype) nothing is chosen.
        cache_file: where choices are kept (None: ``choice.choice_file()``).
        remeasure: measure again even where a choice is stored.

    Returns:
        The ``Choice`` (its ``chosen`` None where no path keeps verify rows equal to one-token
        rows: then the default path stays), or None where nothing was chosen.
    """
    params = next(iter(model.parameters()), None)
    if params is None or params.device.type != "cpu" or params.dtype != torch.bfloat16 or "choosing" in _process:
        return None
    found = _step_groups(model)
    candidates = bf16_candidates()
    if found is None or not candidates:
        return None
    groups, shapes = found
    from runtime.engine.models.kernels.choice import Candidate, cached_choice, row_independent

    def build(path: str) -> Candidate:
        fused = [(FusedLinear(g, pack=True, bf16_path=path), weight) for g, weight in groups]
        k = [int(g[0].weight.shape[1]) for g, _ in groups]
        act = torch.float32 if path in DFLASH_BF16_PATHS else torch.bfloat16
        gemms = [(f, kk, weight) for (f, weight), kk in zip(fused, k, strict=True)]
        # every weight shape (the first layer's four projections and the head), then a whole step
        shapes = [(f, kk) for f, kk, _ in gemms[:4]] + [(gemms[-1][0], gemms[-1][1])]

        def check() -> bool:
            return all(row_independent(f, kk, act) for f, kk in shapes) and _step_rows_match(model, path)

        return Candidate(gemms, act, check)

    _process["choosing"] = "yes"
    try:
        choice = cached_choice(shapes, candidates, build, cache_file, remeasure or "remeasure" in _process)
    finally:
        _process.pop("choosing", None)
    if choice.chosen is not None:
        from runtime.engine.models import kernels

        _process["bf16"] = choice.chosen
        kernels.note_bf16_path(choice.chosen)  # verify costs are calibrated per path (kernels.identity)
    return choice


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

    @property
    def native_kind(self) -> int:
        """The weights' kind for ``kernels.Proj`` (the native layers): 0 = bf16 (float32
        activations), 1 = int8, 2 = float32, 3 = bf16 on the AVX-512-BF16 path."""
        if self.int8:
            return 1
        if self.f32 is not None:
            return 2
        return 3 if self.bf16_path == "dflash-avx512bf16" else 0

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
    def native_bf16_runs(device: torch.device) -> bool:
        """True where new bf16 projections run on one of dflash's bf16 GEMMs (``current_bf16_path``): they
        take float32 rows, so float32 activations cost nothing extra there."""
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
        elif self.bf16 is not None and self.bf16_path == "dflash-avx512bf16":
            y = ops.bf16dp_gemm(x.float().contiguous(), self.weight, self.bias).to(x.dtype)
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
