"""The doctor's memory estimate: the device's total and free memory, the pair's weights plus a KV
cache at ``CONTEXT_TOKENS`` tokens, and whether that fits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runtime.doctor.report import Check
from runtime.engine.models.device import dtype_name

MemoryProbe = Callable[[torch.device], "tuple[int, int] | None"]
CONTEXT_TOKENS = 4096  # KV cache budget the memory estimate assumes


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(total, available) bytes of memory on ``device``, or None when unknown."""
    try:
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


def kv_bytes(target_cfg: Any, dtype: torch.dtype) -> int:
    c = target_cfg.get_text_config() if hasattr(target_cfg, "get_text_config") else target_cfg
    heads = int(getattr(c, "num_attention_heads", 1) or 1)
    kv = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    item = torch.empty((), dtype=dtype).element_size()
    return 2 * int(c.num_hidden_layers) * kv * head_dim * item * CONTEXT_TOKENS


def memory_check(device: torch.device, dtype: torch.dtype, params: int, kv: int, probe: MemoryProbe) -> Check:
    item = torch.empty((), dtype=dtype).element_size()
    weights = params * item
    need = int((weights + kv) * 1.1)  # 10% for activations and allocator slack
    what = (
        f"needs about {gb(need)} ({gb(weights)} weights in {dtype_name(dtype)} "
        f"+ {gb(kv)} KV cache at {CONTEXT_TOKENS} tokens)"
    )
    mem = probe(device)
    if mem is None:
        return Check("memory", "info", what + "; the device's memory is unknown")
    total, available = mem
    where = f"{device.type} has {gb(total)}, {gb(available)} free"
    fix = "use a smaller model, --quantize int8 (or int4), or a device with more memory"
    if need > total:
        return Check("memory", "fail", f"{what}; {where}", fix, 6)
    if need > available:
        return Check("memory", "warn", f"{what}; {where}", "close other programs using the memory, or " + fix)
    return Check("memory", "ok", f"{what}; {where}")
