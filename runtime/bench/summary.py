"""A bench row's per-prompt runs summarised into a ``MethodResult``: medians, spread, speedup over
``ar``, pooled acceptance, peak memory, and agreement with ``ar``'s tokens (first divergence)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from runtime.bench.config import MethodSpec
from runtime.bench.methods import PromptRun
from runtime.bench.results import Divergence, MethodResult
from runtime.engine.acceptance import AcceptanceCounts


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def first_divergence(expected: Sequence[int], got: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts), or None if equal."""
    for i, (a, b) in enumerate(zip(expected, got, strict=False)):
        if a != b:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


def summarise(
    spec: MethodSpec,
    runs: Sequence[PromptRun],
    baseline: Sequence[PromptRun] | None,
    draft: str | None,
    check: bool,
    prompt_ids: Sequence[str],
    decode: Callable[[int], str] = str,
    block_size: int | None = None,
) -> MethodResult:
    """Aggregate per-prompt runs into a ``MethodResult``.

    Args:
        spec: the row.
        runs: its runs, in prompt order.
        baseline: ``ar``'s runs on the same prompts (None for ``ar`` itself).
        draft: display name of the draft source.
        check: compare tokens with the baseline (greedy runs).
        prompt_ids: ids of the prompts.
        decode: token id -> text, for divergence reports.
        block_size: the DFlash block size used (None for other methods).
    """
    tps = [r.tokens_per_second for r in runs]
    tpots = [t for r in runs if (t := r.tpot_seconds) is not None]
    speedup = None
    if baseline is not None:
        speedup = _median(
            [r.tokens_per_second / max(b.tokens_per_second, 1e-9) for r, b in zip(runs, baseline, strict=True)]
        )
    elif spec.method == "ar":
        speedup = 1.0
    counts = sum((r.acceptance for r in runs), AcceptanceCounts())
    drafts_known = any(r.drafts_known for r in runs)
    peaks = [r.peak_memory for r in runs if r.peak_memory is not None]
    agreement, divergence = None, None
    if check and baseline is not None:
        agreement = 0
        for i, (r, b) in enumerate(zip(runs, baseline, strict=True)):
            pos = first_divergence(b.tokens, r.tokens)
            if pos is None:
                agreement += 1
            elif divergence is None:
                exp = b.tokens[pos] if pos < len(b.tokens) else None
                got = r.tokens[pos] if pos < len(r.tokens) else None
                divergence = Divergence(
                    i,
                    prompt_ids[i],
                    pos,
                    exp,
                    got,
                    decode(exp) if exp is not None else "",
                    decode(got) if got is not None else "",
                )
    return MethodResult(
        name=spec.name,
        method=spec.method,
        draft=draft,
        block_size=block_size,
        verify_lengths=tuple(r.verify_length for r in runs if r.verify_length is not None),
        tree_budgets=tuple(r.tree_budget for r in runs if r.tree_budget is not None),
        lookups=tuple(r.lookup for r in runs if r.lookup is not None),
        runs=tuple(runs),
        tok_s_median=_median(tps),
        tok_s_mean=float(statistics.fmean(tps)) if tps else 0.0,
        tok_s_stdev=float(statistics.stdev(tps)) if len(tps) > 1 else 0.0,
        tok_s_min=min(tps, default=0.0),
        tok_s_max=max(tps, default=0.0),
        ttft_median=_median([r.ttft_seconds for r in runs]),
        tpot_median=_median(tpots) if tpots else None,
        speedup=speedup,
        tau=counts.tau if counts.steps else None,
        acceptance_rate=counts.acceptance_rate if drafts_known else None,
        per_position_acceptance=counts.per_position,
        acceptance_histogram=counts.histogram,
        peak_memory=max(peaks) if peaks else None,
        agreement=agreement,
        first_divergence=divergence,
    )
