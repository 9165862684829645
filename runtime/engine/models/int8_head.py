"""An output head computed with int8 weights: a symmetric per-row int8 copy of a float weight (``Int8RowWise``,
laid out as ``FusedLinear`` reads a torchao ``Int8Tensor``) and the module-like head around it (``Int8Head``), for
a layer the quantizer leaves in float."""

from __future__ import annotations

from typing import Any

import torch


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
