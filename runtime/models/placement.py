"""Where a target's weights go as it loads (``from_pretrained``'s ``device_map``), decided from its
config and each GPU's free memory before any weight is read.

* CPU: loaded on the CPU. MPS, or one GPU: straight onto that device (accelerate streams each shard
  onto it; no copy of the model in host RAM).
* Several GPUs, ``--device auto`` or ``cuda`` (no index), and the pair does not fit the first GPU:
  the decoder layers are spread over the GPUs in order (pipeline style: each layer, with its share
  of the KV cache, on one GPU), filling each up to ``HEADROOM`` of its free memory. The embedding,
  final norm, head and rotary tables stay on the first GPU with the drafter, which borrows the
  embedding and the head. transformers' forward runs such a model (accelerate moves activations
  between GPUs); the lean forward declines it (``lean_supported``). ``cuda:N`` always means GPU N.
* A scheme that quantizes at load (``--quantize``, or a folder stored as float weights) on a GPU:
  loaded on the CPU, then each Linear moves to the GPU and is quantized there, one at a time
  (``quant_schemes.quantize_model_inplace``): the GPU never holds the whole float model
  (``runtime.models.footprint`` gives the peaks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.models.footprint import TargetWeights

HEADROOM = 0.9  # share of a GPU's free memory a placement fills (activations, allocator slack)


def split_layers(layer_bytes: Sequence[int], first_bytes: int, free: Sequence[int]) -> list[int] | None:
    """The GPU of each decoder layer: GPUs filled in order, each up to ``HEADROOM`` of its free
    memory, the first one also holding ``first_bytes`` (embedding, head, drafter...).

    Returns:
        One GPU index per layer (all 0 when the first GPU holds everything), or None when the
        GPUs together cannot hold it.
    """
    budgets = [int(f * HEADROOM) for f in free]
    if not budgets or first_bytes > budgets[0]:
        return None
    used = [0] * len(budgets)
    used[0] = first_bytes
    gpu = 0
    out: list[int] = []
    for size in layer_bytes:
        while used[gpu] + size > budgets[gpu]:
            gpu += 1
            if gpu == len(budgets):
                return None
        used[gpu] += size
        out.append(gpu)
    return out


@dataclass(frozen=True)
class Placement:
    """How the target loads.

    Attributes:
        device_map: ``from_pretrained``'s ``device_map`` (None: the CPU).
        quantize_onto: after loading on the CPU, quantize Linear by Linear onto this device.
        note: one line for the progress display (empty: nothing worth saying).
    """

    device_map: str | dict[str, int] | None
    quantize_onto: torch.device | None = None
    note: str = ""

    @property
    def gpus(self) -> int:
        """GPUs the target's weights use (0 off CUDA)."""
        if isinstance(self.device_map, dict):
            return len(set(self.device_map.values()))
        return 1 if isinstance(self.device_map, str) and self.device_map.startswith("cuda") else 0


def gpu_free_memory() -> list[int]:
    """Free bytes on each visible GPU."""
    return [int(torch.cuda.mem_get_info(i)[0]) for i in range(torch.cuda.device_count())]


def place(
    device: torch.device,
    quantize_at_load: bool,
    weights: TargetWeights | None = None,
    first_extra: int = 0,
    free: Sequence[int] | None = None,
) -> Placement:
    """Decide where the target loads (module docstring).

    Args:
        device: the resolved device (``cuda`` without an index may spread over GPUs).
        quantize_at_load: a scheme quantizes the weights after loading (not a folder stored quantized).
        weights: the target's weights with ``layer_bytes`` including each layer's KV cache (None:
            unknown, one device).
        first_extra: bytes that go on the first GPU besides the target's own (drafter, its cache).
        free: free bytes per GPU (None: measured).
    """
    if device.type == "cpu":
        return Placement(None)
    if quantize_at_load:
        return Placement(None, device, f"loading on the CPU, quantizing each layer onto {device}")
    one = Placement(str(device))
    if device.type != "cuda" or device.index is not None or weights is None:
        return one
    free = gpu_free_memory() if free is None else free
    if len(free) < 2:
        return one
    split = split_layers(weights.layer_bytes, weights.other_bytes + first_extra, free)
    if split is None or max(split) == 0:
        return one  # fits the first GPU, or fits nowhere (the load's out-of-memory error says so)
    device_map = dict.fromkeys(weights.other_names, 0)
    device_map.update(zip(weights.layer_names, split, strict=True))
    used = max(split) + 1
    return Placement(device_map, None, f"spreading {len(split)} layers over {used} GPUs (it does not fit one)")


def sized_for(target_cfg: object, dtype: torch.dtype, tokens: int) -> TargetWeights | None:
    """The target's float weights per layer plus each layer's KV cache at ``tokens`` tokens, built
    on the meta device from its config (None: transformers cannot build it, or no layer list)."""
    from dataclasses import replace

    from runtime.errors import DFlashError
    from runtime.models.footprint import meta_model, target_kv_bytes, weights_of

    item = torch.empty((), dtype=dtype).element_size()
    try:
        weights = weights_of(meta_model(target_cfg), None, item)
    except (DFlashError, ValueError, TypeError, KeyError, AttributeError, RuntimeError):
        return None
    n = len(weights.layer_bytes)
    per_layer = target_kv_bytes(target_cfg, tokens, item) // max(n, 1)
    return replace(weights, layer_bytes=tuple(b + per_layer for b in weights.layer_bytes))


def move_rest(model: torch.nn.Module, device: torch.device) -> None:
    """Move every parameter and buffer not yet on ``device`` there, one tensor at a time (tied
    weights stay tied); those already there (the quantized Linears) are left as they are."""
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is None or t.device == device or (device.index is None and t.device.type == device.type):
                    continue
                if id(t) not in moved:
                    new = t.detach().to(device)
                    moved[id(t)] = torch.nn.Parameter(new, t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
                store[name] = moved[id(t)]  # type: ignore[assignment]
