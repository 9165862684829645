"""The target's capturable verify step (the CUDA path; runs anywhere): fixed shapes per bucket, no
host reads, caches lent from a pool allocated once per loaded model.

``BucketedTarget`` is ``LeanTarget`` over unpacked weights (q/k/v and gate/up as one GEMM each,
``FusedLinear``) with a verify forward that a compiler can capture:

- the cache's buffers come from the model's ``BufferPool`` (capacity from the request, rounded to
  a power of two, plus the widest bucket as headroom) and go back to it when the request's cache
  is dropped; the next request reuses them (same memory, same addresses);
- the cache length lives on the device too (``PooledKVCache.length_dev``): a verify reads its
  start, positions and cache slots from it, never from the host;
- a verify of n rows runs padded to its bucket (``VerifyBuckets``: 1, 2, 4, ..., 64 rows): ids,
  positions and the block mask are copied into the bucket's own buffers, and the forward attends
  over the whole capacity with a mask built on the device (cached keys below the length, the block
  as its mask says), through ``grouped_attention`` (no K/V repeat, no math kernel on CUDA);
- ``compile(mode)`` runs the bucket forward through ``torch.compile`` ("default", or
  "reduce-overhead": CUDA graphs), once per bucket per process; eager where that fails.

The prompt (``logits_to_keep`` set) and verifies wider than the widest bucket run ``LeanTarget``'s
eager forward over the same buffers. On CPUs the packed/native ``LeanTarget`` stays the default:
this class runs there only when asked (``--engine bucketed``), e.g. to test it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runtime.engine.models.attention import grouped_attention
from runtime.engine.models.buckets import VerifyBuckets
from runtime.engine.models.cache_pool import BufferPool, Loan
from runtime.engine.models.compiled_step import CompiledStep
from runtime.engine.models.lean_target import LeanTarget, StaticKVCache, _rms, _rotate_half


class _KV:
    """One lent buffer set: every layer's K and V [1, KV, capacity, hd] and the device length."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], length: torch.Tensor) -> None:
        self.k, self.v, self.length = k, v, length


class PooledKVCache(StaticKVCache):
    """A ``StaticKVCache`` over a lent buffer set, its length mirrored on the device.

    ``length`` (host) and ``length_dev`` (a 0-d long tensor on the device) move together:
    ``crop``/``keep``/forwards set both, the host by value and the device by a fill (a launch, not
    a read). Growing (a prompt-cache slot reused by a longer request) borrows a bigger set and
    copies the valid entries, between steps, never inside a forward.
    """

    def __init__(self, pool: BufferPool[_KV], capacity: int) -> None:  # noqa: D107 - no super().__init__: no buffers of its own
        self._pool = pool
        self._loan = Loan(pool, capacity)
        self._pointers = None
        self.length = 0
        self._adopt()
        self.length_dev.fill_(0)

    def _adopt(self) -> None:
        kv = self._loan.buffers
        self.k, self.v, self.length_dev = kv.k, kv.v, kv.length

    def reserve(self, n: int) -> None:
        """Make room for ``n`` entries (a bigger set from the pool, the valid entries copied over)."""
        if n <= self.capacity:
            return
        old, self._loan = self._loan, Loan(self._pool, n)
        for src, dst in ((old.buffers.k, self._loan.buffers.k), (old.buffers.v, self._loan.buffers.v)):
            for s, d in zip(src, dst, strict=True):
                d[:, :, : self.length] = s[:, :, : self.length]
        self._adopt()
        self.length_dev.fill_(self.length)
        del old

    def crop(self, keep: int) -> None:
        """Keep the first ``keep`` entries."""
        super().crop(keep)
        self.length_dev.fill_(keep)

    def keep(self, start: int, offsets: torch.Tensor) -> None:
        """Keep entries [0, start) plus ``start + offsets`` (a tree's accepted path)."""
        super().keep(start, offsets)
        self.length_dev.fill_(self.length)


class _Bucket:
    """A bucket's input buffers: ids [1, w], positions [w], block mask [w, w]."""

    def __init__(self, width: int, device: torch.device) -> None:
        self.ids = torch.zeros((1, width), dtype=torch.long, device=device)
        self.positions = torch.zeros(width, dtype=torch.long, device=device)
        self.mask = torch.zeros((width, width), dtype=torch.bool, device=device)


