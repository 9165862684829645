"""The DFlash drafter: a few Qwen3-style decoder layers conditioned on target hidden states.

Loads the published z-lab checkpoint layout as it is (config.json + safetensors, no remote code):
``layers.{i}.self_attn.{q,k,v,o}_proj``, ``{q,k}_norm``, ``mlp.{gate,up,down}_proj``,
``{input,post_attention}_layernorm``, ``fc`` [D, n*D], ``hidden_norm``, ``norm``. There is no
embedding and no lm_head: the drafter borrows the target's (docs/method.md).

One forward: block embeddings [x_anchor, M, ..., M] give the queries; keys and values come from
the fused target context C = hidden_norm(fc(concat(features))) followed by the block itself.
Within a step there is no mask (bidirectional block, all context visible) except a sliding
window for ``sliding_attention`` layers. Training passes an explicit block-sparse mask.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from runtime.config import DFlashConfig
from runtime.engine.models.corpus import CORPUS_FILE, CorpusTable, corpus_rows
from runtime.engine.models.drafter_schema import parse_config, read_json_object, read_weight_index
from runtime.engine.models.kv_cache import DraftKVCache
from runtime.errors import ConfigError, ModelLoadError


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers tapped when a drafter config does not list them (docs/method.md, "Checkpoint format").

    One drafter layer taps the middle layer; n > 1 layers tap n ids spread evenly from 1 to
    L_t - 3 with Python's round (half to even).

    Args:
        num_target_layers: L_t, decoder layers of the target.
        num_draft_layers: n, decoder layers of the drafter.

    Returns:
        The layer ids, ascending.
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DraftModelConfig:
    """Architecture of a drafter, parsed from its config.json."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    num_target_layers: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    attention_bias: bool
    hidden_act: str
    dflash: DFlashConfig
    raw: dict[str, Any]

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: Path | str | None = None) -> DraftModelConfig:
        """Parse a drafter config.json dict (``dflash_config`` nested or at top level) through its
        schema (``runtime.engine.models.drafter_schema``).

        Args:
            cfg: the parsed config.json.
            source: the file it came from, named in every error.

        Raises:
            ModelLoadError: a required field is missing or malformed (named).
            ConfigError: a value is out of range (e.g. ``block_size: 0``).
        """
        try:
            return cls._parse(cfg)
        except (ConfigError, ModelLoadError) as e:
            if source is None:
                raise
            raise type(e)(f"{source}: {e}") from None

    @classmethod
    def _parse(cls, cfg: dict[str, Any]) -> DraftModelConfig:
        c = parse_config(cfg)
        n_layers = c.num_hidden_layers
        mask_id = c.shared("mask_token_id")
        layer_ids = c.shared("target_layer_ids")
        n_target = c.shared("num_target_layers")
        block = c.shared("block_size")
        draft_vocab = c.shared("draft_vocab_size")
        if mask_id is None:
            raise ModelLoadError("drafter config.json has no mask_token_id (dflash_config.mask_token_id)")
        if block is None:
            raise ModelLoadError("drafter config.json has no block_size")
        if layer_ids is None:
            if n_target is None:
                raise ModelLoadError("drafter config.json has neither target_layer_ids nor num_target_layers")
            layer_ids = default_target_layer_ids(n_target, n_layers)
        layer_types = c.layer_types or ["full_attention"] * n_layers
        if len(layer_types) != n_layers:
            raise ModelLoadError(f"drafter layer_types has {len(layer_types)} entries for {n_layers} layers")
        heads = c.num_attention_heads
        kv_heads = c.num_key_value_heads or heads
        if heads % kv_heads:
            raise ModelLoadError(f"field num_key_value_heads: {kv_heads} does not divide num_attention_heads ({heads})")
        head_dim = c.head_dim or c.hidden_size // heads
        if head_dim < 2 or head_dim % 2:
            raise ModelLoadError(f"field head_dim: rotary embeddings need an even head size, got {head_dim}")
        nested = c.dflash_config
        copy_ngram = nested.copy_ngram if nested is not None else None
        copy_corpus = nested.copy_corpus if nested is not None else None
        raw = dict(cfg)
        if raw.get("dflash_config") is None:
            raw.pop("dflash_config", None)  # readers of the recorded statistics expect an object or nothing
        return cls(
            hidden_size=c.hidden_size,
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=c.intermediate_size,
            rms_norm_eps=c.rms_norm_eps,
            vocab_size=c.vocab_size,
            num_target_layers=n_target if n_target is not None else -1,
            layer_types=tuple(layer_types),
            sliding_window=c.sliding_window or None,
            attention_bias=c.attention_bias,
            hidden_act=c.hidden_act,
            dflash=DFlashConfig(
                block_size=block,
                mask_token_id=mask_id,
                target_layer_ids=tuple(layer_ids),
                draft_vocab_size=draft_vocab or None,
                copy_ngram=(copy_ngram[0], copy_ngram[1]) if copy_ngram is not None else None,
                copy_corpus=(copy_corpus[0], copy_corpus[1]) if copy_corpus is not None else None,
            ),
            raw=raw,
        )

    def rotary_config(self) -> Any:
        """A transformers Qwen3Config carrying the RoPE settings (theta, scaling) of the drafter."""
        from transformers import Qwen3Config

        keys = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "partial_rotary_factor")
        kw = {k: self.raw[k] for k in keys if self.raw.get(k) is not None}
        return Qwen3Config(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            **kw,
        )


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

        # Kept out of the module tree so that ``.to(dtype)`` never casts inv_freq (stays float32).
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
        """C = hidden_norm(fc(concat features)): [B, T, n*D] -> [B, T, D]."""
        return self.hidden_norm(self.fc(features))

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
        h = block_embeds
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


