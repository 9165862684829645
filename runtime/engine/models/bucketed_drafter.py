"""The drafter's capturable step (the CUDA path; runs anywhere): fixed shapes, no host reads, its
cache lent from a pool allocated once per loaded drafter.

A DFlash step's drafter work splits in two fixed-shape forwards (``BucketedDrafter``):

- ``append``: the target features not yet cached (the accepted path of the last step, or the
  prompt) are fused (``fc``, ``hidden_norm``) and projected to every layer's K/V, written at the
  cache's device-side length. The context feeds each layer's K/V directly (not through the earlier
  layers), so this is the same as projecting it together with the block. Rows come in chunks of
  at most the widest bucket, each padded to its bucket (``VerifyBuckets``); padding lands past
  the length and is never attended to.
- ``block``: the block [anchor, M, ..., M] (fixed width: the block size) at positions length + i,
  its K/V written after the context (and left past the length: the block never stays cached),
  attending over the whole capacity with a mask of the valid keys (``grouped_attention``).

Both compile with ``torch.compile(fullgraph=True)``; ``compile(mode)`` caches them on this object,
which a loaded drafter keeps for the process (``BucketedDrafter.of``).
"""

from __future__ import annotations

import weakref
from typing import cast

import torch

from runtime.engine.models.attention import grouped_attention
from runtime.engine.models.buckets import VerifyBuckets
from runtime.engine.models.cache_pool import BufferPool, Loan
from runtime.engine.models.compiled_step import CompiledStep
from runtime.engine.models.drafter import DFlashDraftModel, DraftLayer, _rope
from runtime.engine.models.kv_cache import DraftKVCache


class _DraftKV:
    """One lent buffer set: every layer's K and V [1, KV, capacity, hd] and the device length."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], length: torch.Tensor) -> None:
        self.k, self.v, self.length = k, v, length


class PooledDraftCache(DraftKVCache):
    """A ``DraftKVCache`` over a lent buffer set, its length also on the device (``length_dev``)."""

    def __init__(self, pool: BufferPool[_DraftKV], capacity: int) -> None:
        super().__init__(0, capacity)
        self._pool = pool
        self._loan = Loan(pool, capacity)
        self.length = 0
        self._adopt()
        self.length_dev.fill_(0)

    def _adopt(self) -> None:
        kv = self._loan.buffers
        self.keys, self.values = list[torch.Tensor | None](kv.k), list[torch.Tensor | None](kv.v)
        self.k, self.v, self.length_dev = kv.k, kv.v, kv.length

    @property
    def capacity(self) -> int:
        """Entries the buffers hold."""
        return int(self.k[0].shape[2])

    @property
    def seq_len(self) -> int:
        """Cached context entries."""
        return self.length

    def reserve(self, n: int) -> None:
        """Make room for ``n`` entries (between steps: a bigger set, the valid entries copied)."""
        if n <= self.capacity:
            return
        old, self._loan = self._loan, Loan(self._pool, n)
        for src, dst in ((old.buffers.k, self._loan.buffers.k), (old.buffers.v, self._loan.buffers.v)):
            for s, d in zip(src, dst, strict=True):
                d[:, :, : self.length] = s[:, :, : self.length]
        self._adopt()
        self.length_dev.fill_(self.length)
        del old

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Not used: the bucketed step writes its buffers itself."""
        raise NotImplementedError("a pooled drafter cache is written by BucketedDrafter")

    def crop(self, keep: int) -> None:
        """Keep the first ``keep`` cached entries."""
        self.length = min(self.length, keep)
        self.length_dev.fill_(self.length)


_per_drafter: weakref.WeakKeyDictionary[DFlashDraftModel, BucketedDrafter] = weakref.WeakKeyDictionary()


