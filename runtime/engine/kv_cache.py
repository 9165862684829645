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

    Tensors are [1, kv_heads, T, head_dim]; ``positions`` holds the absolute position of each
    cached entry (needed for sliding-window masks).
    """

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def seq_len(self) -> int:
        """Cached tokens (the same for every layer)."""
        k = self.keys[0]
        return 0 if k is None else int(k.shape[-2])

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new K/V for ``layer`` and return the full K/V to attend over."""
        old_k, old_v = self.keys[layer], self.values[layer]
        if old_k is not None and old_v is not None:
            k = torch.cat([old_k, k], dim=-2)
            v = torch.cat([old_v, v], dim=-2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def crop(self, keep: int) -> None:
        """Keep the first ``keep`` cached tokens of every layer."""
        for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            if k is not None and v is not None and k.shape[-2] > keep:
                self.keys[i] = k[..., :keep, :]
                self.values[i] = v[..., :keep, :]


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
