"""KV caches: a version-portable crop for transformers caches, and the drafter's own cache.

transformers 4.x ``Cache.crop(n)`` keeps ``n`` tokens; 5.x ``crop(n)`` takes ``n <= 0`` tokens to
remove. ``crop_to`` hides the difference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def cache_len(cache: object) -> int:
    """Number of tokens held by a transformers cache (0 for None)."""
    if cache is None:
        return 0
    return int(cache.get_seq_length())  # type: ignore[attr-defined]


def crop_to(cache: object, keep: int) -> None:
    """Crop a transformers cache so that it holds exactly ``keep`` tokens.

    Args:
        cache: a ``transformers`` ``Cache`` (DynamicCache or compatible).
        keep: tokens to keep; must not exceed the current length.
    """
    remove = cache_len(cache) - keep
    if remove < 0:
        raise ValueError(f"cannot crop a cache of {keep + remove} tokens to {keep}")
    if remove > 0:
        cache.crop(-remove)  # type: ignore[attr-defined]


class DraftKVCache:
    """Per-layer K/V of the drafter: projected target context only.

    Buffers are preallocated ([1, kv_heads, capacity, head_dim], doubling when full) and written in
    place, so a step neither concatenates nor copies the cache. ``update`` returns views of the
    valid entries; ``crop`` moves the length back (the block never stays cached).
    """

    def __init__(self, num_layers: int, capacity: int = 256) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = [0] * num_layers
        self.initial_capacity = capacity

    @property
    def seq_len(self) -> int:
        """Cached tokens (the same for every layer between steps)."""
        return self.lengths[0]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new K/V ([1, kv_heads, n, head_dim]) for ``layer``; return all valid K/V."""
        n, old = int(k.shape[-2]), self.lengths[layer]
        end = old + n
        buf_k, buf_v = self.keys[layer], self.values[layer]
        if buf_k is None or buf_v is None or end > buf_k.shape[-2]:
            cap = max(end, self.initial_capacity, 2 * (buf_k.shape[-2] if buf_k is not None else 0))
            new_k = k.new_empty((*k.shape[:-2], cap, k.shape[-1]))
            new_v = v.new_empty((*v.shape[:-2], cap, v.shape[-1]))
            if buf_k is not None and buf_v is not None and old:
                new_k[..., :old, :] = buf_k[..., :old, :]
                new_v[..., :old, :] = buf_v[..., :old, :]
            self.keys[layer], self.values[layer] = buf_k, buf_v = new_k, new_v
        buf_k[..., old:end, :] = k
        buf_v[..., old:end, :] = v
        self.lengths[layer] = end
        return buf_k[..., :end, :], buf_v[..., :end, :]

    def crop(self, keep: int) -> None:
        """Keep the first ``keep`` cached tokens of every layer."""
        self.lengths = [min(n, keep) for n in self.lengths]


def keep_kv(cache: object, start: int, offsets: torch.Tensor | Sequence[int]) -> None:
    """Keep entries [0, start) and then ``start + offsets`` (in that order) of a transformers cache.

    Args:
        cache: a ``DynamicCache`` (transformers 5.x ``layers`` or 4.x ``key_cache`` lists).
        start: leading entries kept as they are.
        offsets: entries after ``start`` to keep, in the order given.

    Raises:
        UnsupportedModelError: a layer that drops old entries (sliding window) cannot be compacted.
    """
    from runtime.errors import UnsupportedModelError

    def pick(t: torch.Tensor) -> torch.Tensor:
        # in place over the tree region, then a view: no copy of the whole cache per step
        idx = torch.as_tensor(offsets, dtype=torch.long, device=t.device) + start
        n = int(idx.numel())
        with torch.no_grad():
            t[..., start : start + n, :] = t.index_select(-2, idx)
        return t[..., : start + n, :]

    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            if getattr(layer, "sliding_window", None):
                raise UnsupportedModelError(
                    "tree verification cannot compact a sliding-window KV cache; use --tree-budget 0"
                )
            layer.keys, layer.values = pick(layer.keys), pick(layer.values)
        return
    keys, values = getattr(cache, "key_cache", None), getattr(cache, "value_cache", None)
    if keys is None or values is None:
        raise UnsupportedModelError(f"cannot compact a {type(cache).__name__}; use --tree-budget 0")
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        if k is not None and k.numel():
            keys[i], values[i] = pick(k), pick(v)