class BucketedDrafter:
    """A drafter's bucketed step, its cache pool and its compiled forwards (see the module docstring).

    Args:
        drafter: the loaded drafter.
        buckets: widths the context rows are padded to.
    """

    def __init__(self, drafter: DFlashDraftModel, buckets: VerifyBuckets | None = None) -> None:
        self.drafter = drafter
        self.buckets = buckets or VerifyBuckets()
        p = drafter.norm.weight
        self.device, self.dtype = p.device, p.dtype
        cfg = drafter.config
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.layers = [cast(DraftLayer, layer) for layer in drafter.layers]
        self.pool: BufferPool[_DraftKV] = BufferPool(self._allocate)
        self._offsets = torch.arange(self.buckets.largest, device=self.device)
        self._columns = torch.empty(0, dtype=torch.long, device=self.device)
        self._cos = self._sin = torch.empty(0, device=self.device)
        self._rows: dict[int, torch.Tensor] = {}  # per bucket: [1, w, n*D] padded context features
        self._blocks: dict[int, torch.Tensor] = {}  # per block size: [1, b] ids
        self.context_step = CompiledStep(self._context_body)
        self.block_step = CompiledStep(self._block_body)

    @staticmethod
    def of(drafter: DFlashDraftModel) -> BucketedDrafter:
        """The drafter's one ``BucketedDrafter`` (made on first use, kept while the drafter lives)."""
        step = _per_drafter.get(drafter)
        if step is None:
            step = _per_drafter[drafter] = BucketedDrafter(drafter)
        return step

    def compile(self, mode: str = "default") -> None:
        """Compile both forwards ("default" or "reduce-overhead": CUDA graphs)."""
        self.context_step.compile(mode)
        self.block_step.compile(mode)

    def _allocate(self, capacity: int) -> _DraftKV:
        shape = (1, self.n_kv, capacity, self.head_dim)
        n = len(self.layers)
        kv = _DraftKV(
            [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(n)],
            [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(n)],
            torch.zeros((), dtype=torch.long, device=self.device),
        )
        if self.device.type == "cuda":  # written in place by CUDA graphs
            for t in (*kv.k, *kv.v, kv.length):
                torch._dynamo.mark_static_address(t)
        return kv

    def _tables(self, capacity: int) -> None:
        """RoPE tables and key columns for ``capacity`` slots (grown between steps only)."""
        if self._cos.shape[0] < capacity:
            rotary = self.drafter._rotary[0]
            if rotary.inv_freq.device != self.device:
                self.drafter._rotary[0] = rotary = rotary.to(self.device)
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = rotary(probe, torch.arange(capacity, device=self.device)[None])
            self._cos, self._sin = cos[0], sin[0]
            self._columns = torch.arange(capacity, device=self.device)

    def new_cache(self, capacity: int) -> PooledDraftCache:
        """A cache lent from the pool: ``capacity`` positions plus a padded chunk and a block."""
        cache = PooledDraftCache(self.pool, capacity + 2 * self.buckets.largest)
        self._tables(cache.capacity)
        return cache

    def block_ids(self, block_size: int, mask_id: int) -> torch.Tensor:
        """The [1, block_size] block ids buffer ([anchor, M, ..., M]; the caller writes the anchor)."""
        ids = self._blocks.get(block_size)
        if ids is None:
            ids = self._blocks[block_size] = torch.full((1, block_size), mask_id, dtype=torch.long, device=self.device)
        return ids

    def append(self, cache: PooledDraftCache, features: torch.Tensor) -> None:
        """Cache the context K/V of ``features`` [1, C, n*D] (target features of positions
        length .. length + C - 1), in padded chunks."""
        c = int(features.shape[1])
        cache.reserve(cache.length + c + 2 * self.buckets.largest)
        self._tables(cache.capacity)
        done = 0
        while done < c:
            n = min(c - done, self.buckets.largest)
            w = self.buckets.width(n)
            assert w is not None
            rows = self._rows.get(w)
            if rows is None or rows.shape[2] != features.shape[2]:
                rows = self._rows[w] = torch.zeros((1, w, features.shape[2]), dtype=self.dtype, device=self.device)
            rows[:, :n] = features[:, done : done + n]
            self.context_step(rows, cache.length_dev, cache.k, cache.v, self._cos, self._sin)
            cache.length += n
            cache.length_dev.add_(n)
            done += n

    def block(self, cache: PooledDraftCache, embeds: torch.Tensor) -> torch.Tensor:
        """The final hidden states [b, D] of the block ``embeds`` [1, b, D] after the cached context."""
        cache.reserve(cache.length + int(embeds.shape[1]))
        self._tables(cache.capacity)
        (hidden,) = self.block_step(embeds, cache.length_dev, cache.k, cache.v, self._cos, self._sin, self._columns)
        return hidden

    def _context_body(
        self,
        features: torch.Tensor,
        length: torch.Tensor,
        cache_k: list[torch.Tensor],
        cache_v: list[torch.Tensor],
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
    ) -> None:
        """Fuse [1, w, n*D] features and write their K/V at ``length`` (fixed shapes, no host reads)."""
        w = features.shape[1]
        ctx = self.drafter.fuse_context(features).to(self.dtype)  # [1, w, D]
        slots = self._offsets[:w] + length
        cos, sin = cos_table[slots].unsqueeze(0), sin_table[slots].unsqueeze(0)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            k = attn.k_norm(attn.k_proj(ctx).view(1, w, self.n_kv, self.head_dim)).transpose(1, 2)
            v = attn.v_proj(ctx).view(1, w, self.n_kv, self.head_dim).transpose(1, 2)
            cache_k[i].index_copy_(2, slots, _rope(k, cos, sin))
            cache_v[i].index_copy_(2, slots, v)

    def _block_body(
        self,
        embeds: torch.Tensor,
        length: torch.Tensor,
        cache_k: list[torch.Tensor],
        cache_v: list[torch.Tensor],
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
        columns: torch.Tensor,
    ) -> tuple[torch.Tensor]:
        """The block's layers over the cached context (fixed shapes, no host reads): ([b, D],)."""
        b = embeds.shape[1]
        cap = cache_k[0].shape[2]
        h = embeds.to(self.dtype)
        slots = self._offsets[:b] + length
        cos, sin = cos_table[slots].unsqueeze(0), sin_table[slots].unsqueeze(0)
        keys = columns[:cap]
        valid = (keys < length + b).expand(b, cap)  # the context and the block itself
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            mask = valid
            if attn.sliding_window is not None:
                mask = mask & (slots[:, None] - keys[None, :] < attn.sliding_window)
            x = layer.input_layernorm(h)
            q = attn.q_norm(attn.q_proj(x).view(1, b, nh, hd)).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(x).view(1, b, nkv, hd)).transpose(1, 2)
            v = attn.v_proj(x).view(1, b, nkv, hd).transpose(1, 2)
            cache_k[i].index_copy_(2, slots, _rope(k, cos, sin))
            cache_v[i].index_copy_(2, slots, v)
            out = grouped_attention(_rope(q, cos, sin)[0], cache_k[i], cache_v[i], mask, hd**-0.5)  # [H, b, hd]
            h = h + attn.o_proj(out.transpose(0, 1).reshape(1, b, nh * hd))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return (self.drafter.norm(h)[0],)
