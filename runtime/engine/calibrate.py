"""Measure what a verify step costs on this device, to choose the verify length.

``measure_costs`` times target forwards of n = 1..b tokens on top of a KV cache and one drafter
forward, relative to a one-token target forward; for tree verification (``max_tokens`` > b) it
also times a few larger verifies up to ``max_tokens`` (17, 33, 65), as masked trees with tree
positions (what a tree verify runs), and interpolates between them. Every device is measured (a
GPU's flat-looking curve is a measurement too, not a prior). ``cached_costs`` keeps the result in a JSON file
(keyed by model, device, dtype, threads and torch version) so that only the first run pays the
few seconds it takes. Sizes are timed in interleaved rounds and the least time of each is kept,
so a busy spell cannot inflate all repetitions of a few neighbouring sizes.

A measurement taken while the machine is busy can be nonsense (3 drafts cheaper than 1), and a
cached one would mislead every later run. So a measurement is cached only when it is trustworthy
(``untrustworthy``: longer verifies not cheaper than shorter ones beyond noise, repetitions that
agree, close to an earlier measurement); otherwise it is repeated, and if it never settles it is
used for this run only, made monotone. A cached entry that fails the same check is measured again,
and so is one with costs no machine measures (``PER_TOKEN``, ``DRAFT``, ``ONE_TOKEN``, not finite).
The file is read through one schema (``read_costs``): contents that do not fit it (not JSON, another
shape, a folder in its place) are ignored with one line on stderr naming the file, and replaced.
The planners read the result (``runtime.engine.plan``).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from runtime.engine.costs import running_max
from runtime.engine.draft_head import DraftHead
from runtime.engine.models.kv_cache import DraftKVCache
from runtime.engine.tree import ancestor_mask


@dataclass(frozen=True)
class VerifyCosts:
    """Relative costs: ``verify[n-1]`` = time(n-token target forward) / time(1-token forward)."""

    verify: tuple[float, ...]
    draft: float
    one_token_seconds: float
    spread: float = 0.0  # largest (max - min) / median over the repetitions of one length


# Beyond these a measurement is not trusted (not cached): a longer verify measured cheaper than a
# shorter one by more than NOISE, repetitions spread by more than SPREAD, or a cost more than FAR
# (relative) away from an earlier measurement of the same setup.
NOISE = 0.15
SPREAD = 0.35
FAR = 0.5
ATTEMPTS = 3
# Costs no machine measures: a verify of n tokens costing more than PER_TOKEN * n one-token forwards,
# a drafter forward costing more than DRAFT one-token target forwards, a one-token forward slower
# than ONE_TOKEN seconds (or a cost that is not a finite number). A cached entry like that (a damaged
# file) would size every step wrongly; it is measured again.
PER_TOKEN = 4.0
DRAFT = 100.0
ONE_TOKEN = 600.0


def untrustworthy(costs: VerifyCosts, previous: VerifyCosts | None = None) -> str | None:
    """Why a measurement should not be trusted, or None.

    Args:
        costs: the measurement.
        previous: an earlier measurement of the same setup, if any.
    """
    v = costs.verify
    numbers = (*v, costs.draft, costs.one_token_seconds, costs.spread)
    if not all(isinstance(x, float | int) and math.isfinite(x) for x in numbers):
        return "costs that are not finite numbers"
    if not v or any(not (x > 0) for x in v) or not costs.draft >= 0 or not costs.one_token_seconds > 0:
        return "non-positive costs"
    for i in range(len(v)):
        for j in range(i + 1, len(v)):
            if v[j] < v[i] * (1 - NOISE):
                return f"verifying {j + 1} tokens measured cheaper than {i + 1} ({v[j]:.2f} < {v[i]:.2f})"
    if costs.spread > SPREAD:
        return f"repetitions disagree by {costs.spread:.0%}"
    if previous is not None and len(previous.verify) == len(v):
        far = max(abs(a - b) / b for a, b in zip(v, previous.verify, strict=True))
        if far > FAR:
            return f"{far:.0%} away from the earlier measurement"
    if abs(v[0] - 1) > 0.5:
        return f"a one-token verify measured at {v[0]:.3g} of itself"
    for n, x in enumerate(v, start=1):
        if x > PER_TOKEN * n:
            return f"verifying {n} tokens measured at {x:.3g} one-token forwards (implausible)"
    if costs.draft > DRAFT or costs.one_token_seconds > ONE_TOKEN:
        return f"implausible costs (drafter {costs.draft:.3g}, one token {costs.one_token_seconds:.3g} s)"
    return None


def monotone(costs: VerifyCosts) -> VerifyCosts:
    """The measurement with each verify cost raised to the largest shorter one (longer is never cheaper)."""
    out = tuple(round(x, 4) for x in running_max(costs.verify))
    return VerifyCosts(out, costs.draft, costs.one_token_seconds, costs.spread)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


# How costs are measured, part of the cache key: entries timed by an older method (each size's
# repetitions back to back, median kept) are measured again instead of trusted.
METHOD = "rounds-min-trees"  # sizes beyond the block timed as masked trees (2026-12-07)
TREE_POINTS = (12, 17, 24, 33, 48, 65)  # verify sizes timed beyond the block for trees
TREE_VERIFY_TOKENS = 65  # largest tree verify costed by default (budget 64 + the anchor)


@torch.inference_mode()
def measure_costs(pipeline: Any, context: int = 96, reps: int = 3, max_tokens: int | None = None) -> VerifyCosts:
    """Time verify forwards of 1..block_size tokens (and up to ``max_tokens`` for trees) and one
    drafter forward.

    Args:
        pipeline: a loaded ``Pipeline`` with a drafter.
        context: tokens already in the KV cache (a typical prompt).
        reps: repetitions per length, taken in interleaved rounds (the least time is kept).
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

    top = max(b, max_tokens or 0)
    context = max(context, top)
    if prompt.shape[1] < context:
        prompt = torch.randint(0, min(vocab, 20000), (1, context), generator=gen).to(device)
        cache = target.new_cache()
        _, feats = target.forward(prompt, cache, logits_to_keep=1, capture=drafter is not None)
    sizes = list(range(1, b + 1)) + [n for n in TREE_POINTS if b < n < top] + ([top] if top > b else [])
    jobs: dict[Any, Any] = {}
    for n in sizes:
        ids = prompt[:, :n]
        tree = _tree_inputs(n, context, device) if n > b else None  # beyond the block: a masked tree verify

        def verify(ids: torch.Tensor = ids, tree: tuple[torch.Tensor, torch.Tensor] | None = tree) -> None:
            if tree is None:
                target.forward(ids, cache, capture=drafter is not None)
            else:
                target.forward(ids, cache, capture=drafter is not None, positions=tree[0], tree_mask=tree[1])
            target.crop(cache, context)

        jobs[n] = verify
    if drafter is not None and feats is not None:
        head = DraftHead.for_pair(target, drafter)
        mask = drafter.dflash.mask_token_id
        block = torch.full((1, b), mask, dtype=torch.long, device=device)
        ctx = feats[:, -4:]

        def draft() -> None:
            c = DraftKVCache(len(drafter.layers))
            pos = torch.arange(context - 4, context + b, device=device)[None]
            h = drafter(target.embed(block), drafter.fuse_context(ctx), pos, cache=c)
            head.argmax(h[0, 1:])

        jobs["draft"] = draft
    best, spreads = _timed_rounds(jobs, reps, device)
    times = _interpolate(_monotone({n: best[n] for n in sizes}), top)
    draft_rel = best["draft"] / times[0] if "draft" in best else 0.0
    base = times[0]
    return VerifyCosts(tuple(round(t / base, 4) for t in times), round(draft_rel, 4), base, round(max(spreads), 4))


