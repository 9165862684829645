"""A lean target forward for Llama-family models (Llama, Qwen2/2.5, Qwen3).

Same contract as ``TargetModel`` (the transformers adapter) with three differences that decide a
decode step's cost on a CPU:

- weights of each projection are packed once per loaded model for oneDNN (``mkldnn`` blocked
  layout, q/k/v fused and gate/up fused) so a step runs one prepacked GEMM per fused projection
  instead of re-laying out bf16 weights on every call (``runtime.engine.models.linear``); int8 weights
  (``--quantize int8``) are fused the same way and read directly by ATen's int8 GEMM, and the
  output head then runs in int8 as well;
- a static KV cache (``StaticKVCache``, ``static_cache.py``): fixed capacity, new entries written in place, cropping
  moves a length, compaction keeps chosen slots (tree verification);
- tapped layer outputs are collected inline (no forward hooks) and logits are computed only for
  the rows asked for;
- bf16 weights on a CPU without native bf16 arithmetic (AVX2, AVX-512 without BF16) keep float32
  activations: the projections read the bf16 weights through dflash's native kernel (which widens
  them to float32 in registers and takes float32 rows anyway), and everything between them (norms,
  rotary embedding, attention, the KV cache) runs in float32 instead of emulated bf16, where every
  elementwise op converts. Same bytes of weights per step, less time around the GEMMs, and a verify
  block computes exactly what one-token steps compute (as in float32);
- where every projection runs on dflash's native kernels with float32 activations (int8 weights,
  or bf16 weights on such CPUs), the decoder layers run as one native call per step
  (``runtime/engine/models/kernels/layers.c``: norms, rotary embedding, attention, SiLU and residuals as
  plain loops between the GEMMs) instead of ~20 eager PyTorch ops per layer; the embedding, the
  final norm and the head stay here. Prompts longer than ``NATIVE_MAX_ROWS`` run the PyTorch layers.

The math mirrors transformers' modelling code (RMSNorm in float32, RoPE from the model's own
rotary module, SDPA with grouped-query attention), so greedy outputs match the transformers path
in float32. Models this module cannot run (other architectures, sliding-window layers, other
activations) stay on ``TargetModel``: see ``lean_supported``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runtime.engine.models.bf16_choice import choose_bf16
from runtime.engine.models.lean_layers import _CastEmbedding, _Layer, _rms, _rotate_half, native_stack
from runtime.engine.models.linear import FusedLinear, Int8Head
from runtime.engine.models.static_cache import StaticKVCache
from runtime.engine.models.target import TargetModel

__all__ = [
    "NATIVE_F32_MIN_PARAMS",
    "NATIVE_MAX_ROWS",
    "LeanTarget",
    "StaticKVCache",
    "lean_supported",
    "_rms",
    "_rotate_half",
]

_FAMILIES = ("llama", "qwen2", "qwen3")

# Steps of at most this many rows run the native layers: every decode step, verify block and tree
# (trees verify at most 65 rows, so verify rows never switch paths); a longer prefill runs PyTorch's
# layers, whose SDPA beats the native per-row attention there (measured, int8, while a build ran:
# 64 prompt tokens 0.79 s native vs 0.91 s, 256 tokens 3.54 s vs 3.35 s, 1,024 19.5 s vs 16.3 s)
NATIVE_MAX_ROWS = 128

# Float32 targets of at least this many parameters run dflash's float32 GEMM and the native layers:
# their steps are bound by reading the weights (2 GB a step for the 0.5B coder), which that kernel
# streams once for all rows of a verify. On the 0.5B coder (2-core AVX-512 EPYC), a one-token step
# takes ~53 ms instead of ~85 ms with oneDNN's packed GEMMs, and a 4-token verify ~80 ms instead of
# ~106 ms. A smaller model's weights stay in cache, where its steps are bound by the arithmetic of
# each row, and oneDNN's kernel keeps a verify of a few rows close to one row's cost (a 64-wide
# test target: 1.07x at 2-5 rows against 1.2-1.5x), which is what drafting needs.
NATIVE_F32_MIN_PARAMS = 50_000_000


def lean_supported(model: nn.Module) -> str | None:
    """Why ``LeanTarget`` cannot run ``model`` (None when it can)."""
    cfg: Any = model.config
    kind = getattr(cfg, "model_type", None)
    if kind not in _FAMILIES:
        return f"model type {kind!r} is not one of {', '.join(_FAMILIES)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} is not silu"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
        return "sliding-window attention layers"
    if getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention"
    inner = getattr(model, "model", None)
    if inner is None or getattr(inner, "rotary_emb", None) is None:
        return "no rotary embedding module at model.model.rotary_emb"
    devices = sorted({str(p.device) for p in model.parameters()})
    if len(devices) > 1:
        return f"its layers are spread over {', '.join(devices)} and the lean forward runs on one device"
    return None


class LeanTarget(TargetModel):
    """``TargetModel`` with a lean forward over a ``StaticKVCache`` (see the module docstring).

    Args:
        model: a transformers Llama/Qwen2/Qwen3 causal LM (``lean_supported(model)`` is None).
        pack: pack weights for oneDNN (CPU, bf16/fp32 plain tensors); False keeps the module weights
            and calls them (quantized tensor subclasses, CUDA).
        float_activations: compute activations in float32 over bf16 weights (None: where the bf16
            projections run on dflash's native kernel, i.e. CPUs without native bf16; see the
            module docstring).
        native_layers: run the decoder layers as one native call (``kernels/layers.c``); None:
            wherever every projection runs on dflash's native kernels with float32 activations.
            True where that does not hold raises ``ValueError``.
        native_f32: float32 weights run dflash's native float32 GEMM (and then the native layers);
            None: for targets of at least ``NATIVE_F32_MIN_PARAMS`` parameters on a CPU.
    """

    def __init__(
        self,
        model: nn.Module,
        pack: bool | None = None,
        float_activations: bool | None = None,
        native_layers: bool | None = None,
        native_f32: bool | None = None,
    ) -> None:
        super().__init__(model)
        why = lean_supported(model)
        if why is not None:
            raise ValueError(f"the lean forward cannot run this model: {why}")
        cfg = self.config
        weights = self.embed.weight.dtype
        if pack is not False and float_activations is not False:
            choose_bf16(model, _one_layer_forward)  # bf16 weights on a CPU: the GEMM path chosen by measurement
        if pack is None:
            pack = FusedLinear.can_pack(self.device, weights)
        self.packed = pack
        if float_activations is None:  # where dflash's kernels run the projections: they take float32 rows
            first: Any = self.layers[0]
            float_activations = pack and FusedLinear.takes_float32_rows(first.self_attn.q_proj.weight)
        act = torch.float32 if float_activations else weights
        self.act_dtype = act
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        attn0: Any = self.layers[0].self_attn
        self.head_dim = int(attn0.head_dim)
        f32 = weights == torch.float32 and (
            native_f32
            if native_f32 is not None
            else sum(p.numel() for p in model.parameters()) >= NATIVE_F32_MIN_PARAMS
        )
        self.lean_layers = [_Layer(layer, pack, act, f32) for layer in self.layers]
        inner: Any = model.model
        self.final_norm = inner.norm.weight.detach().to(act)
        self.final_eps = float(inner.norm.variance_epsilon)
        self.rotary = inner.rotary_emb
        self.head = FusedLinear([self.lm_head], pack, f32)
        # an int8 body (--quantize int8) gets an int8 head too: in float the head would be the
        # largest weight read per step (136M of the 0.5B coder's parameters), as in llama.cpp's Q8_0;
        # so does a q4 body (--quantize q4; 8 bits for the head, as llama.cpp's Q4_K_M keeps its
        # output matrix at 6 bits), and the drafter beside either reads its GEMMs in int8 (int8 True)
        self.int8 = any(lay.qkv.int8 or lay.qkv.q4 for lay in self.lean_layers)
        if self.int8 and not self.head.int8:
            self.head = FusedLinear([Int8Head(self.lm_head)], pack=False)
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)
        self._compiled: Any = None  # torch.compile'd _body (see compile)
        if act != weights:
            self.embed = _CastEmbedding(self.embed, act)  # type: ignore[assignment]
        self._native: Any = None  # (ctypes Layer array, Shape, dflash_layers) when the layers run natively
        why_not_native = self._native_why_not()
        if native_layers and why_not_native is not None:
            raise ValueError(f"the native layers cannot run this model: {why_not_native}")
        if native_layers is not False and why_not_native is None:
            self._native = self._native_stack()

    @property
    def native_layers(self) -> bool:
        """Whether the decoder layers run as one native call per step (``kernels/layers.c``)."""
        return self._native is not None

    def _native_why_not(self) -> str | None:
        if self.device.type != "cpu" or self.act_dtype != torch.float32:
            return "needs float32 activations on a CPU"
        for lay in self.lean_layers:
            for f in (lay.qkv, lay.o, lay.gate_up, lay.down):
                if not (
                    (f.int8 and f.native is not None)
                    or f.bf16 is not None
                    or f.f32 is not None
                    or f.q4_native is not None
                ):
                    return "a projection does not run on dflash's int8, bf16, float32 or q4 kernel"
        if self.head_dim > 512 or self.n_heads % self.n_kv:
            return "head shape"
        from runtime.engine.models.kernels import layers_fn

        if layers_fn() is None:
            return "the native kernels do not run here"
        return None

    def _native_stack(self) -> tuple[Any, Any, Any]:
        """The ctypes description of every layer (pointers into tensors this object keeps)."""
        return native_stack(self.lean_layers, int(self.config.hidden_size), self.n_heads, self.n_kv, self.head_dim)

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the activations, the KV cache and the logits: float32 where dflash's own kernels
        run the projections on a CPU (bf16 weights on the path chosen for them, int8 and q4 bodies),
        else the weights'."""
        return self.act_dtype

    # -- caches --------------------------------------------------------------------------------
    def new_cache(self, capacity: int = 512) -> StaticKVCache:
        """An empty static cache with room for ``capacity`` tokens (it grows when needed)."""
        return StaticKVCache(self.num_layers, self.n_kv, self.head_dim, capacity, self.dtype, self.device)

    @staticmethod
    def crop(cache: Any, keep: int) -> None:
        """Crop ``cache`` to ``keep`` tokens (moves its length)."""
        cache.crop(keep)

    @staticmethod
    def keep(cache: Any, start: int, offsets: torch.Tensor | Sequence[int]) -> None:
        """Keep entries [0, start) plus ``start + offsets`` (tree compaction)."""
        if not isinstance(offsets, torch.Tensor):
            offsets = torch.tensor(list(offsets), dtype=torch.long)
        cache.keep(start, offsets)

    def _rope_tables(self, n: int) -> None:
        """cos/sin for positions [0, n) from the model's own rotary module (rope scaling included)."""
        if self._cos.shape[0] >= n:
            return
        n = max(n, 2 * self._cos.shape[0], 1024)
        pos = torch.arange(n, device=self.device).unsqueeze(0)
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        cos, sin = self.rotary(probe, pos)
        self._cos, self._sin = cos[0], sin[0]  # [n, head_dim]

    # -- forward -------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: Any,
        logits_to_keep: int = 0,
        capture: bool = True,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over new tokens that extends ``cache`` in place.

        Args:
            input_ids: [1, T] new tokens, stored in cache slots length .. length + T - 1.
            cache: a ``StaticKVCache`` from ``new_cache``.
            logits_to_keep: 0 for logits at every position, else the last n positions.
            capture: return the tapped layer outputs.
            positions: [T] absolute positions below ``length + T`` (default: the slots, i.e. a
                contiguous chain; a tree: start + depth).
            tree_mask: [T, T] bool, which new tokens each new token sees (default: causal); every
                new token also sees the whole cache.

        Returns:
            logits [T', V] in the model dtype and features [1, T, n*D] (taps in configured order)
            or None.
        """
        t = int(input_ids.shape[1])
        start = cache.length
        cache.reserve(start + t)
        end = start + t
        if positions is None:
            self._rope_tables(end)
            cos, sin = self._cos[start:end], self._sin[start:end]
        else:
            self._rope_tables(end)  # a tree's positions are start + depth < end: no host read of them
            cos, sin = self._cos[positions], self._sin[positions]
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)  # [1, T, hd] broadcast over heads
        mask = self._mask(t, start, tree_mask)
        causal = mask is None and t > 1  # start == 0 here: a plain causal square
        taps = tuple(self._taps) if capture else ()
        if self._native is not None and self._compiled is None and t <= NATIVE_MAX_ROWS:
            logits, feats = self._native_body(input_ids, cos[0], sin[0], mask, cache, start, logits_to_keep, taps)
            cache.length = end
            return logits, feats
        body = self._compiled if self._compiled is not None else self._body
        try:
            logits, feats = body(input_ids, cos, sin, mask, causal, cache.k, cache.v, start, logits_to_keep, taps)
        except Exception as e:  # noqa: BLE001 - any compiler failure: eager from here on, said once
            if body is self._body:
                raise
            self._compile_failed(e)
            logits, feats = self._body(input_ids, cos, sin, mask, causal, cache.k, cache.v, start, logits_to_keep, taps)
        cache.length = end
        return logits, feats

    def _body(
        self,
        input_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
        cache_k: list[torch.Tensor],
        cache_v: list[torch.Tensor],
        start: int,
        logits_to_keep: int,
        taps: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers, the final norm and the head over new tokens (writes their K/V at ``start``)."""
        t = int(input_ids.shape[1])
        end = start + t
        h = self.embed(input_ids)[0]  # [T, D]
        captured: dict[int, torch.Tensor] = {}
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        for i, lay in enumerate(self.lean_layers):
            # attention: [T, D] -> q [1, H, T, hd], k/v [1, KV, T, hd]
            x = _rms(h, lay.ln1, lay.eps1)
            q, k, v = lay.qkv(x)
            q, k, v = q.view(t, nh, hd), k.view(t, nkv, hd), v.view(t, nkv, hd)
            if lay.q_norm is not None and lay.k_norm is not None:
                q, k = _rms(q, lay.q_norm, lay.qk_eps), _rms(k, lay.k_norm, lay.qk_eps)
            q, k = q.transpose(0, 1), k.transpose(0, 1)  # [H, T, hd]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            ck, cv = cache_k[i], cache_v[i]
            ck[0, :, start:end] = k
            cv[0, :, start:end] = v.transpose(0, 1)
            if t == 1:
                # one query: two small batched GEMMs over the KV groups; SDPA's CPU kernel costs 3-4x
                # more for a single query at a few hundred keys
                groups = nh // nkv
                scores = torch.bmm(q.reshape(nkv, groups, hd), ck[0, :, :end].transpose(1, 2)) * lay.scaling
                probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # [KV, g, end]
                a = torch.bmm(probs, cv[0, :, :end]).reshape(nh, 1, hd)  # heads in order
            else:
                a = F.scaled_dot_product_attention(
                    q.unsqueeze(0),
                    ck[:, :, :end],
                    cv[:, :, :end],
                    attn_mask=mask,
                    is_causal=causal,
                    scale=lay.scaling,
                    enable_gqa=nh != nkv,
                )[0]  # [H, T, hd]
            (o,) = lay.o(a.transpose(0, 1).reshape(t, nh * hd))
            h = h + o
            # MLP
            x = _rms(h, lay.ln2, lay.eps2)
            g, u = lay.gate_up(x)
            (d,) = lay.down(F.silu(g) * u)
            h = h + d
            if i in taps:
                captured[i] = h
        rows = h[-logits_to_keep:] if logits_to_keep else h
        (logits,) = self.head(_rms(rows, self.final_norm, self.final_eps))
        feats = None
        if taps:
            feats = torch.cat([captured[i] for i in taps], dim=-1).unsqueeze(0)
        return logits, feats

    def _native_body(
        self,
        input_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: StaticKVCache,
        start: int,
        logits_to_keep: int,
        taps: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``_body`` with the decoder layers in one native call (``kernels/layers.c``)."""
        arr, shape, fn = self._native
        t = int(input_ids.shape[1])
        h = self.embed(input_ids)[0].to(torch.float32, copy=True).contiguous()  # [T, D], written in place
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        m = mask.to(torch.uint8).contiguous() if mask is not None else None  # None: causal over the slots
        ptr_k, ptr_v = cache.pointers()
        tapbuf = torch.empty((t, len(taps) * int(shape.d)), dtype=torch.float32) if taps else None
        fn(arr, shape, ptr_k, ptr_v, cache.capacity, h, start, cos, sin, m, taps, tapbuf)
        rows = h[-logits_to_keep:] if logits_to_keep else h
        (logits,) = self.head(_rms(rows, self.final_norm, self.final_eps))
        feats = tapbuf.unsqueeze(0) if tapbuf is not None else None
        return logits, feats

    # -- compilation ---------------------------------------------------------------------------
    def compile(self, mode: str | None = None) -> None:
        """Run the layers through ``torch.compile`` from the next forward on (inductor; on CUDA pass
        ``mode="reduce-overhead"`` for CUDA graphs). The GEMMs stay the packed/native kernels (custom
        operators); inductor fuses the norms, rotary embedding, activations and residual adds
        between them. Shapes are dynamic (rows per step, cache length), so a process compiles once
        per kind of step (one token, a verify block) and reuses it for every request. Where
        compilation fails the forward runs eagerly from then on, with one line on stderr."""
        import runtime.engine.models.kernels.ops  # noqa: F401 - registers the custom operators

        self._compiled = torch.compile(self._body, dynamic=True, mode=mode)

    @property
    def is_compiled(self) -> bool:
        """Whether forwards run compiled now (False again after a failed compilation)."""
        return self._compiled is not None

    def _compile_failed(self, e: Exception) -> None:
        import sys

        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        print(f"dflash: torch.compile failed ({type(e).__name__}: {first}); running eagerly", file=sys.stderr)
        self._compiled = None

    def _mask(self, t: int, start: int, tree_mask: torch.Tensor | None) -> torch.Tensor | None:
        """Boolean attention mask [T, start + T] (True = may attend), or None when causal suffices."""
        if tree_mask is None:
            if t == 1 or start == 0:
                return None
            j = torch.arange(start + t, device=self.device)
            i = torch.arange(t, device=self.device).unsqueeze(1)
            return j.unsqueeze(0) <= i + start
        seen = torch.ones(t, start, dtype=torch.bool, device=self.device)
        return torch.cat([seen, tree_mask.to(device=self.device, dtype=torch.bool)], dim=1)

    def set_taps(self, layer_ids: Sequence[int]) -> None:
        """Capture the outputs of these decoder layers (inline; no hooks are registered)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._taps = tuple(int(i) for i in layer_ids)


def _one_layer_forward(model: nn.Module) -> LeanTarget | None:
    """The packed lean forward of a one-layer model, for ``choose_bf16``'s step check (None: not runnable)."""
    return LeanTarget(model, pack=True) if lean_supported(model) is None else None
