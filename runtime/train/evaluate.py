"""Evaluate a drafter with the real speculative decoder, side by side with plain decoding.

For every prompt, in one process and alternating: plain greedy decoding (block size 1), DFlash at
the verify length the runtime chooses for the device, and DFlash verifying the whole block (which
measures the acceptance of every slot). Reports tau, speed-up and whether DFlash reproduced plain
decoding token for token.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.config import DecodeOptions, SamplingParams
from runtime.engine.acceptance import AcceptanceCounts
from runtime.engine.events import Finished, GenerationStats

if TYPE_CHECKING:
    from runtime.pipeline import Pipeline

Progress = Callable[[str], None]


@dataclass(frozen=True)
class PromptEval:
    """One prompt's measurements."""

    source: str
    ar: GenerationStats
    auto: GenerationStats
    full: GenerationStats | None
    same_output: bool
    first_divergence: int | None
    oov_tokens: int = 0  # plain-decoding tokens outside the drafter's draft vocabulary

    @property
    def speedup(self) -> float:
        """DFlash (auto verify length) tok/s over plain tok/s."""
        return self.auto.tokens_per_second / max(self.ar.tokens_per_second, 1e-9)


@dataclass(frozen=True)
class EvalResult:
    """Summary over prompts (medians, as the issue asks)."""

    prompts: tuple[PromptEval, ...]

    @property
    def median_tau(self) -> float:
        """Median tau at the chosen verify length."""
        return statistics.median(p.auto.tau for p in self.prompts)

    @property
    def median_tau_full(self) -> float:
        """Median tau verifying the whole block."""
        vals = [p.full.tau for p in self.prompts if p.full]
        return statistics.median(vals) if vals else float("nan")

    @property
    def median_speedup(self) -> float:
        """Median per-prompt tok/s ratio DFlash / plain."""
        return statistics.median(p.speedup for p in self.prompts)

    @property
    def identical(self) -> int:
        """Prompts where DFlash produced exactly the plain-decoding tokens."""
        return sum(p.same_output for p in self.prompts)

    def cumulative_acceptance(self) -> list[float]:
        """Pooled P(drafts 1..k accepted) from the full-block runs."""
        runs = [p.full for p in self.prompts if p.full]
        if not runs:
            return []
        return list(sum((r.acceptance for r in runs), AcceptanceCounts()).per_position)

    def conditional_acceptance(self) -> list[float]:
        """P(draft k accepted | drafts 1..k-1 accepted), the verify-length prior stored with a drafter."""
        cum = self.cumulative_acceptance()
        out, prev = [], 1.0
        for c in cum:
            out.append(round(c / prev, 4) if prev > 0 else 0.0)
            prev = c
        return out

    @property
    def pooled_tau(self) -> float:
        """Tokens committed per verify step over all prompts together (chosen verify length)."""
        steps = sum(p.auto.verify_steps for p in self.prompts)
        return (sum(p.auto.accepted_tokens for p in self.prompts) + steps) / max(steps, 1)

    @property
    def oov_share(self) -> float:
        """Share of the target's (plain decoding) tokens outside the draft vocabulary."""
        return sum(p.oov_tokens for p in self.prompts) / max(sum(p.ar.generated_tokens for p in self.prompts), 1)

    def summary(self) -> dict[str, Any]:
        """JSON-friendly summary."""
        return {
            "prompts": len(self.prompts),
            "pooled_tau": round(self.pooled_tau, 3),
            "oov_share": round(self.oov_share, 4),
            "median_tau": round(self.median_tau, 3),
            "median_tau_full_block": round(self.median_tau_full, 3),
            "median_speedup": round(self.median_speedup, 3),
            "median_ar_tok_s": round(statistics.median(p.ar.tokens_per_second for p in self.prompts), 2),
            "median_dflash_tok_s": round(statistics.median(p.auto.tokens_per_second for p in self.prompts), 2),
            "verify_length": statistics.median(p.auto.verify_length for p in self.prompts),
            "identical_to_plain": f"{self.identical}/{len(self.prompts)}",
            "cumulative_acceptance": [round(x, 4) for x in self.cumulative_acceptance()],
            "conditional_acceptance": self.conditional_acceptance(),
        }


