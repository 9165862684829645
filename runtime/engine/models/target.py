"""Target adapter: any Hugging Face causal LM whose embedding, head and decoder layers can be found.

Hidden-state features are captured with forward hooks on exactly the configured decoder layers
(the OUTPUT of layer l, i.e. HF ``hidden_states[l + 1]``); the model is never asked for all
hidden states.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from runtime.engine.models.kv_cache import cache_len, crop_to, keep_kv
from runtime.errors import UnsupportedModelError

_LAYER_PATHS = (
    "model.layers",
    "model.language_model.layers",
    "language_model.model.layers",
    "transformer.h",
    "gpt_neox.layers",
    "model.decoder.layers",
    "transformer.blocks",
)


def _get_path(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """Locate the decoder layer list of a causal LM.

    Raises:
        UnsupportedModelError: naming the architecture when no layer list is found.
    """
    n = getattr(model.config, "num_hidden_layers", None)
    for path in _LAYER_PATHS:
        layers = _get_path(model, path)
        if isinstance(layers, nn.ModuleList) and (n is None or len(layers) == n):
            return layers
    if n is not None:
        for module in model.modules():
            if isinstance(module, nn.ModuleList) and len(module) == n:
                return module
    arch = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
    raise UnsupportedModelError(
        f"cannot find the decoder layers of {arch}; DFlash needs a causal LM with an embedding, an lm_head "
        "and a list of decoder layers (Qwen3, Qwen2/2.5, Llama and similar work)"
    )


class TargetModel:
    """Wraps a causal LM: forward with a KV cache, capture layer outputs, borrow E and H.

    Attributes:
        model: the transformers model (eval mode).
        embed: its input embedding module.
        lm_head: its output head.
        layers: its decoder layers.
        int8: its projections and head run through the int8 GEMM (``LeanTarget`` of an int8 target).
    """

    int8: bool = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model.eval()
        hf: Any = model  # a transformers PreTrainedModel (typed as nn.Module: torch has no stubs for it)
        self.config: Any = hf.config
        self.layers = find_decoder_layers(model)
        embed = hf.get_input_embeddings()
        head = hf.get_output_embeddings()
        arch = (getattr(self.config, "architectures", None) or [type(model).__name__])[0]
        if embed is None or head is None:
            raise UnsupportedModelError(f"{arch} exposes no input embedding or output head; DFlash needs both")
        self.embed: nn.Embedding = embed  # typed by what DFlash uses: .weight [V, D]
        self.lm_head: nn.Linear = head
        self._taps: tuple[int, ...] = ()
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks: list[Any] = []
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params

    @property
    def num_layers(self) -> int:
        """Decoder layers of the target (L_t)."""
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        """Hidden size D."""
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding table."""
        return int(self.embed.weight.shape[0])

    @property
    def device(self) -> torch.device:
        """Device of the embedding weights."""
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Floating dtype of the embedding weights."""
        return self.embed.weight.dtype

    @property
    def max_positions(self) -> int | None:
        """Context length the target was configured for (None if unknown)."""
        n = getattr(self.config, "max_position_embeddings", None)
        return int(n) if n else None

    def set_taps(self, layer_ids: Sequence[int]) -> None:
        """Capture the outputs of these decoder layers on every forward (replaces earlier taps)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._taps = tuple(int(i) for i in layer_ids)
        for i in sorted(set(self._taps)):
            self._hooks.append(self.layers[i].register_forward_hook(self._make_hook(i)))

    def _make_hook(self, idx: int) -> Any:
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            self._captured[idx] = output[0] if isinstance(output, tuple) else output

        return hook

    def new_cache(self, capacity: int = 0) -> Any:
        """An empty transformers DynamicCache for this model (it grows; ``capacity`` is a hint)."""
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.config)
        except TypeError:  # transformers 4.x
            return DynamicCache()

    @staticmethod
    def cache_len(cache: Any) -> int:
        """Tokens held by ``cache``."""
        return cache_len(cache)

    @staticmethod
    def crop(cache: Any, keep: int) -> None:
        """Crop ``cache`` to ``keep`` tokens (version-portable)."""
        crop_to(cache, keep)

    @staticmethod
    def keep(cache: Any, start: int, offsets: torch.Tensor | Sequence[int]) -> None:
        """Compact ``cache`` to entries [0, start) followed by ``start + offsets``, in that order.

        After a tree verify the cache holds ``start`` committed entries plus one entry per tree
        node; keeping the accepted path's nodes (``offsets`` = their node indices, the root 0
        first) leaves ``start + len(offsets)`` entries, as if the path had been verified alone.

        Args:
            cache: KV cache holding at least ``start + max(offsets) + 1`` entries.
            start: committed entries to keep as they are.
            offsets: node indices (relative to ``start``) to keep, in order.

        Raises:
            UnsupportedModelError: a cache layer type that cannot be compacted (sliding window).
        """
        keep_kv(cache, start, offsets)

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: Any,
        logits_to_keep: int = 0,
        capture: bool = True,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target forward that extends ``cache``.

        Args:
            input_ids: [1, T] new tokens, by default at positions cache_len .. cache_len + T - 1.
            cache: KV cache, extended in place (by T entries, in input order).
            logits_to_keep: 0 for logits at every position, else the last n positions.
            capture: return the tapped layer outputs.
            positions: [T] (or [1, T]) absolute positions of the new tokens (a tree: start + depth).
            tree_mask: [T, T] bool, ``tree_mask[i, j]`` True iff new token i may see new token j;
                every new token also sees the whole cache. None: causal.

        Returns:
            logits [T', V] (float, T' = T or logits_to_keep) and features [1, T, n*D] (the taps
            concatenated in configured order) or None.
        """
        self._captured.clear()
        kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": True}
        if logits_to_keep and self._has_logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        if positions is not None:
            kwargs["position_ids"] = positions.reshape(1, -1).to(device=input_ids.device, dtype=torch.long)
        if tree_mask is not None:
            kwargs["attention_mask"] = self._additive_mask(tree_mask, cache_len(cache), input_ids.device)
        out = self.model(input_ids=input_ids, **kwargs)
        logits = out.logits[0]
        if logits_to_keep:
            logits = logits[-logits_to_keep:]
        feats = None
        if capture and self._taps:
            # layers spread over GPUs: the features meet on the embedding's device (the drafter's)
            feats = torch.cat([self._captured[i].to(self.device) for i in self._taps], dim=-1)
        self._captured.clear()
        return logits, feats

    def _additive_mask(self, tree_mask: torch.Tensor, past: int, device: torch.device) -> torch.Tensor:
        """[1, 1, T, past + T] mask: transformers passes a 4D mask through as it is. SDPA takes it
        as bool (True = visible, as transformers' own SDPA masks); eager attention adds a float mask
        (0 visible, dtype min hidden)."""
        t = int(tree_mask.shape[-1])
        visible = torch.ones(t, past + t, dtype=torch.bool, device=device)
        visible[:, past:] = tree_mask.to(device=device, dtype=torch.bool)
        if getattr(self.config, "_attn_implementation", None) == "sdpa":
            return visible[None, None]
        mask = torch.zeros(t, past + t, dtype=self.dtype, device=device)
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
        return mask[None, None]
