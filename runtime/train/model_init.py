"""Create a fresh drafter for a target, in the published DFlash config layout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from runtime.engine.drafter import DFlashDraftModel, DraftModelConfig, default_target_layer_ids
from runtime.models.compat import target_dims


def pick_mask_token_id(target_config: Any, tokenizer: Any | None) -> int:
    """An id for the mask token M: the first unused embedding row if the vocab is padded, else the
    pad token, else the last id."""
    _, vocab, _ = target_dims(target_config)
    if tokenizer is not None:
        n = len(tokenizer)
        if n < vocab:
            return n
        if tokenizer.pad_token_id is not None:
            return int(tokenizer.pad_token_id)
    return vocab - 1


def make_drafter_config(
    target_config: Any,
    *,
    num_layers: int = 1,
    block_size: int = 8,
    target_layer_ids: Sequence[int] | None = None,
    mask_token_id: int,
    intermediate_size: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
) -> dict[str, Any]:
    """A drafter config.json dict (Qwen3 config + DFlash keys) for ``target_config``.

    Args:
        target_config: the target's transformers config.
        num_layers: drafter decoder layers.
        block_size: slots per block.
        target_layer_ids: taps (default: the DFLASH.md formula).
        mask_token_id: id of M.
        intermediate_size, num_attention_heads, num_key_value_heads, head_dim: width options
            (default: the target's heads and half its MLP width).
    """
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    hidden, vocab, n_layers = target_dims(target_config)
    heads = num_attention_heads or int(tc.num_attention_heads)
    kv = num_key_value_heads or int(getattr(tc, "num_key_value_heads", heads))
    hd = head_dim or int(getattr(tc, "head_dim", None) or hidden // int(tc.num_attention_heads))
    taps = list(target_layer_ids) if target_layer_ids else default_target_layer_ids(n_layers, num_layers)
    rope = getattr(tc, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = theta or getattr(tc, "rope_theta", 10000.0)
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": block_size,
        "dflash_config": {"mask_token_id": int(mask_token_id), "target_layer_ids": taps},
        "head_dim": hd,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": int(intermediate_size or int(tc.intermediate_size) // 2),
        "layer_types": ["full_attention"] * num_layers,
        "max_position_embeddings": int(getattr(tc, "max_position_embeddings", 32768)),
        "num_attention_heads": heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": kv,
        "num_target_layers": n_layers,
        "rms_norm_eps": float(getattr(tc, "rms_norm_eps", 1e-6)),
        "rope_theta": float(theta or 10000.0),
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": vocab,
    }


def init_drafter(
    config: dict[str, Any], target_final_norm: torch.Tensor | None = None, seed: int = 0
) -> DFlashDraftModel:
    """Build a drafter with the initialisation that trained best on a CPU (TRAINING-NOTES.md).

    Normal(0.02) weights, zero residual output projections (o_proj, down_proj), norms at 1, and the
    final ``norm`` copied from the target's final norm so that logits start at the right scale.
    """
    gen = torch.Generator().manual_seed(seed)
    model = DFlashDraftModel(DraftModelConfig.from_dict(config))
    std = float(config.get("initializer_range", 0.02))
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(p)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.nn.init.zeros_(p)
        else:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    if target_final_norm is not None:
        with torch.no_grad():
            model.norm.weight.copy_(target_final_norm.float())
    return model
