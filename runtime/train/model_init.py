"""Create a fresh drafter for a target, in the published DFlash config layout."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from runtime.engine.models.drafter import DFlashDraftModel
from runtime.engine.models.drafter_config import DraftModelConfig, default_target_layer_ids
from runtime.engine.models.drafter_io import load_draft_model
from runtime.engine.models.target import TargetModel, find_decoder_layers
from runtime.errors import ConfigError
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
        target_layer_ids: taps (default: the formula of docs/method.md).
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
    """Build a drafter with the initialisation that trained best on a CPU (docs/experiments/2026-11-30-cpu-training-feasibility.md).

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


def target_has_attention_bias(target_model: Any) -> bool:
    """Whether the target's attention q/k/v projections carry biases (Qwen2 does, Qwen3 does not)."""
    attn = getattr(find_decoder_layers(target_model)[-1], "self_attn", None)
    q = getattr(attn, "q_proj", None)
    return getattr(q, "bias", None) is not None


def _mlp_neurons(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, keep: int) -> torch.Tensor:
    """The ``keep`` intermediate neurons of a SwiGLU MLP with the largest weight-norm product
    (|gate row| * |up row| * |down column|), in their original order."""
    score = gate.float().norm(dim=1) * up.float().norm(dim=1) * down.float().norm(dim=0)
    return torch.topk(score, keep).indices.sort().values


