"""How many bytes a pair takes on its device, from configs alone (no weights read): the target's
weights under a quantization scheme, the KV caches of target and drafter at a context length, and
the peak while the target loads. ``dflash doctor`` reports it; the loader places layers with it
(``runtime.models.placement``).

Bytes per quantized Linear (out x in weights, activations of ``item`` bytes; biases stay float):

  float     out*in*item
  int8      out*in + out*item                       int8 values, one scale per output row (torchao)
  int4      out*in/2 + out*(in/g)*2*item            4-bit values, a scale and a zero per group of g
                                                    (g = 128, 64 or 32; a width none divides stays float)
  bnb-int8  out*in + out*4                          int8 values, one float32 scale per row
  bnb-nf4   out*in/2 + b + 4*ceil(b/256), b = ceil(out*in/64)
                                                    4-bit values, an 8-bit absmax per block of 64,
                                                    a float32 absmax per 256 blocks (double quant)

Every Linear but the output head is quantized (``quant_schemes.quantizable_linears``); the
embedding, norms and head stay in the float dtype (with tied embeddings the head is the embedding,
counted once).

Loading peaks (what is on the device at once while the target loads; caches come after):

  float, or a folder stored quantized (int8)  the weights: streamed shard by shard onto the device
  quantized at load on a GPU                  quantized weights + 2 x the largest Linear in float:
                                              the float model waits in host RAM, each Linear moves
                                              to the GPU and is quantized there (its float copy and
                                              the library's temporaries), one at a time
  quantized at load on the CPU                the float weights + the largest Linear: all of it is
                                              float before the first Linear is quantized
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from runtime.models.quant_schemes import INT4_GROUP_SIZES

DEFAULT_CONTEXT = 4096  # tokens the caches are sized for when nothing else is asked
SLACK = 1.1  # activations, allocator rounding: 10% on top of what is counted


def linear_bytes(out_features: int, in_features: int, scheme: str | None, item: int) -> int:
    """Bytes of one Linear's weight (no bias) under ``scheme`` (None: float, ``item`` bytes each)."""
    n = out_features * in_features
    if scheme is None:
        return n * item
    if scheme == "int8":
        return n + out_features * item
    if scheme == "int4":
        group = next((g for g in INT4_GROUP_SIZES if in_features % g == 0), None)
        if group is None:
            return n * item  # kept float (quant_schemes does the same)
        return n // 2 + out_features * (in_features // group) * 2 * item
    if scheme == "bnb-int8":
        return n + out_features * 4
    if scheme == "bnb-nf4":
        blocks = math.ceil(n / 64)
        return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / 256)
    raise ValueError(f"unknown quantization scheme {scheme!r}")


def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, tokens: int, item: int) -> int:
    """K and V of ``layers`` layers for ``tokens`` tokens."""
    return 2 * layers * kv_heads * head_dim * tokens * item


def _text_config(cfg: Any) -> Any:
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def target_kv_bytes(target_cfg: Any, tokens: int, item: int) -> int:
    """The target's KV cache at ``tokens`` tokens."""
    c = _text_config(target_cfg)
    heads = int(getattr(c, "num_attention_heads", 1) or 1)
    kv = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    return kv_cache_bytes(int(c.num_hidden_layers), kv, head_dim, tokens, item)


def drafter_kv_bytes(draft_cfg: Any, tokens: int, item: int) -> int:
    """The drafter's KV cache at ``tokens`` tokens of context (it caches every context position,
    projected from the target's features, plus one block)."""
    block = int(draft_cfg.dflash.block_size)
    return kv_cache_bytes(
        int(draft_cfg.num_hidden_layers), int(draft_cfg.num_key_value_heads), int(draft_cfg.head_dim), tokens + block, item
    )