def _tree_inputs(n: int, start: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and ancestor mask of an n-node tree shaped like a verified draft tree (a main chain
    of 7 with side branches), for timing tree verifies as the decoder runs them."""
    parents = [-1] + [i - 1 if i <= 7 else (i - 8) % 7 for i in range(1, n)]
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    positions = torch.tensor([start + d for d in depths], dtype=torch.long, device=device)
    return positions, ancestor_mask(parents, device)


def _timed_rounds(jobs: dict[Any, Any], reps: int, device: torch.device) -> tuple[dict[Any, float], list[float]]:
    """Time every job ``reps`` times in interleaved rounds (after one warm-up round).

    A busy spell on a shared machine lasts longer than one forward, so timing each size's
    repetitions back to back let one spell inflate every repetition of the few sizes it covered,
    and the cached costs then misled the tree budget of every later run. Round by round, a spell
    hits one repetition of many sizes instead, and the least time of each job is kept (noise only
    ever adds time).

    Returns:
        (least time per job, relative spread (max - min) / median of each job's repetitions).
    """
    samples: dict[Any, list[float]] = {k: [] for k in jobs}
    for _ in range(reps + 1):
        for key, fn in jobs.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            samples[key].append(time.perf_counter() - t0)
    best, spreads = {}, []
    for key, got in samples.items():
        kept = got[1:] or got  # the first round warms up
        mid = statistics.median(kept)
        spreads.append((max(kept) - min(kept)) / mid if mid > 0 else 0.0)
        best[key] = min(kept)
    return best, spreads


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
    """Identity of a measurement: model, quantization scheme, target forward (lean, bucketed or transformers; compiled or not;
    and which native CPU kernels it runs), drafter shape, device, dtype, threads, torch version,
    measuring method."""
    d = pipeline.describe()
    drafter = pipeline.drafter
    shape = (
        f"{len(drafter.layers)}L-h{drafter.config.hidden_size}-b{pipeline.block_size}"
        if drafter is not None
        else "none"
    )
    quant = d.get("quantization") or "none"
    engine = {"LeanTarget": "lean", "BucketedTarget": "bucketed"}.get(type(pipeline.target).__name__, "hf")
    if engine == "lean" and d["device"].startswith("cpu"):
        from runtime.engine.models import kernels

        engine += "+" + kernels.identity()
    if getattr(pipeline.target, "is_compiled", False):
        engine += "+compiled"
    parts = [
        d["target"],
        quant,
        engine,
        shape,
        d["device"],
        d["dtype"],
        str(torch.get_num_threads()),
        torch.__version__,
        METHOD,
    ]
    return "|".join(parts)


def cached_costs(
    pipeline: Any, cache_file: Path, remeasure: bool = False, max_tokens: int | None = None
) -> VerifyCosts:
    """Costs from ``cache_file`` or measured now (and stored only when trustworthy).

    Args:
        pipeline: loaded pipeline.
        cache_file: JSON file holding earlier measurements.
        remeasure: ignore a stored measurement (it is still the reference a new one is checked against).
        max_tokens: verify sizes needed (tree verification); a stored measurement that stops
            short of it is measured again.
    """
    key = cache_key(pipeline)
    data, problem = read_costs(cache_file)
    if problem is not None:
        print(f"dflash: ignoring {cache_file} ({problem}); measuring the verify costs again", file=sys.stderr)
    stored = data.get(key)
    if stored is not None and untrustworthy(stored) is not None:
        stored = None  # a poisoned entry (measured on a busy machine by an older dflash): measure again
    if stored is not None and not remeasure and len(stored.verify) >= (max_tokens or 0):
        return stored
    attempts: list[VerifyCosts] = []
    for _ in range(ATTEMPTS):
        costs = measure_costs(pipeline, max_tokens=max_tokens)
        attempts.append(costs)
        if untrustworthy(costs, stored) is None:
            break
        # far from the earlier measurement but agreeing with the one just before: the machine changed
        if len(attempts) > 1 and untrustworthy(costs, attempts[-2]) is None:
            break
    else:
        # never settled (a busy machine): use the calmest attempt for this run only, never cache it
        calm = min(attempts, key=lambda c: c.spread)
        if problem is not None:
            _store(cache_file, data)  # the ignored contents go (said once), the good entries stay
        return stored if stored is not None else monotone(calm)
    data[key] = costs
    _store(cache_file, data)
    return costs


def _store(cache_file: Path, data: dict[str, VerifyCosts]) -> None:
    """Write the measurements to ``cache_file`` (atomically). The cache is an optimisation: an
    unwritable home (or a folder in the file's place) only means measuring again next time."""
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({k: asdict(v) for k, v in data.items()}, indent=2))
        tmp.replace(cache_file)
    except OSError:
        pass


class _StoredCosts(BaseModel):
    """One measurement in the calibration file (``VerifyCosts``; numbers only, no strings)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    verify: list[float] = Field(min_length=1)
    draft: float
    one_token_seconds: float
    spread: float = 0.0


_COST_FILE: TypeAdapter[dict[str, _StoredCosts]] = TypeAdapter(dict[str, _StoredCosts])


def read_costs(cache_file: Path) -> tuple[dict[str, VerifyCosts], str | None]:
    """The measurements stored in ``cache_file`` by ``cache_key``, read through one schema (an object
    of ``{"verify": [numbers], "draft": number, "one_token_seconds": number, "spread": number}``).

    Returns:
        (measurements, None), or ({}, why the file was ignored) where it is not such a file (not
        JSON, not UTF-8, another shape, a folder); no file at all is ({}, None).
    """
    try:
        raw = cache_file.read_bytes()
    except FileNotFoundError:
        return {}, None
    except IsADirectoryError:
        return {}, "a folder, not a file"
    except OSError as e:
        return {}, f"unreadable: {e.strerror}"
    try:
        entries = _COST_FILE.validate_json(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        return {}, f"{where + ': ' if where else ''}{err['msg'].lower()}"
    out = {
        key: VerifyCosts(tuple(v.verify), v.draft, v.one_token_seconds, v.spread) for key, v in entries.items()
    }
    return out, None
