"""The bf16 path of a bf16 target on a CPU, chosen by measurement at its first load on a machine.

Candidates (``linear.bf16_candidates``: dflash's float32-activation kernel, its AVX-512-BF16 kernel,
oneDNN with bf16 activations) are timed on the target's own step shapes, one-token and 8-row, and
checked: every row of an 8-row GEMM equals the same row alone, and an 8-row verify through the lean
forward's first layer equals 8 one-token steps. The fastest that passes is kept for the process
(``linear.current_bf16_path``) and stored per machine (``runtime.engine.models.kernels.choice``).
``LeanTarget`` calls ``choose_bf16`` as it builds, handing it a builder of itself (so this module
needs not import it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runtime.engine.models import kernels, linear
from runtime.engine.models.kernels.choice import Candidate, cached_choice, row_independent
from runtime.engine.models.linear import DFLASH_BF16_PATHS, FusedLinear, _plain

# How many layers' weights at most (bytes) and how many head weights at most (elements) the bf16
# timing reads: enough to stream from memory as a step does, little enough to copy for oneDNN.
_SAMPLE_BYTES = 128 << 20
_HEAD_MAX = 64 << 20


class _HeadRows:
    """The first ``rows`` rows of an output head (module-like, for timing a huge head)."""

    def __init__(self, linear: Any, rows: int) -> None:
        self.weight = linear.weight.detach()[:rows]
        bias = getattr(linear, "bias", None)
        self.bias = bias.detach()[:rows] if bias is not None else None


def _step_groups(model: nn.Module) -> tuple[list[tuple[list[Any], float]], str] | None:
    """The projections of a Llama-family target's step as ``LeanTarget`` fuses them (q/k/v, o,
    gate/up, down per layer, then the head), sampled: (modules, how many GEMMs of the step each
    stands for), and the shapes' signature. None for another model or weights that are not plain
    bf16 tensors."""
    inner: Any = getattr(model, "model", None)
    layers: Any = getattr(inner, "layers", None)
    head: Any = getattr(model, "lm_head", None)
    if layers is None or head is None or len(layers) == 0:
        return None
    per_layer: list[list[Any]] = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        per_layer.append(
            [[attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]]
        )
    mods = [m for groups in per_layer for g in groups for m in g] + [head]
    if not all(_plain(m.weight) and m.weight.dtype == torch.bfloat16 for m in mods):
        return None
    layer_bytes = sum(m.weight.numel() * 2 for g in per_layer[0] for m in g)
    sample = max(1, min(len(per_layer), _SAMPLE_BYTES // max(layer_bytes, 1)))
    scale = len(per_layer) / sample
    groups: list[tuple[list[Any], float]] = [(g, scale) for groups in per_layer[:sample] for g in groups]
    n_head, k_head = head.weight.shape
    rows = min(int(n_head), max(1, _HEAD_MAX // int(k_head)))
    groups.append(([head if rows == n_head else _HeadRows(head, rows)], n_head / rows))
    sig = ",".join(f"{sum(int(m.weight.shape[0]) for m in g)}x{int(g[0].weight.shape[1])}" for g in per_layer[0])
    return groups, f"L{len(per_layer)}:{sig}|head:{int(n_head)}x{int(k_head)}"


def _first_layer(model: Any) -> Any:
    """``model`` with its first decoder layer only (a shallow copy sharing every module and weight)."""
    inner: Any = copy.copy(model.model)
    inner._modules = dict(inner._modules)
    inner._modules["layers"] = nn.ModuleList([inner.layers[0]])
    cfg = copy.copy(model.config)
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:1]
    outer: Any = copy.copy(model)
    outer._modules = dict(outer._modules)
    outer._modules["model"] = inner
    outer.__dict__["config"] = cfg
    inner.__dict__["config"] = cfg
    return outer


@torch.inference_mode()
def _step_rows_match(model: nn.Module, path: str, lean: Callable[[nn.Module], Any], rows: int = 8) -> bool:
    """Whether a ``rows``-token verify through the lean forward on ``path`` (the first decoder layer
    and the head of ``model``) gives, row for row, the logits and layer output of ``rows`` one-token
    steps from the same cache: the GEMMs and everything between them (with bf16 activations that
    is PyTorch's layers, whose one-row attention is not SDPA's)."""
    shallow = _first_layer(model)
    before = linear._process.get("bf16")
    linear._process["bf16"] = path
    try:
        forward = lean(shallow)  # the lean forward of the one-layer model (None: it cannot run it)
    finally:
        linear._process["bf16"] = before
    if forward is None:
        return False
    forward.set_taps([0])
    g = torch.Generator().manual_seed(3)
    vocab = min(forward.vocab_size, 1000)
    prompt, block = torch.randint(0, vocab, (1, 6), generator=g), torch.randint(0, vocab, (1, rows), generator=g)
    c1, c2 = forward.new_cache(), forward.new_cache()
    forward.forward(prompt, c1, logits_to_keep=1)
    forward.forward(prompt, c2, logits_to_keep=1)
    logits, feats = forward.forward(block, c1)
    for i in range(rows):
        one, f1 = forward.forward(block[:, i : i + 1], c2)
        if (
            not torch.equal(logits[i : i + 1], one)
            or feats is None
            or f1 is None
            or not torch.equal(feats[:, i : i + 1], f1)
        ):
            return False
    return True


def remeasure_bf16() -> None:
    """Make every later ``choose_bf16`` of this process measure again instead of reading a stored
    choice (``dflash doctor --speed``)."""
    linear._process["remeasure"] = "yes"


def choose_bf16(
    model: nn.Module, lean: Callable[[nn.Module], Any], cache_file: Path | None = None, remeasure: bool = False
) -> Any:
    """Choose by measurement the bf16 path of a bf16 target on a CPU (see
    ``runtime.engine.models.kernels.choice``): new projections of this process take it (``current_bf16_path``).

    Args:
        model: a transformers causal LM (Llama family) with plain bf16 weights on the CPU; for any
            other model (or device, dtype) nothing is chosen.
        lean: builds the lean forward of a one-layer copy of ``model`` with packed weights (None
            where it cannot run it): the step check runs through it.
        cache_file: where choices are kept (None: ``choice.choice_file()``).
        remeasure: measure again even where a choice is stored.

    Returns:
        The ``Choice`` (its ``chosen`` None where no path keeps verify rows equal to one-token
        rows: then the default path stays), or None where nothing was chosen.
    """
    params = next(iter(model.parameters()), None)
    if params is None or params.device.type != "cpu" or params.dtype != torch.bfloat16 or "choosing" in linear._process:
        return None
    found = _step_groups(model)
    candidates = linear.bf16_candidates()
    if found is None or not candidates:
        return None
    groups, shapes = found

    def build(path: str) -> Candidate:
        fused = [(FusedLinear(g, pack=True, bf16_path=path), weight) for g, weight in groups]
        k = [int(g[0].weight.shape[1]) for g, _ in groups]
        act = torch.float32 if path in DFLASH_BF16_PATHS else torch.bfloat16
        gemms = [(f, kk, weight) for (f, weight), kk in zip(fused, k, strict=True)]
        # every weight shape (the first layer's four projections and the head), then a whole step
        shapes = [(f, kk) for f, kk, _ in gemms[:4]] + [(gemms[-1][0], gemms[-1][1])]

        def check() -> bool:
            return all(row_independent(f, kk, act) for f, kk in shapes) and _step_rows_match(model, path, lean)

        return Candidate(gemms, act, check)

    linear._process["choosing"] = "yes"
    try:
        choice = cached_choice(shapes, candidates, build, cache_file, remeasure or "remeasure" in linear._process)
    finally:
        linear._process.pop("choosing", None)
    if choice.chosen is not None:
        linear._process["bf16"] = choice.chosen
        kernels.note_bf16_path(choice.chosen)  # verify costs are calibrated per path (kernels.identity)
    return choice
