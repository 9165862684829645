"""The bench protocol, shared by local (``runner``) and remote (``remote``) benches: untimed
warm-up, then prompt by prompt every method once, the order rotating so machine drift hits all alike."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

from runtime.bench.config import BenchConfig, MethodSpec
from runtime.bench.methods import PromptRun
from runtime.config import SamplingParams

Progress = Callable[[int, int, str], None]
T = TypeVar("T")


def timed_protocol(
    specs: Sequence[MethodSpec],
    prompts: Sequence[T],
    names: Sequence[str],
    config: BenchConfig,
    params: SamplingParams,
    measure: Callable[[MethodSpec, T, SamplingParams], PromptRun],
    progress: Progress | None = None,
) -> dict[str, list[PromptRun]]:
    """The bench protocol: untimed warm-up, then prompt by prompt every method, order rotating.

    Args:
        specs: the rows.
        prompts: what ``measure`` takes for each prompt (token ids, or the prompt itself).
        names: prompt ids for progress messages.
        config: warm-up count and token budget.
        params: sampling of the timed runs.
        measure: runs one row on one prompt.
        progress: called as ``progress(done, total, what)`` after each run.

    Returns:
        Per row name, its runs in prompt order.
    """
    total = len(specs) * (config.warmup + len(prompts))
    done = 0
    # 1. Warm-up, untimed: every method once (or --warmup times) on the first prompt, short.
    warm = replace(params, max_new_tokens=min(config.max_new_tokens, 16), ignore_eos=True)
    for _ in range(config.warmup):
        for spec in specs:
            measure(spec, prompts[0], warm)
            done += 1
            if progress:
                progress(done, total, f"warm-up {spec.name}")

    # 2. Timed: prompt by prompt, every method, the order rotating by one each prompt.
    runs: dict[str, list[PromptRun]] = {s.name: [] for s in specs}
    for i, prompt in enumerate(prompts):
        shift = i % len(specs)
        for spec in list(specs[shift:]) + list(specs[:shift]):
            runs[spec.name].append(measure(spec, prompt, params))
            done += 1
            if progress:
                progress(done, total, f"{names[i]} {spec.name}")
    return runs
