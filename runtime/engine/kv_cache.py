"""KV caches: a version-portable crop for transformers caches, and the drafter's own cache.

transformers 4.x ``Cache.crop(n)`` keeps ``n`` tokens; 5.x ``crop(n)`` takes ``n <= 0`` tokens to
remove. ``crop_to`` hides the difference.
"""

from __future__ import annotations

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