class BucketedTarget(LeanTarget):
    """``LeanTarget`` with a capturable, bucketed verify step (see the module docstring).

    Args:
        model: a transformers Llama/Qwen2/Qwen3 causal LM.
        buckets: the verify widths.
    """

    def __init__(self, model: nn.Module, buckets: VerifyBuckets | None = None) -> None:
        super().__init__(model, pack=False, float_activations=False, native_layers=False, native_f32=False)
        self.buckets = buckets or VerifyBuckets()
        self.pool: BufferPool[_KV] = BufferPool(self._allocate)
        largest = self.buckets.largest
        self._buckets: dict[int, _Bucket] = {}
        self._causal = torch.ones(largest, largest, dtype=torch.bool, device=self.device).tril_()
        self._offsets = torch.arange(largest, device=self.device)
        self._columns = torch.empty(0, dtype=torch.long, device=self.device)
        self.verify_step = CompiledStep(self._bucket_body)

    def _allocate(self, capacity: int) -> _KV:
        shape = (1, self.n_kv, capacity, self.head_dim)
        kv = _KV(
            [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)],
            [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)],
            torch.zeros((), dtype=torch.long, device=self.device),
        )
        if self.device.type == "cuda":  # CUDA graphs write these in place: their addresses are part of the graph
            for t in (*kv.k, *kv.v, kv.length):
                torch._dynamo.mark_static_address(t)
        return kv

    def new_cache(self, capacity: int = 512) -> PooledKVCache:
        """A cache lent from the pool with room for ``capacity`` tokens plus the widest bucket."""
        cache = PooledKVCache(self.pool, capacity + self.buckets.largest)
        self._rope_tables(cache.capacity)
        if self._columns.numel() < cache.capacity:
            self._columns = torch.arange(cache.capacity, device=self.device)
        return cache

    def compile(self, mode: str | None = None) -> None:
        """Compile the bucket forward ("default" or "reduce-overhead": CUDA graphs) from the next
        verify on; the prompt stays eager."""
        self.verify_step.compile(mode or "default")

    @property
    def is_compiled(self) -> bool:
        """Whether verifies run the compiled bucket step now (False again after a failed compilation)."""
        return self.verify_step.compiled is not None

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: Any,
        logits_to_keep: int = 0,
        capture: bool = True,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``LeanTarget.forward``; verifies (all rows' logits) that fit a bucket run the bucket step."""
        t = int(input_ids.shape[1])
        width = self.buckets.width(t) if logits_to_keep == 0 else None
        if width is None or not isinstance(cache, PooledKVCache):
            logits, feats = super().forward(input_ids, cache, logits_to_keep, capture, positions, tree_mask)
            if isinstance(cache, PooledKVCache):
                cache.length_dev.fill_(cache.length)
            return logits, feats
        start = cache.length
        cache.reserve(start + width)
        self._rope_tables(cache.capacity)
        if self._columns.numel() < cache.capacity:
            self._columns = torch.arange(cache.capacity, device=self.device)
        bucket = self._buckets.get(width)
        if bucket is None:
            bucket = self._buckets[width] = _Bucket(width, self.device)
        bucket.ids.zero_()
        bucket.ids[:, :t] = input_ids
        torch.add(self._offsets[:width], cache.length_dev, out=bucket.positions)  # a chain: start + i
        if positions is not None:
            bucket.positions[:t] = positions  # a tree: start + depth
        VerifyBuckets.block_mask(t, tree_mask, self._causal, bucket.mask)
        taps = tuple(self._taps) if capture else ()
        logits, feats = self.verify_step(
            bucket.ids, bucket.positions, bucket.mask, cache.length_dev, cache.k, cache.v, self._columns, taps
        )
        cache.length = start + t
        cache.length_dev.add_(t)
        return logits[:t], (feats[:, :t] if feats is not None else None)

    def _bucket_body(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        block: torch.Tensor,
        length: torch.Tensor,
        cache_k: list[torch.Tensor],
        cache_v: list[torch.Tensor],
        columns: torch.Tensor,
        taps: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A bucket's forward: fixed shapes, no host reads (``torch.compile(fullgraph=True)`` takes it).

        Args:
            ids: [1, w] the block (padded); positions: [w] their positions; block: [w, w] bool mask.
            length: 0-d long, the cache's valid entries (the block is written from there on).
            cache_k, cache_v: every layer's [1, KV, capacity, hd] buffers.
            columns: [>= capacity] long, 0, 1, 2, ... (the key slots).
            taps: layers whose outputs are returned as features.

        Returns:
            logits [w, V] and features [1, w, n*D] (or None without taps).
        """
        w = ids.shape[1]
        cap = cache_k[0].shape[2]
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        cos, sin = self._cos[positions].unsqueeze(0), self._sin[positions].unsqueeze(0)  # [1, w, hd]
        slots = self._offsets[:w] + length  # where the block's K/V go
        rel = columns[:cap] - length  # key slot relative to the block's first row
        in_block = (rel >= 0) & (rel < w)
        seen = block.gather(1, rel.clamp(0, w - 1).expand(w, cap))  # [w, cap]: the block's mask at its slots
        mask = (rel < 0) | (in_block & seen)  # cached keys, and the block as its mask says
        h = self.embed(ids)[0]  # [w, D]
        captured: dict[int, torch.Tensor] = {}
        for i, lay in enumerate(self.lean_layers):
            x = _rms(h, lay.ln1, lay.eps1)
            q, k, v = lay.qkv(x)
            q, k, v = q.view(w, nh, hd), k.view(w, nkv, hd), v.view(w, nkv, hd)
            if lay.q_norm is not None and lay.k_norm is not None:
                q, k = _rms(q, lay.q_norm, lay.qk_eps), _rms(k, lay.k_norm, lay.qk_eps)
            q, k = q.transpose(0, 1), k.transpose(0, 1)  # [H, w, hd]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            ck, cv = cache_k[i], cache_v[i]
            ck.index_copy_(2, slots, k.unsqueeze(0))
            cv.index_copy_(2, slots, v.transpose(0, 1).unsqueeze(0))
            a = grouped_attention(q, ck, cv, mask, lay.scaling)  # [H, w, hd]
            (o,) = lay.o(a.transpose(0, 1).reshape(w, nh * hd))
            h = h + o
            x = _rms(h, lay.ln2, lay.eps2)
            g, u = lay.gate_up(x)
            (d,) = lay.down(F.silu(g) * u)
            h = h + d
            if i in taps:
                captured[i] = h
        (logits,) = self.head(_rms(h, self.final_norm, self.final_eps))
        feats = torch.cat([captured[i] for i in taps], dim=-1).unsqueeze(0) if taps else None
        return logits, feats
