"""Projections of the lean forward: one GEMM per fused group of ``nn.Linear`` layers.

On a CPU, PyTorch's bf16 ``F.linear`` re-lays out the weight for oneDNN on every call; for a
decode step (1-16 rows) that costs more than the multiply itself. ``FusedLinear`` packs the
(concatenated) weight once into oneDNN's blocked layout (``mkldnn._reorder_linear_weight``, the
op torch.compile's CPU backend emits for frozen weights) and calls the packed GEMM
(``mkldnn._linear_pointwise``): same kernel family, same results, several times less time per
call. Where packing is unavailable (CUDA, float16, quantized tensor subclasses, a torch without
oneDNN bf16) the modules are called as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def _plain(t: torch.Tensor | None) -> bool:
    return t is None or type(t.data) is torch.Tensor


class FusedLinear:
    """``len(modules)`` linear layers over the same input, computed as one GEMM.

    Args:
        modules: ``nn.Linear`` layers with the same ``in_features``.
        pack: pack for oneDNN (see ``can_pack``); ignored for weights that are not plain tensors.
    """

    def __init__(self, modules: Sequence[Any], pack: bool) -> None:
        self.modules: list[Any] = list(modules)  # nn.Linear or anything with .weight/.bias and a call
        weights = [m.weight for m in self.modules]
        biases = [getattr(m, "bias", None) for m in self.modules]
        self.sizes = [int(w.shape[0]) for w in weights]
        self.packed = pack and all(_plain(w) for w in weights) and all(_plain(b) for b in biases)
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        if self.packed:
            with torch.no_grad():
                w = torch.cat([x.detach() for x in weights]) if len(weights) > 1 else weights[0].detach()
                self.weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1)
                if any(b is not None for b in biases):
                    self.bias = torch.cat(
                        [
                            b.detach() if b is not None else w.new_zeros(n)
                            for b, n in zip(biases, self.sizes, strict=True)
                        ]
                    )

    @staticmethod
    def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
        """True where packed oneDNN GEMMs run: a CPU with oneDNN bf16 support, bf16 weights."""
        if device.type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
            return False
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return False

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Outputs of every layer for input rows ``x`` [T, in_features] -> ([T, out_i], ...)."""
        if self.packed:
            y = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
            return tuple(y.split(self.sizes, dim=-1)) if len(self.sizes) > 1 else (y,)
        return tuple(m(x) for m in self.modules)


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