def _normalise_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    ignored = ("embed_tokens.weight", "lm_head.weight", "rotary_emb.inv_freq")
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        k = key
        for prefix in ("model.", "drafter.", "draft_model."):
            if k.startswith(prefix):
                k = k[len(prefix) :]
        if k.endswith(ignored):
            continue
        out[k] = value
    return out


def read_safetensors(folder: Path, origins: dict[str, Path] | None = None) -> dict[str, torch.Tensor]:
    """Read every safetensors shard of a folder (single file or index).

    Args:
        folder: the model folder.
        origins: filled with the shard each tensor came from, when given.

    Raises:
        ModelLoadError: no weights, an index that is not valid (named), or a shard that is
            truncated or corrupt.
    """
    from safetensors.torch import load_file

    files = sorted(f for f in folder.glob("*.safetensors") if f.name != CORPUS_FILE)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = [folder / s for s in read_weight_index(index)]
    if not files:
        raise ModelLoadError(f"no .safetensors weights in {folder} (pickle weights are not loaded)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"missing weight shard {f}; re-download the model (dflash download)")
        try:
            shard = load_file(str(f))
        except Exception as e:  # safetensors raises its own SafetensorError / OSError types
            raise ModelLoadError(
                f"cannot read {f}: truncated or corrupt safetensors ({e}); re-download the model"
            ) from e
        state.update(shard)
        if origins is not None:
            origins.update(dict.fromkeys(shard, f))
    return state


def check_vocab_ids(ids: torch.Tensor, vocab_size: int, where: str) -> torch.Tensor:
    """A draft vocabulary as loaded: 1-D integer ids in [0, vocab_size), returned as int64.

    Raises:
        ModelLoadError: naming ``where`` (the file and the field).
    """
    if ids.dtype in (torch.bool, torch.complex64, torch.complex128) or ids.is_floating_point():
        raise ModelLoadError(f"{where}: token ids must be integers, got {str(ids.dtype).replace('torch.', '')}")
    if ids.dim() != 1:
        raise ModelLoadError(f"{where}: must be a 1-D list of token ids, got shape {list(ids.shape)}")
    if ids.numel() == 0:
        raise ModelLoadError(f"{where}: holds no token ids")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ModelLoadError(f"{where}: token id {bad} is outside the vocabulary [0, {vocab_size})")
    return ids.to(torch.long)


def read_draft_config(folder: Path) -> DraftModelConfig:
    """Parse a drafter folder's config.json (no weights) through its schema.

    Raises:
        ModelLoadError: no config.json, or one that is unreadable, not UTF-8, not JSON or does not
            fit the schema (the file and the field named).
        ConfigError: a value out of range (e.g. ``block_size: 0``), the file named.
    """
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ModelLoadError(f"{folder} has no config.json; a DFlash drafter folder needs config.json + safetensors")
    return DraftModelConfig.from_dict(read_json_object(cfg_path), cfg_path)


def load_draft_model(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> DFlashDraftModel:
    """Load a drafter folder (config.json + safetensors) as published, without remote code.

    Args:
        path: local folder.
        device: target device.
        dtype: floating dtype for the weights.

    Returns:
        The drafter in eval mode.

    Raises:
        ModelLoadError: missing/corrupt files or weights that do not match the config.
    """
    folder = Path(path)
    config = read_draft_config(folder)
    model = DFlashDraftModel(config)
    origins: dict[str, Path] = {}
    state = _normalise_keys(read_safetensors(folder, origins))
    vocab_ids = state.pop("draft_vocab_ids", None)
    expected = {k for k in model.state_dict() if k != "draft_vocab_ids"}
    if config.dflash.copy_ngram is not None and "copy_bias" not in state:
        state["copy_bias"] = torch.zeros(copy_rows(config.dflash))  # saved before it existed: no bias
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if missing or unexpected:
        raise ModelLoadError(
            f"drafter weights in {folder} do not match its config: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    for k, v in model.state_dict().items():
        if k in state and state[k].shape != v.shape:
            raise ModelLoadError(
                f"drafter weight {k} has shape {tuple(state[k].shape)}, config implies {tuple(v.shape)}"
            )
    model.load_state_dict(state, strict=False)
    if vocab_ids is not None:
        source = next((f for k, f in origins.items() if k.endswith("draft_vocab_ids")), folder)
        model.draft_vocab_ids = check_vocab_ids(vocab_ids, config.vocab_size, f"{source}: draft_vocab_ids")
    elif config.dflash.draft_vocab_size:
        raise ModelLoadError(f"{folder}: config declares draft_vocab_size but the weights lack draft_vocab_ids")
    if config.dflash.copy_corpus is not None:
        try:
            model.corpus = CorpusTable.load(folder, config.dflash.copy_corpus, config.vocab_size)
        except FileNotFoundError:
            raise ModelLoadError(f"{folder}: config declares copy_corpus but the folder has no {CORPUS_FILE}") from None
        except ValueError as e:  # a table that does not fit (CorpusTable.load names the file and the field)
            raise ModelLoadError(str(e)) from None
        except Exception as e:  # safetensors raises its own SafetensorError / OSError types
            raise ModelLoadError(f"{folder}/{CORPUS_FILE} is unreadable: truncated or corrupt ({e})") from e
    return model.to(device=device, dtype=dtype).eval()


def save_draft_model(model: DFlashDraftModel, path: str | Path, extra_config: dict[str, Any] | None = None) -> None:
    """Save a drafter in the published layout (config.json + model.safetensors).

    Args:
        model: the drafter.
        path: output folder (created).
        extra_config: keys merged into config.json (e.g. training metadata).
    """
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(model.config.raw)
    dconf = dict(cfg.get("dflash_config") or {})
    dconf.update(
        mask_token_id=model.dflash.mask_token_id,
        target_layer_ids=list(model.dflash.target_layer_ids),
    )
    if model.dflash.copy_ngram is not None:
        dconf["copy_ngram"] = list(model.dflash.copy_ngram)
    else:
        dconf.pop("copy_ngram", None)
    if model.dflash.copy_corpus is not None:
        if model.corpus is None:
            raise ValueError("the drafter declares copy_corpus but has no corpus table to save")
        dconf["copy_corpus"] = list(model.dflash.copy_corpus)
        model.corpus.save(folder)
    else:
        dconf.pop("copy_corpus", None)
        (folder / CORPUS_FILE).unlink(missing_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k != "draft_vocab_ids"}
    if model.draft_vocab_ids is not None:
        state["draft_vocab_ids"] = model.draft_vocab_ids.detach().cpu().to(torch.long).contiguous()
        dconf["draft_vocab_size"] = int(model.draft_vocab_ids.numel())
    else:
        dconf.pop("draft_vocab_size", None)
    cfg["block_size"] = model.dflash.block_size
    if "block_size" in dconf:
        dconf["block_size"] = model.dflash.block_size
    for key in ("mask_token_id", "target_layer_ids", "draft_vocab_size"):
        if key in cfg:  # a top-level copy (older layout) follows dflash_config: the two must agree
            if key in dconf:
                cfg[key] = dconf[key]
            else:
                cfg.pop(key)
    cfg["dflash_config"] = dconf
    cfg.setdefault("architectures", ["DFlashDraftModel"])
    if extra_config:
        cfg.update(extra_config)
    tmp = folder / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


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


def add_copy_inputs(model: DFlashDraftModel, ngram: tuple[int, int]) -> DFlashDraftModel:
    """Give a drafter copy inputs (``DFlashDraftModel.copy_inputs``) for ``ngram`` context matches.

    The new ``copy_scale`` and ``copy_bias`` start at zero, so the drafter drafts exactly as before
    until trained.
    A drafter that already has copy inputs for the same n-grams is returned unchanged.

    Raises:
        ConfigError: it has copy inputs for other n-gram sizes.
    """
    current = model.dflash.copy_ngram
    if current == tuple(ngram):
        return model
    if current is not None:
        raise ConfigError(f"the drafter has copy inputs for {list(current)}-grams, not {list(ngram)}")
    dflash = replace(model.dflash, copy_ngram=(int(ngram[0]), int(ngram[1])))
    raw = dict(model.config.raw)
    raw["dflash_config"] = {**dict(raw.get("dflash_config") or {}), "copy_ngram": list(dflash.copy_ngram or ())}
    model.config = replace(model.config, dflash=dflash, raw=raw)
    ref = next(model.parameters())
    model.copy_scale = nn.Parameter(
        torch.zeros(ngram[1] + 1, model.config.hidden_size, device=ref.device, dtype=ref.dtype)
    )
    model.copy_bias = nn.Parameter(torch.zeros(ngram[1] + 1, device=ref.device, dtype=ref.dtype))
    return model


def copy_rows(dflash: DFlashConfig) -> int:
    """Rows of ``copy_scale`` / ``copy_bias``: 0..longest for context matches, then the corpus's."""
    assert dflash.copy_ngram is not None
    extra = corpus_rows(dflash.copy_corpus) if dflash.copy_corpus is not None else 0
    return dflash.copy_ngram[1] + 1 + extra


def add_copy_corpus(
    model: DFlashDraftModel, ngram: tuple[int, int], table: CorpusTable | None = None
) -> DFlashDraftModel:
    """Give a drafter with copy inputs a corpus table (``runtime.engine.models.corpus``).

    The corpus's new ``copy_scale`` / ``copy_bias`` rows start as copies of the context's 1-gram
    row: a corpus proposal replaces a 1-gram context copy (or nothing) and starts out trusted as
    much as one. A drafter that already has a corpus of the same sizes gets the new table;
    ``table`` None leaves the table to be set later (``Trainer`` builds it from its counts).

    Raises:
        ConfigError: the drafter has no copy inputs, or a corpus of other sizes.
    """
    current = model.dflash.copy_corpus
    if model.dflash.copy_ngram is None or model.copy_scale is None or model.copy_bias is None:
        raise ConfigError("a corpus needs a drafter with copy inputs (--copy-inputs or --copy-ngram)")
    if current is not None and current != tuple(ngram):
        raise ConfigError(f"the drafter has a corpus of {list(current)}-grams, not {list(ngram)}")
    if table is not None:
        model.corpus = table
    if current is not None:
        return model
    dflash = replace(model.dflash, copy_corpus=(int(ngram[0]), int(ngram[1])))
    raw = dict(model.config.raw)
    raw["dflash_config"] = {**dict(raw.get("dflash_config") or {}), "copy_corpus": list(dflash.copy_corpus or ())}
    model.config = replace(model.config, dflash=dflash, raw=raw)
    extra = corpus_rows(dflash.copy_corpus or ngram)
    with torch.no_grad():
        model.copy_scale = nn.Parameter(torch.cat([model.copy_scale, model.copy_scale[1:2].repeat(extra, 1)]))
        model.copy_bias = nn.Parameter(torch.cat([model.copy_bias, model.copy_bias[1:2].repeat(extra)]))
    return model
