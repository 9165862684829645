"""The doctor's memory estimate: the device's total and free memory against the pair's footprint
(``runtime.models.footprint``): the target's weights as quantized, the drafter, both KV caches at
the requested context, and the peak while the target loads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.doctor.report import Check
from runtime.engine.models.device import dtype_name
from runtime.errors import DFlashError
from runtime.models.footprint import SLACK, TargetWeights

MemoryProbe = Callable[[torch.device], "tuple[int, int] | None"]


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(total, available) bytes of memory on ``device``, or None when unknown."""
    try:
        if device.type == "cuda" and device.index is None and torch.cuda.device_count() > 1:
            infos = [torch.cuda.mem_get_info(i) for i in range(torch.cuda.device_count())]
            return sum(int(t) for _f, t in infos), sum(int(f) for f, _t in infos)  # layers spread over all
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            return int(total), int(free)
        if device.type == "mps":
            total = int(torch.mps.recommended_max_memory())
            return total, total - int(torch.mps.driver_allocated_memory())
    except (RuntimeError, AttributeError):
        return None
    info: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
        return info["MemTotal"], info.get("MemAvailable", info["MemTotal"])
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(total), int(total)
    except (ValueError, OSError, AttributeError):
        return None


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


@dataclass(frozen=True)
class Estimate:
    """What a pair needs on its device, in bytes.

    Attributes:
        dtype: the float dtype (activations, unquantized weights).
        target: the target's weights (quantized as they will run).
        drafter: the drafter's weights.
        target_kv: the target's KV cache at ``context`` tokens.
        drafter_kv: the drafter's KV cache at ``context`` tokens.
        context: tokens the caches are sized for.
        load_peak: bytes on the device at once while the target loads.
        host_peak: bytes of host RAM the load stages (a model quantized onto a GPU), else 0.
    """

    dtype: torch.dtype
    target: TargetWeights
    drafter: int
    target_kv: int
    drafter_kv: int
    context: int
    load_peak: int
    host_peak: int = 0

    @property
    def running(self) -> int:
        """Weights and caches once everything is loaded."""
        return self.target.total + self.drafter + self.target_kv + self.drafter_kv

    @property
    def need(self) -> int:
        """The larger of running and loading, plus ``SLACK`` for activations and the allocator."""
        return int(max(self.running, self.load_peak) * SLACK)

    def describe(self) -> str:
        t = self.target
        if t.scheme is None:
            weights = f"{gb(t.total)} target weights in {dtype_name(self.dtype)}"
        else:
            weights = f"{gb(t.total)} target weights ({t.scheme}: {gb(t.quantized)} quantized + {gb(t.floating)} float)"
        text = (
            f"needs about {gb(self.need)}: {weights} + {gb(self.drafter)} drafter + KV caches at "
            f"{self.context} tokens ({gb(self.target_kv)} target + {gb(self.drafter_kv)} drafter); "
            f"loading peaks at {gb(self.load_peak)}"
        )
        if self.host_peak:
            text += f" with {gb(self.host_peak)} of float weights in host RAM"
        return text


def memory_check(device: torch.device, estimate: Estimate, probe: MemoryProbe) -> Check:
    """Whether ``estimate`` fits the device's total and free memory."""
    what = estimate.describe()
    need = estimate.need
    mem = probe(device)
    if mem is None:
        return Check("memory", "info", what + "; the device's memory is unknown")
    total, available = mem
    where = f"{device.type} has {gb(total)}, {gb(available)} free"
    fix = "use a smaller model, --quantize int8 (or int4), a shorter --context, or a device with more memory"
    if need > total:
        return Check("memory", "fail", f"{what}; {where}", fix, 6)
    if need > available:
        return Check("memory", "warn", f"{what}; {where}", "close other programs using the memory, or " + fix)
    return Check("memory", "ok", f"{what}; {where}")


def estimate(
    device: torch.device,
    dtype: torch.dtype,
    target_cfg: Any,
    target_params: int,
    draft_cfg: Any | None,
    drafter_params: int,
    scheme: str | None,
    quantize_at_load: bool,
    context: int,
) -> Estimate:
    """The pair's footprint; the target's weights from its config on the meta device (its
    ``target_params`` in float where transformers cannot build it)."""
    from runtime.models.footprint import (
        drafter_kv_bytes,
        load_peak,
        meta_model,
        target_kv_bytes,
        weights_of,
    )

    item = torch.empty((), dtype=dtype).element_size()
    try:
        weights = weights_of(meta_model(target_cfg), scheme, item)
    except (DFlashError, ValueError, TypeError, KeyError, AttributeError, RuntimeError, ImportError):
        # an architecture transformers cannot build on the meta device: the files' parameters, as float
        weights = TargetWeights(None, 0, target_params * item, target_params * item, 0)
    staged = quantize_at_load and scheme is not None and device.type != "cpu"
    return Estimate(
        dtype,
        weights,
        drafter_params * item,
        target_kv_bytes(target_cfg, context, item),
        drafter_kv_bytes(draft_cfg, context, item) if draft_cfg is not None else 0,
        context,
        load_peak(weights, device.type, quantize_at_load),
        weights.float_total if staged else 0,
    )
