"""Measure what a verify step costs on this device, to choose the verify length.

``measure_costs`` times target forwards of n = 1..b tokens on top of a KV cache and one drafter
forward, relative to a one-token target forward; for tree verification (``max_tokens`` > b) it
also times a few larger verifies up to ``max_tokens`` (17, 33, 65) and interpolates between them. ``cached_costs`` keeps the result in a JSON file
(keyed by model, device, dtype, threads and torch version) so that only the first run pays the
few seconds it takes.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.engine.kv_cache import DraftKVCache


@dataclass(frozen=True)
class VerifyCosts:
    """Relative costs: ``verify[n-1]`` = time(n-token target forward) / time(1-token forward)."""

    verify: tuple[float, ...]
    draft: float
    one_token_seconds: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


TREE_POINTS = (12, 17, 24, 33, 48, 65)  # verify sizes timed beyond the block for trees
TREE_VERIFY_TOKENS = 65  # largest tree verify costed by default (budget 64 + the anchor)


@torch.inference_mode()
def measure_costs(pipeline: Any, context: int = 96, reps: int = 3, max_tokens: int | None = None) -> VerifyCosts:
    """Time verify forwards of 1..block_size tokens (and up to ``max_tokens`` for trees) and one
    drafter forward.

    Args:
        pipeline: a loaded ``Pipeline`` with a drafter.
        context: tokens already in the KV cache (a typical prompt).
        reps: repetitions per length (the median is kept).
        max_tokens: also cost verifies up to this many tokens (tree verification; None: the block).

    Returns:
        ``VerifyCosts`` with ``verify`` dense over n = 1..max(block, max_tokens).
    """
    target, drafter = pipeline.target, pipeline.drafter
    device = target.device
    b = pipeline.block_size
    vocab = target.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, min(vocab, 20000), (1, context), generator=gen).to(device)
    if drafter is not None:
        target.set_taps(drafter.dflash.target_layer_ids)
    cache = target.new_cache()
    _, feats = target.forward(prompt, cache, logits_to_keep=1, capture=drafter is not None)

    def timed(fn: Any) -> float:
        samples = []
        for _ in range(reps + 1):  # first call warms up
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples[1:])

    top = max(b, max_tokens or 0)
    context = max(context, top)
    if prompt.shape[1] < context:
        prompt = torch.randint(0, min(vocab, 20000), (1, context), generator=gen).to(device)
        cache = target.new_cache()
        _, feats = target.forward(prompt, cache, logits_to_keep=1, capture=drafter is not None)
    sizes = list(range(1, b + 1)) + [n for n in TREE_POINTS if b < n < top] + ([top] if top > b else [])
    measured: dict[int, float] = {}
    for n in sizes:
        ids = prompt[:, :n]

        def verify(ids: torch.Tensor = ids) -> None:
            target.forward(ids, cache, capture=drafter is not None)
            target.crop(cache, context)

        measured[n] = timed(verify)
    times = _interpolate(_monotone(measured), top)
    draft_rel = 0.0
    if drafter is not None and feats is not None:
        from runtime.engine.dflash import DraftHead

        head = DraftHead(target, drafter)
        mask = drafter.dflash.mask_token_id
        block = torch.full((1, b), mask, dtype=torch.long, device=device)
        ctx = feats[:, -4:]

        def draft() -> None:
            c = DraftKVCache(len(drafter.layers))
            pos = torch.arange(context - 4, context + b, device=device)[None]
            h = drafter(target.embed(block), drafter.fuse_context(ctx), pos, cache=c)
            head.argmax(h[0, 1:])

        draft_rel = timed(draft) / times[0]
    base = times[0]
    return VerifyCosts(tuple(round(t / base, 4) for t in times), round(draft_rel, 4), base)


def _monotone(measured: dict[int, float]) -> dict[int, float]:
    """Non-decreasing costs: each size takes the least time measured at it or any larger size. A
    longer verify never costs less, and timing noise on a shared machine only ever adds time, so a
    slow outlier is dropped rather than spread over its neighbours."""
    out: dict[int, float] = {}
    low = float("inf")
    for n in sorted(measured, reverse=True):
        low = min(low, measured[n])
        out[n] = low
    return dict(sorted(out.items()))


def _interpolate(measured: dict[int, float], top: int) -> list[float]:
    """Dense times for n = 1..top from timed sizes (linear between neighbours)."""
    known = sorted(measured)
    out = []
    for n in range(1, top + 1):
        if n in measured:
            out.append(measured[n])
            continue
        lo = max(k for k in known if k < n)
        hi = min(k for k in known if k > n)
        w = (n - lo) / (hi - lo)
        out.append(measured[lo] * (1 - w) + measured[hi] * w)
    return out


def cache_key(pipeline: Any) -> str:
    """Identity of a measurement: model, device, dtype, threads, torch version."""
    d = pipeline.describe()
    drafter = pipeline.drafter
    shape = (
        f"{len(drafter.layers)}L-h{drafter.config.hidden_size}-b{pipeline.block_size}"
        if drafter is not None
        else "none"
    )
    return "|".join([d["target"], shape, d["device"], d["dtype"], str(torch.get_num_threads()), torch.__version__])


def cached_costs(
    pipeline: Any, cache_file: Path, remeasure: bool = False, max_tokens: int | None = None
) -> VerifyCosts:
    """Costs from ``cache_file`` or measured now (and stored).

    Args:
        pipeline: loaded pipeline.
        cache_file: JSON file holding earlier measurements.
        remeasure: ignore a stored measurement.
        max_tokens: verify sizes needed (tree verification); a stored measurement that stops
            short of it is measured again.
    """
    key = cache_key(pipeline)
    data: dict[str, Any] = {}
    if cache_file.exists():
        try:
            data = json.loads(cache_file.read_text())
        except (OSError, json.JSONDecodeError):
            data = {}
    if key in data and not remeasure and len(data[key]["verify"]) >= (max_tokens or 0):
        v = data[key]
        return VerifyCosts(tuple(v["verify"]), float(v["draft"]), float(v["one_token_seconds"]))
    costs = measure_costs(pipeline, max_tokens=max_tokens)
    data[key] = asdict(costs)
    try:  # the cache is an optimisation: an unwritable home only means measuring again next time
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(cache_file)
    except OSError:
        pass
    return costs