@dataclass(frozen=True)
class TargetWeights:
    """A target's weights on its device, in bytes.

    Attributes:
        scheme: the quantization counted (None: float).
        quantized: the quantized Linears' weights.
        floating: everything kept in the float dtype (embedding, head, norms, biases, Linears a
            scheme leaves float).
        float_total: all weights in the float dtype (the model before quantization).
        largest_linear: the largest quantizable Linear in the float dtype.
        layer_names: the decoder layers' module names, in order.
        layer_bytes: bytes of each decoder layer (its share of ``quantized + floating``).
        other_names: the modules outside the decoder layers that hold weights (embedding, final
            norm, head, rotary tables), which the loader keeps on the first GPU.
    """

    scheme: str | None
    quantized: int
    floating: int
    float_total: int
    largest_linear: int
    layer_names: tuple[str, ...] = ()
    layer_bytes: tuple[int, ...] = ()
    other_names: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        """Bytes on the device once loaded."""
        return self.quantized + self.floating

    @property
    def other_bytes(self) -> int:
        """Bytes outside the decoder layers."""
        return self.total - sum(self.layer_bytes)


def meta_model(target_cfg: Any) -> Any:
    """The target built on the meta device (shapes, no memory, no weights read)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(target_cfg)


def weights_of(model: torch.nn.Module, scheme: str | None, item: int) -> TargetWeights:
    """Count a (meta or loaded float) model's weights under ``scheme``; see the module docstring."""
    from runtime.engine.models.target import find_decoder_layers
    from runtime.models.quant_schemes import quantizable_linears

    q_weights = {id(m.weight): m for _n, m in quantizable_linears(model)} if scheme else {}
    if scheme is None:
        largest = max((m.weight.numel() for _n, m in quantizable_linears(model)), default=0) * item
    else:
        largest = max((m.weight.numel() for m in q_weights.values()), default=0) * item
    seen: set[int] = set()

    def size(params: Sequence[torch.Tensor]) -> tuple[int, int, int]:
        quant = floating = whole = 0
        for p in params:
            if id(p) in seen:
                continue  # tied (the head that is the embedding): counted once
            seen.add(id(p))
            whole += p.numel() * item
            lin = q_weights.get(id(p))
            if lin is not None:
                quant += linear_bytes(lin.out_features, lin.in_features, scheme, item)
            else:
                floating += p.numel() * item
        return quant, floating, whole

    layers = find_decoder_layers(model)
    names = {id(m): n for n, m in model.named_modules()}
    prefix = names[id(layers)]
    layer_bytes = []
    quant = floating = whole = 0
    for layer in layers:
        q, f, w = size(list(layer.parameters()))
        layer_bytes.append(q + f)
        quant, floating, whole = quant + q, floating + f, whole + w
    q, f, w = size(list(model.parameters()))  # buffers (rotary tables): a few KB
    quant, floating, whole = quant + q, floating + f, whole + w
    return TargetWeights(
        scheme,
        quant,
        floating,
        whole,
        largest,
        tuple(f"{prefix}.{i}" for i in range(len(layers))),
        tuple(layer_bytes),
        tuple(outside_modules(model, prefix)),
    )


def outside_modules(model: torch.nn.Module, layers_name: str) -> list[str]:
    """The names of the modules beside the decoder layer list (and beside each of its ancestors),
    which together with the layers cover every weight of ``model`` (a ``device_map``'s keys).

    Raises:
        ValueError: an ancestor of the layers holds weights of its own (no such map exists).
    """
    out: list[str] = []
    path = layers_name.split(".")
    node = model
    for depth, part in enumerate(path):
        if any(True for _ in node.parameters(recurse=False)) or any(True for _ in node.buffers(recurse=False)):
            raise ValueError(f"{'.'.join(path[:depth]) or 'the model'} holds weights beside its layers")
        prefix = ".".join(path[:depth])
        for name, child in node.named_children():
            if name != part and (any(True for _ in child.parameters()) or any(True for _ in child.buffers())):
                out.append(f"{prefix}.{name}" if prefix else name)
        node = getattr(node, part)
    return out


def load_peak(weights: TargetWeights, device_type: str, quantize_at_load: bool) -> int:
    """Bytes on the device at once while the target loads (module docstring)."""
    if not quantize_at_load or weights.scheme is None:
        return weights.total
    if device_type == "cpu":
        return weights.float_total + weights.largest_linear
    return weights.total + 2 * weights.largest_linear
