"""dflash's 4-bit weight format (the ``q4`` scheme): quantizing, de-quantizing, the module.

Each weight row is cut into groups of ``GROUP`` = 32 input features; weight k of group g is
``scale[g] * q + min[g]`` with q in 0..15 and a float16 scale and minimum per group (asymmetric,
like llama.cpp's Q4_1): 4 bits per weight plus 32 bits per 32 weights, 5.0 bits per weight.
Asymmetric because a group's 16 levels then span the group's own range instead of a range
symmetric around zero (half a level more resolution on a typical lopsided group), and groups of 32
because small models (the 0.5B coder's 896-wide rows) lose noticeably more with wider groups.
The scale and minimum of each group are fitted (``quantize``): for a few candidate ranges, round to
the grid, then refit scale and minimum by least squares on the chosen levels, and keep the
candidate with the smallest squared error; the float16 values are what the levels are rounded with.

Stored layout (``Q4Linear`` buffers, and the tensors of a saved folder):
  qweight [N, K/2] uint8: group g of a row is 16 bytes; byte i holds q[32 g + i] in its low nibble
      and q[32 g + 16 + i] in its high nibble (what the native kernel unpacks with two masks);
  scales, mins [N, K/32] float16.

The native kernel (``kernels/q4.c``) takes ``scales`` and ``mins`` side by side per row, each
zero-padded to a multiple of 8 groups (``kernel_sm``). Where it does not run (no compiler,
``DFLASH_NATIVE=0``, another device), ``q4_matmul`` de-quantizes the weight to float32 and
multiplies: the same weights, float32 activations instead of 15-bit ones, so results agree within
rounding but not bit for bit with the native kernel's. Steps of at most ``ROWWISE_MAX_ROWS`` rows
then run one row at a time, so that a verify block still computes each row as a one-token step does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

GROUP = 32
BITS_PER_WEIGHT = 4 + 2 * 16 / GROUP  # 4-bit levels + a float16 scale and minimum per group
ROWWISE_MAX_ROWS = 128  # the fallback's steps (decode, verify) run row by row; longer prefills as one matmul
_SHRINK = (1.0, 0.97, 0.94, 0.91, 0.88, 0.85)  # candidate ranges, as fractions of a group's min..max


def supports(in_features: int) -> bool:
    """Whether a layer with ``in_features`` inputs can be stored in q4 (whole groups of 32)."""
    return in_features > 0 and in_features % GROUP == 0


def _fit(w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Levels for the range [lo, hi] of each group (rows of ``w`` [R, 32]), then scale and minimum refit
    by least squares on those levels. Returns (scale, minimum, squared error) per group."""
    s = ((hi - lo) / 15).clamp(min=1e-30)
    q = torch.round((w - lo[:, None]) / s[:, None]).clamp(0, 15)
    n = float(w.shape[1])
    sq, sw, sqq, sqw = q.sum(1), w.sum(1), (q * q).sum(1), (q * w).sum(1)
    det = n * sqq - sq * sq
    ok = det > 0
    s2 = torch.where(ok, (n * sqw - sq * sw) / torch.where(ok, det, 1.0), s)
    m2 = torch.where(ok, (sw - s2 * sq) / n, lo)
    err = ((q * s2[:, None] + m2[:, None] - w) ** 2).sum(1)
    return s2, m2, err


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] (K a multiple of 32) -> (qweight [N, K/2] uint8, scales, mins [N, K/32] float16).

    Deterministic: the same float weights always give the same tensors."""
    n, k = weight.shape
    if not supports(k):
        raise ValueError(f"q4: in_features must be a multiple of {GROUP}, got {k}")
    w = weight.detach().to(device="cpu", dtype=torch.float32).reshape(-1, GROUP)
    mn, mx = w.amin(1), w.amax(1)
    best_s, best_m, best_e = _fit(w, mn, mx)
    mid = (mn + mx) / 2
    for f in _SHRINK[1:]:
        half = (mx - mn) / 2 * f
        s, m, e = _fit(w, mid - half, mid + half)
        better = e < best_e
        best_s, best_m, best_e = (torch.where(better, a, b) for a, b in ((s, best_s), (m, best_m), (e, best_e)))
    scales = best_s.to(torch.float16)
    mins = best_m.to(torch.float16)
    s32, m32 = scales.float(), mins.float()
    safe = torch.where(s32 > 0, s32, 1.0)
    q = torch.where(s32[:, None] > 0, torch.round((w - m32[:, None]) / safe[:, None]), 0.0).clamp(0, 15)
    q8 = q.to(torch.uint8).reshape(-1, 2, 16)  # per group: k 0-15, k 16-31
    packed = (q8[:, 0] | (q8[:, 1] << 4)).reshape(n, k // 2).contiguous()
    return packed, scales.reshape(n, k // GROUP).contiguous(), mins.reshape(n, k // GROUP).contiguous()


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The float32 weights [N, K] that the q4 tensors stand for."""
    n, half = qweight.shape
    b = qweight.reshape(n, half // 16, 16)
    q = torch.cat([b & 0x0F, b >> 4], dim=-1).float()  # [N, G, 32]
    w = q * scales.float()[..., None] + mins.float()[..., None]
    return w.reshape(n, half * 2)


def kernel_sm(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The kernel's per-row scales and minimums: [N, 2 Gp] float16, a row's scales zero-padded to
    Gp = 8 * ceil(G / 8) groups, then its minimums padded alike."""
    n, g = scales.shape
    pad = -g % 8
    parts = [scales, mins] if pad == 0 else [scales, scales.new_zeros(n, pad), mins, mins.new_zeros(n, pad)]
    return torch.cat(parts, dim=1).to(torch.float16).contiguous()


def split_sm(sm: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, mins) [N, G] of a ``kernel_sm`` tensor."""
    g, gp = in_features // GROUP, sm.shape[1] // 2
    return sm[:, :g], sm[:, gp : gp + g]


def q4_matmul(
    x: torch.Tensor, qweight: torch.Tensor, sm: torch.Tensor, bias: torch.Tensor | None, native: Any
) -> torch.Tensor:
    """y [M, N] float32 = x [M, K] . W^T (+ bias) for q4 weights (``sm``: ``kernel_sm``):
    ``native`` (``kernels.q4_gemm()``) where it runs, else the de-quantized float32 product (see
    the module docstring)."""
    if native is not None and x.device.type == "cpu":
        y: torch.Tensor = native(x, qweight, sm, bias)
        return y
    w = dequantize(qweight, *split_sm(sm, qweight.shape[1] * 2))
    xf = x.float()
    b = bias.float() if bias is not None else None
    if xf.shape[0] <= ROWWISE_MAX_ROWS:
        return torch.cat([F.linear(xf[i : i + 1], w, b) for i in range(xf.shape[0])])
    return F.linear(xf, w, b)


class Q4Weight:
    """What ``Q4Linear.weight`` returns: the q4 tensors of a layer, for ``FusedLinear`` to read (not a
    tensor; ``shape`` is the logical [out_features, in_features], ``dtype`` the layer's float dtype:
    its inputs' and outputs')."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype) -> None:
        self.qweight, self.scales, self.mins, self.dtype = qweight, scales, mins, dtype
        self.shape = torch.Size((qweight.shape[0], qweight.shape[1] * 2))
        self.device = qweight.device


class Q4Linear(nn.Module):
    """An ``nn.Linear`` with q4 weights (inference only): buffers ``qweight``, ``scales``, ``mins``
    and the float ``bias`` (or None). Built by ``from_linear`` or, empty, by the folder loader.
    ``module.to(dtype)`` changes the layer's float dtype (``float_dtype``, the bias), never the float16
    scales and minimums."""

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if not supports(in_features):
            raise ValueError(f"q4: in_features must be a multiple of {GROUP}, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.float_dtype = dtype
        g = in_features // GROUP
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(out_features, g, dtype=torch.float16))
        self.register_buffer("mins", torch.zeros(out_features, g, dtype=torch.float16))
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        )
        self._native: Any = None
        self._sm: torch.Tensor | None = None  # scales and mins side by side, for the kernel
        self._sm_of: tuple[int, int] | None = None  # the buffers ``_sm`` was made of

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Q4Linear:
        """The q4 copy of ``linear`` (on its device; quantized on the CPU)."""
        w = linear.weight
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype)
        qweight, scales, mins = quantize(w)
        new.qweight, new.scales, new.mins = qweight.to(w.device), scales.to(w.device), mins.to(w.device)
        if linear.bias is not None:
            new.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return new

    @property
    def weight(self) -> Q4Weight:
        """The q4 tensors (see ``Q4Weight``)."""
        return Q4Weight(self.qweight, self.scales, self.mins, self.float_dtype)

    def _apply(self, fn: Any, recurse: bool = True) -> Q4Linear:
        kept = {name: self._buffers[name] for name in ("scales", "mins")}
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        for name, old in kept.items():  # moved, never cast: the kernel reads float16
            new = self._buffers[name]
            if old is not None and new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(device=new.device)
        probe: torch.Tensor = fn(torch.empty(0, dtype=self.float_dtype))
        self.float_dtype = probe.dtype
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype (float32 inside)."""
        key = (self.scales.data_ptr(), self.mins.data_ptr())
        if self._sm is None or self._sm_of != key:
            from runtime.engine.models.kernels import q4_gemm

            self._sm, self._sm_of = kernel_sm(self.scales, self.mins), key
            self._native = q4_gemm() if self.scales.device.type == "cpu" else None
        lead = x.shape[:-1]
        b = self.bias.detach().float().contiguous() if self.bias is not None else None
        y = q4_matmul(x.reshape(-1, self.in_features), self.qweight, self._sm, b, self._native)
        return y.to(x.dtype).view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, q4 groups of {GROUP}"
