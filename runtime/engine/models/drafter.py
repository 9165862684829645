"""The DFlash drafter: a few Qwen3-style decoder layers conditioned on target hidden states.

Weights come in the published z-lab checkpoint layout (no remote code; read by
``runtime.engine.models.drafter_io``):
``layers.{i}.self_attn.{q,k,v,o}_proj``, ``{q,k}_norm``, ``mlp.{gate,up,down}_proj``,
``{input,post_attention}_layernorm``, ``fc`` [D, n*D], ``hidden_norm``, ``norm``. There is no
embedding and no lm_head: the drafter borrows the target's (docs/method.md).

One forward: block embeddings [x_anchor, M, ..., M] give the queries; keys and values come from
the fused target context C = hidden_norm(fc(concat(features))) followed by the block itself.
Within a step there is no mask (bidirectional block, all context visible) except a sliding
window for ``sliding_attention`` layers. Training passes an explicit block-sparse mask.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from runtime.config import DFlashConfig
from runtime.engine.models.corpus import CorpusTable
from runtime.engine.models.drafter_config import DraftModelConfig, copy_rows
from runtime.engine.models.kv_cache import DraftKVCache
from runtime.errors import ModelLoadError


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in float32 (as Qwen3)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, hd]; cos/sin: [B, T, hd]
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


class DraftAttention(nn.Module):
    """Queries from the block; keys/values from [context ; block] through the same projections."""

    def __init__(self, cfg: DraftModelConfig, layer_idx: int) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, self.n_kv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, self.n_kv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        sliding = cfg.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = cfg.sliding_window if sliding else None

    def forward(
        self,
        h: torch.Tensor,
        ctx: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: DraftKVCache | None,
    ) -> torch.Tensor:
        """Attend from block queries to context + block keys.

        Args:
            h: [B, Q, D] normalised block hidden states.
            ctx: [B, C, D] fused context not yet in the cache (C may be 0).
            cos, sin: [B, C + Q, hd] RoPE tables for the context then the block positions.
            mask: optional boolean [B or 1, 1, Q, K_total] (True = may attend), K_total counting
                cached entries first.
            cache: the drafter KV cache (inference) or None (training).

        Returns:
            [B, Q, D].
        """
        b, q_len, _ = h.shape
        c_len = ctx.shape[1]
        q = self.q_norm(self.q_proj(h).view(b, q_len, self.n_heads, self.head_dim)).transpose(1, 2)
        kv_in = torch.cat([ctx, h], dim=1) if c_len else h
        k = self.k_norm(self.k_proj(kv_in).view(b, c_len + q_len, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, c_len + q_len, self.n_kv, self.head_dim).transpose(1, 2)
        q = _rope(q, cos[:, -q_len:], sin[:, -q_len:])
        k = _rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.head_dim**-0.5, enable_gqa=self.n_kv != self.n_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.n_heads * self.head_dim))


class DraftMLP(nn.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, cfg: DraftModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        if cfg.hidden_act not in ("silu", "swish"):
            raise ModelLoadError(f"drafter hidden_act {cfg.hidden_act!r} is not supported (only silu)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """Pre-norm decoder layer; the context only feeds keys and values."""

    def __init__(self, cfg: DraftModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DraftAttention(cfg, layer_idx)
        self.mlp = DraftMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        ctx: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: DraftKVCache | None,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), ctx, cos, sin, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(nn.Module):
    """The drafter network (no embedding, no head: both are borrowed from the target).

    Attributes:
        config: parsed architecture.
        draft_vocab_ids: optional [V_d] int64 buffer: the reduced draft vocabulary (EAGLE-3 style).
        copy_scale: with ``dflash.copy_ngram``, a [longest + 1, D] parameter: row n scales the
            embedding of the token the context lookup proposes for a slot when its match was an
            n-gram (``copy_inputs``); row 0 (no match) is never used.
        copy_bias: with ``dflash.copy_ngram``, a [longest + 1] parameter: entry n is added to the draft
            logit of the token the lookup proposes for a slot when its match was an n-gram, scored
            from the target's full head when it is outside the draft vocabulary (``copy_logit_bias``;
            a pointer to the context next to the drafter's own head). Entry 0 is never used.
    """

    def __init__(self, config: DraftModelConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        n_taps = len(config.dflash.target_layer_ids)
        self.layers = nn.ModuleList(DraftLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(n_taps * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        # Kept out of the module tree so that ``.to(dtype)`` never casts inv_freq (stays float32);
        # built on the CPU even when the drafter is built on the meta device (``load_draft_model``).
        with torch.device("cpu"):
            self._rotary: list[nn.Module] = [Qwen3RotaryEmbedding(config.rotary_config())]
        self.draft_vocab_ids: torch.Tensor | None
        self.register_buffer("draft_vocab_ids", None, persistent=True)
        self.copy_scale: nn.Parameter | None = None
        self.copy_bias: nn.Parameter | None = None
        self.corpus: CorpusTable | None = None
        if config.dflash.copy_ngram is not None:
            rows = copy_rows(config.dflash)
            self.copy_scale = nn.Parameter(torch.zeros(rows, d))
            self.copy_bias = nn.Parameter(torch.zeros(rows))

    def copy_inputs(self, copy_embeds: torch.Tensor, matched: torch.Tensor) -> torch.Tensor:
        """What the copy inputs add to the block's embeddings.

        Args:
            copy_embeds: [B, Q, D] target embeddings of the tokens the context lookup proposes for
                each block position (any id where it proposes none).
            matched: [B, Q] length of the n-gram the proposal continues (0: none, adds nothing).

        Returns:
            [B, Q, D] ``copy_scale[matched] * copy_embeds``, zero where ``matched`` is 0.
        """
        assert self.copy_scale is not None, "this drafter has no copy inputs"
        scale = self.copy_scale[matched.clamp(max=self.copy_scale.shape[0] - 1)] * (matched > 0)[..., None]
        return scale.to(copy_embeds.dtype) * copy_embeds

    def copy_logit_bias(self, matched: torch.Tensor) -> torch.Tensor:
        """What the copy inputs add to the logit of each slot's proposed token.

        Args:
            matched: [...] length of the n-gram each proposal continues (0: none).

        Returns:
            [...] float32 ``copy_bias[matched]``, zero where ``matched`` is 0.
        """
        assert self.copy_bias is not None, "this drafter has no copy inputs"
        bias = self.copy_bias.float()[matched.clamp(max=self.copy_bias.shape[0] - 1)]
        return bias * (matched > 0)

    @property
    def dflash(self) -> DFlashConfig:
        """Block size, mask id and target layer ids."""
        return self.config.dflash

    def fuse_context(self, features: torch.Tensor) -> torch.Tensor:
        """C = hidden_norm(fc(concat features)): [B, T, n*D] -> [B, T, D].

        The target may hand over float32 features from bf16 weights (its float32-activation
        kernel on CPUs); they are cast to the drafter's own dtype here.
        """
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def sliding_mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
        """Boolean [1, 1, Q, K] mask keeping keys within ``window`` positions of each query."""
        diff = q_pos.view(-1, 1) - k_pos.view(1, -1)
        return (diff < window).view(1, 1, q_pos.numel(), k_pos.numel())

    def forward(
        self,
        block_embeds: torch.Tensor,
        context: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: DraftKVCache | None = None,
        key_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the drafter layers.

        Args:
            block_embeds: [B, Q, D] target embeddings of the block ids (anchor, masks...).
            context: [B, C, D] fused context features (``fuse_context``) not yet cached.
            position_ids: [B, C + Q] absolute positions of the new context then the block.
            mask: optional boolean attention mask [B or 1, 1, Q, K] (training layout).
            cache: drafter KV cache at inference; new context and block K/V are appended (the
                caller crops the block back out).
            key_positions: [K] absolute positions of every key (cached + new), only needed for
                sliding-window layers at inference.

        Returns:
            [B, Q, D] final-normed hidden states; logits come from the target head.
        """
        h = block_embeds.to(self.norm.weight.dtype)
        context = context.to(h.dtype)
        rotary = self._rotary[0]
        if rotary.inv_freq.device != h.device:
            self._rotary[0] = rotary = rotary.to(h.device)
        cos, sin = rotary(h, position_ids)
        q_pos = position_ids[0, context.shape[1] :]
        for layer in self.layers:
            layer_mask = mask
            window = cast(DraftLayer, layer).self_attn.sliding_window
            if window is not None and key_positions is not None:
                wmask = self.sliding_mask(q_pos, key_positions, window)
                layer_mask = wmask if layer_mask is None else (layer_mask & wmask)
            h = layer(h, context, cos, sin, layer_mask, cache)
        return self.norm(h)


def draft_columns_to_ids(
    columns: torch.Tensor, vocab_ids: torch.Tensor | None, extra_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Columns of a drafter's head -> full-vocabulary ids.

    Args:
        columns: [K, ...] column indices; with a reduced draft vocabulary, index V_d is the copy
            inputs' extra column (``DraftHead.with_copies``).
        vocab_ids: [V_d] full id of each column (``draft_vocab_ids``), or None for the full vocabulary.
        extra_ids: [K] full id of row k's extra column, or None when there is none.
    """
    if vocab_ids is None:
        return columns
    table = vocab_ids.to(columns.device)
    n = table.numel()
    ids = table[columns.clamp(max=n - 1)]
    if extra_ids is None:
        return ids
    extra = extra_ids.to(ids.device).view((-1,) + (1,) * (columns.dim() - 1)).expand_as(columns)
    return torch.where(columns == n, extra, ids)
