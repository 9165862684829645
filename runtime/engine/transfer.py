"""Moving a step's small data between the host and the device, the only two ways the loop does.

On a GPU a host read (``.tolist()``, ``.item()``) waits for every queued kernel, and a tensor built
from a Python list with ``device=`` is a blocking copy from pageable memory. The decode loop
therefore reads the device only through ``download`` (one read per chain step: the drafts and the
target's choices together; two per tree step: the drafts' candidates, then the choices) and sends
host-built tensors (tree ids, positions, masks, copy inputs) only through ``upload``: from pinned
memory, without blocking, on CUDA. ``tests/test_host_reads.py`` counts them per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def upload(values: Sequence[Any] | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or CPU tensor) on ``device`` without a blocking copy (pinned + non_blocking on CUDA)."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host.to(dtype)
    if device.type == "cuda":
        host = host.to(dtype).pin_memory()
    return host.to(device=device, dtype=dtype, non_blocking=True)


def download(t: torch.Tensor) -> list[Any]:
    """A device tensor's values on the host: the step's host read (it waits for the device)."""
    return t.tolist()