@torch.no_grad()
def init_from_target(
    drafter: DFlashDraftModel, target_model: Any, layer_ids: Sequence[int] | None = None
) -> dict[str, Any]:
    """Copy the target's last decoder layer(s) into the drafter's layers where shapes allow.

    Drafter layer i takes target layer ``layer_ids[i]`` (default: the last L_d layers, in order).
    Per tensor:

    - q/k/v/o projections, MLP, input and post-attention norms: copied when the shapes match;
    - MLP narrower than the target's: the neurons with the largest weight-norm product are kept
      (rows of gate/up, columns of down), so the copy is a pruned version of the target's MLP;
    - q/k/v biases (Qwen2): copied when the drafter has ``attention_bias`` (``fit`` sets it for such
      targets), else dropped (reported);
    - q_norm/k_norm: copied from a Qwen3-style target; a Qwen2 target has none, so they stay at 1:
      per-head RMS normalisation of q and k is the one thing the drafter adds, it keeps the
      directions the target learned but not their scale;
    - anything else of a different shape stays at its random/zero initialisation (reported).

    Args:
        drafter: a freshly initialised drafter (same hidden size as the target).
        target_model: the transformers model of the target.
        layer_ids: target layers to copy from, one per drafter layer.

    Returns:
        {"source_layers": [...], "copied": [...], "pruned": [...], "skipped": [...], "notes": [...]}.
    """
    src_layers = find_decoder_layers(target_model)
    n_d = len(drafter.layers)
    ids = list(layer_ids) if layer_ids is not None else list(range(len(src_layers) - n_d, len(src_layers)))
    report: dict[str, Any] = {"source_layers": ids, "copied": [], "pruned": [], "skipped": [], "notes": []}
    dst: Any
    for i, (dst, li) in enumerate(zip(drafter.layers, ids, strict=True)):
        src: Any = src_layers[li]
        pairs = {
            "self_attn.q_proj": src.self_attn.q_proj,
            "self_attn.k_proj": src.self_attn.k_proj,
            "self_attn.v_proj": src.self_attn.v_proj,
            "self_attn.o_proj": src.self_attn.o_proj,
            "input_layernorm": src.input_layernorm,
            "post_attention_layernorm": src.post_attention_layernorm,
        }
        for qk in ("q_norm", "k_norm"):
            if hasattr(src.self_attn, qk):
                pairs[f"self_attn.{qk}"] = getattr(src.self_attn, qk)
            else:
                report["notes"].append(f"layers.{i}.self_attn.{qk}: target has none; kept at 1")
        for name, mod in pairs.items():
            d_mod = dst.get_submodule(name)
            for pname in ("weight", "bias"):
                sp = getattr(mod, pname, None)
                dp = getattr(d_mod, pname, None)
                key = f"layers.{i}.{name}.{pname}"
                if sp is None:
                    continue
                if dp is None:
                    report["skipped"].append(f"{key} (the drafter has no {pname}; target's dropped)")
                elif dp.shape == sp.shape:
                    dp.copy_(sp.detach().to(dp.dtype))
                    report["copied"].append(key)
                else:
                    report["skipped"].append(f"{key} (shape {tuple(sp.shape)} -> {tuple(dp.shape)})")
        mlp, smlp = dst.mlp, src.mlp
        g, u, dn = smlp.gate_proj.weight, smlp.up_proj.weight, smlp.down_proj.weight
        inter = mlp.gate_proj.weight.shape[0]
        key = f"layers.{i}.mlp"
        if g.shape[1] != mlp.gate_proj.weight.shape[1]:
            report["skipped"].append(f"{key} (hidden size {g.shape[1]} -> {mlp.gate_proj.weight.shape[1]})")
            continue
        if inter == g.shape[0]:
            keep = torch.arange(inter)
            report["copied"] += [f"{key}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
        elif inter < g.shape[0]:
            keep = _mlp_neurons(g, u, dn, inter)
            report["pruned"].append(f"{key}: {inter} of {g.shape[0]} neurons (largest weight-norm product)")
        else:
            report["skipped"].append(f"{key} (intermediate {g.shape[0]} -> {inter}: drafter wider than target)")
            continue
        mlp.gate_proj.weight.copy_(g.detach()[keep].to(mlp.gate_proj.weight.dtype))
        mlp.up_proj.weight.copy_(u.detach()[keep].to(mlp.up_proj.weight.dtype))
        mlp.down_proj.weight.copy_(dn.detach()[:, keep].to(mlp.down_proj.weight.dtype))
    return report


def warm_start(
    source: Path, target: TargetModel, data_taps: Sequence[int], num_layers: int | None = None
) -> tuple[Any, dict[str, Any]]:
    """An existing drafter as the starting point of a new run (fine-tuning on new data).

    The drafter keeps its architecture and weights; only its draft vocabulary is chosen anew (the
    layers do not depend on it: the head is the target's own lm_head restricted to the chosen ids),
    with its own ids ranked first (``choose_draft_vocab``). ``num_layers`` above the source's grows
    it: new layers are appended after the source's, each starting as the identity (zero o_proj and
    down_proj, ``init_drafter``), so the grown drafter drafts exactly as the source before its first
    update and training only adds capacity.

    Raises:
        ConfigError: the drafter does not fit the target (hidden size, vocabulary, layer count),
            taps layers the dataset does not hold, or has more layers than ``num_layers``.
    """
    drafter = load_draft_model(source, "cpu", torch.float32)
    n_source = len(drafter.layers)
    if num_layers is not None and num_layers < n_source:
        raise ConfigError(
            f"--layers {num_layers} is fewer than drafter {source}'s {n_source}; a fine-tune can only add layers"
        )
    dc = drafter.config
    problems = []
    if dc.hidden_size != target.hidden_size:
        problems.append(f"hidden size {dc.hidden_size} vs the target's {target.hidden_size}")
    if dc.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {dc.vocab_size} vs the target's {target.vocab_size}")
    n_target = dc.raw.get("num_target_layers")
    if n_target is not None and int(n_target) != target.num_layers:
        problems.append(f"made for a {n_target}-layer target, this one has {target.num_layers}")
    if problems:
        raise ConfigError(f"drafter {source} does not fit this target: " + "; ".join(problems))
    taps = list(drafter.dflash.target_layer_ids)
    missing = [t for t in taps if t not in data_taps]
    if missing:
        raise ConfigError(
            f"drafter {source} taps layers {taps}; the dataset holds {list(data_taps)} (missing {missing}): "
            "build the data with --taps " + ",".join(str(t) for t in taps)
        )
    if num_layers is not None and num_layers > n_source:  # only a drafter that fits is worth growing
        drafter = grow_layers(drafter, num_layers)
        dc = drafter.config
    previous = dict(dc.raw.get("dflash_training") or {})
    report = {
        "source": str(Path(*Path(source).resolve().parts[-2:])),
        "source_steps": previous.get("steps"),
        "source_train_seconds": previous.get("train_seconds"),
        "source_draft_vocab": int(drafter.draft_vocab_ids.numel()) if drafter.draft_vocab_ids is not None else None,
    }
    if len(drafter.layers) > n_source:
        report["grown_from_layers"] = n_source
        report["added_layers"] = len(drafter.layers) - n_source
    # the draft vocabulary is chosen anew from this run's data, its own ids ranked first (choose_draft_vocab)
    # the source's own record and measured acceptance describe another run: not carried over
    dc.raw.pop("dflash_training", None)
    dc.raw.pop("training", None)
    if isinstance(dc.raw.get("dflash_config"), dict):
        dc.raw["dflash_config"] = {k: v for k, v in dc.raw["dflash_config"].items() if k != "acceptance_conditional"}
    return drafter, report


def grow_layers(drafter: Any, num_layers: int, seed: int = 0) -> Any:
    """``drafter`` with identity layers appended up to ``num_layers`` (see ``warm_start``)."""
    cfg = dict(drafter.config.raw)
    cfg["num_hidden_layers"] = num_layers
    if isinstance(cfg.get("layer_types"), list) and cfg["layer_types"]:
        cfg["layer_types"] = [*cfg["layer_types"], *[cfg["layer_types"][-1]] * (num_layers - len(cfg["layer_types"]))]
    grown = init_drafter(cfg, seed=seed)
    state = {k: v for k, v in drafter.state_dict().items() if k != "draft_vocab_ids"}
    missing, unexpected = grown.load_state_dict(state, strict=False)
    n_source = len(drafter.layers)
    assert not unexpected and all(k.startswith("layers.") and int(k.split(".")[1]) >= n_source for k in missing)
    grown.draft_vocab_ids = drafter.draft_vocab_ids
    return grown
