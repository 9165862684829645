"""A drafter's architecture as parsed from its config.json (``DraftModelConfig``), the target
layers it taps by default, and the rows its copy inputs need.

Every value comes through the config's schema (``runtime.engine.models.drafter_schema``); the
network is built from this (``runtime.engine.models.drafter``), the folder read and written by
``runtime.engine.models.drafter_io``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.config import DFlashConfig
from runtime.engine.models.corpus import corpus_rows
from runtime.engine.models.drafter_schema import parse_config, read_json_object
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


def copy_rows(dflash: DFlashConfig) -> int:
    """Rows of ``copy_scale`` / ``copy_bias``: 0..longest for context matches, then the corpus's."""
    assert dflash.copy_ngram is not None
    extra = corpus_rows(dflash.copy_corpus) if dflash.copy_corpus is not None else 0
    return dflash.copy_ngram[1] + 1 + extra
