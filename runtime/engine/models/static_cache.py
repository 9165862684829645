"""The lean forward's static KV cache: per-layer K/V buffers of fixed capacity, written in place, cropped by
moving a length and compacted to chosen slots (tree verification)."""

from __future__ import annotations

import ctypes
from typing import Any

import torch


class StaticKVCache:
    """Per-layer K/V of fixed capacity: [1, kv_heads, capacity, head_dim] each.

    ``length`` entries are valid; writing past ``capacity`` grows the buffers (doubling, a copy).
    Cropping only moves ``length``; the stale entries beyond it are overwritten by later writes.
    """

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (1, kv_heads, max(capacity, 16), head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.length = 0
        self._pointers: tuple[Any, Any] | None = None

    @property
    def capacity(self) -> int:
        """Entries the buffers hold before they grow."""
        return int(self.k[0].shape[2])

    def pointers(self) -> tuple[Any, Any]:
        """Addresses of every layer's K and V buffers (ctypes arrays, for ``kernels/layers.c``);
        built once per set of buffers (``reserve`` replaces them)."""
        if self._pointers is None:
            n = len(self.k)
            self._pointers = (
                (ctypes.c_void_p * n)(*[t.data_ptr() for t in self.k]),
                (ctypes.c_void_p * n)(*[t.data_ptr() for t in self.v]),
            )
        return self._pointers

    def get_seq_length(self) -> int:
        """Valid entries (the transformers ``Cache`` spelling, used by ``cache_len``)."""
        return self.length

    def reserve(self, n: int) -> None:
        """Make room for ``n`` entries in total."""
        if n <= self.capacity:
            return
        new = max(n, 2 * self.capacity)
        for buf in (self.k, self.v):
            for i, t in enumerate(buf):
                grown = t.new_zeros((*t.shape[:2], new, t.shape[3]))
                grown[:, :, : self.length] = t[:, :, : self.length]
                buf[i] = grown
        self._pointers = None

    def crop(self, keep: int) -> None:
        """Keep the first ``keep`` entries."""
        if keep > self.length:
            raise ValueError(f"cannot crop a cache of {self.length} tokens to {keep}")
        self.length = keep

    def keep(self, start: int, offsets: torch.Tensor) -> None:
        """Keep entries [0, start) plus ``start + offsets`` (in that order), e.g. an accepted tree path.

        Args:
            start: entries before it stay as they are.
            offsets: [n] long, slots after ``start`` to keep, ascending.
        """
        n = int(offsets.numel())
        src = offsets.to(self.k[0].device) + start
        for buf in (self.k, self.v):
            for t in buf:
                t[:, :, start : start + n] = t.index_select(2, src)
        self.length = start + n
