"""The lean forward's decoder layers: each layer's weights read from the transformers module (fused
projections, norms), the float math shared with the bucketed forward (RMSNorm, rotary half-turn), and the
ctypes description of the layer stack for the native layers (``kernels/layers.c``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runtime.engine.models.linear import FusedLinear

# what the native layers read: float32 norms and biases, bf16/int8/float32 weights, q4 (uint8 + float16)
_POINTER_DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.uint8, torch.float16)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # as transformers: normalise in float32, cast back, then scale
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _CastEmbedding:
    """The target's input embedding, looked up in its weight dtype and returned in ``dtype`` (the
    activations'); ``weight`` is the embedding's own (borrowed by the drafter and by training)."""

    def __init__(self, embed: nn.Embedding, dtype: torch.dtype) -> None:
        self.inner, self.weight, self.dtype = embed, embed.weight, dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(ids).to(self.dtype)


class _Layer:
    """One decoder layer's weights, read from the transformers module."""

    def __init__(self, layer: Any, pack: bool, act: torch.dtype, native_f32: bool = False) -> None:
        # a transformers decoder layer (dynamic attributes: typed Any)
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = FusedLinear([attn.q_proj, attn.k_proj, attn.v_proj], pack, native_f32)
        self.o = FusedLinear([attn.o_proj], pack, native_f32)
        self.gate_up = FusedLinear([mlp.gate_proj, mlp.up_proj], pack, native_f32)
        self.down = FusedLinear([mlp.down_proj], pack, native_f32)
        self.ln1 = layer.input_layernorm.weight.detach().to(act)
        self.ln2 = layer.post_attention_layernorm.weight.detach().to(act)
        self.eps1 = float(layer.input_layernorm.variance_epsilon)
        self.eps2 = float(layer.post_attention_layernorm.variance_epsilon)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.q_norm = q_norm.weight.detach().to(act) if q_norm is not None else None
        self.k_norm = k_norm.weight.detach().to(act) if k_norm is not None else None
        self.qk_eps = float(q_norm.variance_epsilon) if q_norm is not None else 0.0
        self.scaling = float(attn.scaling)


def native_stack(layers: list[_Layer], hidden: int, n_heads: int, n_kv: int, head_dim: int) -> tuple[Any, Any, Any]:
    """The ctypes description of every layer (pointers into tensors the caller keeps alive): the
    ``Layer`` array, the model's ``Shape`` and the ``dflash_layers`` wrapper."""
    from runtime.engine.models import kernels

    def ptr(t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        # norms and biases are float32 (the activations'), weights int8, bf16 or q4 (uint8 + float16)
        assert t.is_contiguous() and t.dtype in _POINTER_DTYPES
        return int(t.data_ptr())

    def proj(f: FusedLinear) -> Any:
        assert f.weight is not None
        n, k = f.weight.shape
        k = 2 * k if f.q4 else k  # q4: two 4-bit weights per byte
        scale = f.scale if f.int8 or f.q4 else None
        kind = f.native_kind  # Proj.kind: bf16, int8, float32 or bf16 on the AVX-512-BF16 path
        return kernels.Proj(ptr(f.weight), ptr(scale), ptr(f.bias), int(n), int(k), kind)

    arr = (kernels.Layer * len(layers))()
    for i, lay in enumerate(layers):
        arr[i] = kernels.Layer(
            proj(lay.qkv),
            proj(lay.o),
            proj(lay.gate_up),
            proj(lay.down),
            ptr(lay.ln1),
            ptr(lay.ln2),
            ptr(lay.q_norm),
            ptr(lay.k_norm),
            lay.eps1,
            lay.eps2,
            lay.qk_eps,
            lay.scaling,
        )
    down = layers[0].down
    ffn = int(down.weight.shape[1]) * (2 if down.q4 else 1)  # type: ignore[union-attr]
    shape = kernels.Shape(hidden, n_heads, n_kv, head_dim, ffn)
    return arr, shape, kernels.layers_fn()