def _run(
    pipeline: Pipeline, ids: list[int], params: SamplingParams, opts: DecodeOptions
) -> tuple[list[int], GenerationStats]:
    out: list[int] = []
    stats = None
    for ev in pipeline.stream(ids, params, opts):
        if isinstance(ev, Finished):
            stats = ev.stats
        else:
            out.extend(t.token_id for t in ev.tokens)
    assert stats is not None
    return out, stats


def encode(pipeline: Any, prompt: Any) -> list[int]:
    """Token ids of a prompt: ``ids`` as given, a ``messages`` conversation, or ``text``/``chat``."""
    if getattr(prompt, "ids", None) is not None:
        return list(prompt.ids)
    if getattr(prompt, "messages", None):
        return pipeline.encode_messages(list(prompt.messages))
    return pipeline.encode(prompt.text, chat=prompt.chat)


@dataclass(frozen=True)
class IdPrompt:
    """A prompt given as token ids (e.g. a held-out shard's prompts)."""

    ids: tuple[int, ...]
    chat: bool
    source: str
    text: str = ""


def evaluate(
    pipeline: Pipeline,
    prompts: Sequence[Any],
    max_new_tokens: int = 96,
    full_block: bool = True,
    progress: Progress | None = None,
) -> EvalResult:
    """Measure plain vs DFlash decoding on ``prompts`` (objects with ``text`` and ``chat``).

    Args:
        pipeline: a loaded pipeline with a drafter.
        prompts: held-out prompts (``encode`` says what they may be).
        max_new_tokens: tokens per generation.
        full_block: also run DFlash verifying the whole block (per-slot acceptance).
        progress: callback for one line per prompt.
    """
    params = SamplingParams(max_new_tokens=max_new_tokens)
    # the drafter's own acceptance: no context lookup (its copies would count as the drafter's), and
    # the plan's verify length without the per-step confidence cut (comparable with earlier records)
    ar_opts = DecodeOptions(decoder="ar", cache_prompt=False)
    auto_opts = DecodeOptions(lookup=0, confidence_cut=False, cache_prompt=False)
    full_opts = DecodeOptions(verify_length=pipeline.block_size - 1, cache_prompt=False)
    vocab = getattr(getattr(pipeline, "drafter", None), "draft_vocab_ids", None)
    in_vocab = set(vocab.tolist()) if vocab is not None else None
    warm = encode(pipeline, prompts[0])
    _run(pipeline, warm, SamplingParams(max_new_tokens=8), auto_opts)  # untimed warm-up
    _run(pipeline, warm, SamplingParams(max_new_tokens=8), ar_opts)
    results = []
    for i, p in enumerate(prompts):
        ids = encode(pipeline, p)
        ar_ids, ar = _run(pipeline, ids, params, ar_opts)
        auto_ids, auto = _run(pipeline, ids, params, auto_opts)
        full = _run(pipeline, ids, params, full_opts)[1] if full_block else None
        div = next((j for j, (a, b) in enumerate(zip(ar_ids, auto_ids, strict=False)) if a != b), None)
        if div is None and len(ar_ids) != len(auto_ids):
            div = min(len(ar_ids), len(auto_ids))
        oov = sum(t not in in_vocab for t in ar_ids) if in_vocab is not None else 0
        results.append(PromptEval(p.source, ar, auto, full, div is None, div, oov))
        if progress:
            r = results[-1]
            progress(
                f"[{i + 1}/{len(prompts)}] plain {ar.tokens_per_second:.1f} tok/s | dflash {auto.tokens_per_second:.1f} tok/s"
                f" (x{r.speedup:.2f}, tau {auto.tau:.2f}, K={auto.verify_length})"
                + (f" | full block tau {full.tau:.2f}" if full else "")
                + ("" if div is None else f" | diverges at token {div}")
            )
    return EvalResult(tuple(results))
