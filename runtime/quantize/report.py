"""What quantization does to speed and acceptance: the same short greedy runs on two pairs.

Each pair decodes the same prompts greedily, with DFlash (when it has a drafter) and with plain
decoding, for a fixed number of tokens (EOS ignored, so every run has the same length), after one
untimed warm-up. From the runtime's own ``GenerationStats`` it reports tokens per second and tau;
from the tokens it reports

* agreement: the share of the unquantized target's greedy tokens that the quantized target also
  picks when fed the same text (teacher forcing: one forward over prompt + reference tokens);
* prefix match: the share of each greedy continuation that the quantized target reproduces
  exactly from the start before it first diverges (one early divergence changes all that follows);
* lossless: whether DFlash greedy output equals plain greedy output of the same (quantized)
  target on every prompt, as speculative decoding promises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from runtime.config import DecodeOptions, SamplingParams
from runtime.engine.acceptance import AcceptanceCounts
from runtime.engine.events import Finished, GenerationStats
from runtime.errors import ConfigError

if TYPE_CHECKING:
    from runtime.pipeline import Pipeline

REPORT_PROMPTS = (
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python class for a stack with push, pop and peek.",
    "Write a function that parses a date in YYYY-MM-DD format and returns a tuple of ints.",
    "Write a Python function that counts the words in a text file.",
)


def report_prompts(pipe: Pipeline, n: int) -> list[list[int]]:
    """Token ids of ``n`` built-in coding prompts (chat template when the target has one).

    Targets without a tokenizer get fixed pseudo-random ids (seeded), so any pair can be measured.
    """
    if not 1 <= n <= len(REPORT_PROMPTS):
        raise ConfigError(f"report prompts must be in 1..{len(REPORT_PROMPTS)}, got {n}")
    if pipe.tokenizer is not None:
        return [pipe.encode(text) for text in REPORT_PROMPTS[:n]]
    vocab = pipe.target.vocab_size
    out = []
    for i in range(n):
        gen = torch.Generator().manual_seed(1000 + i)
        out.append([int(x) for x in torch.randint(0, vocab, (12,), generator=gen)])
    return out


@dataclass(frozen=True)
class RunSet:
    """One pair, one decoder, all prompts.

    Attributes:
        decoder: "dflash" or "ar".
        tokens: generated ids per prompt.
        generated_tokens: tokens over all prompts.
        seconds: wall time over all prompts (prefill included).
        tokens_per_second: generated_tokens / seconds.
        tau: tokens committed per verify step (1.0 for plain decoding).
        acceptance_rate: accepted / drafted drafts (0.0 for plain decoding).
    """

    decoder: str
    tokens: tuple[tuple[int, ...], ...]
    generated_tokens: int
    seconds: float
    tokens_per_second: float
    tau: float
    acceptance_rate: float


def _generate(pipe: Pipeline, ids: Sequence[int], n: int, decoder: str) -> tuple[list[int], GenerationStats]:
    params = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    tokens: list[int] = []
    stats: GenerationStats | None = None
    for event in pipe.stream(ids, params, DecodeOptions(decoder=decoder)):
        if isinstance(event, Finished):
            stats = event.stats
        else:
            tokens.extend(t.token_id for t in event.tokens)
    assert stats is not None
    return tokens, stats


def run_set(pipe: Pipeline, prompts: Sequence[Sequence[int]], max_new_tokens: int, decoder: str) -> RunSet:
    """Greedy runs of every prompt with ``decoder`` after one untimed warm-up."""
    _generate(pipe, prompts[0], min(4, max_new_tokens), decoder)  # warm-up: allocator, kernels, caches
    tokens: list[tuple[int, ...]] = []
    all_stats: list[GenerationStats] = []
    for ids in prompts:
        toks, stats = _generate(pipe, ids, max_new_tokens, decoder)
        tokens.append(tuple(toks))
        all_stats.append(stats)
    generated = sum(s.generated_tokens for s in all_stats)
    seconds = sum(s.total_seconds for s in all_stats)
    counts = sum((s.acceptance for s in all_stats), AcceptanceCounts())
    return RunSet(
        decoder=decoder,
        tokens=tuple(tokens),
        generated_tokens=generated,
        seconds=seconds,
        tokens_per_second=generated / max(seconds, 1e-9),
        tau=counts.tau,
        acceptance_rate=counts.acceptance_rate,
    )


@dataclass(frozen=True)
class PairReport:
    """One pair's runs: DFlash (None without a drafter) and plain decoding."""

    dflash: RunSet | None
    ar: RunSet

    @property
    def speedup(self) -> float | None:
        """DFlash tok/s over plain tok/s (None without a drafter)."""
        if self.dflash is None:
            return None
        return self.dflash.tokens_per_second / max(self.ar.tokens_per_second, 1e-9)

    @property
    def lossless(self) -> bool | None:
        """DFlash greedy output == plain greedy output on every prompt (None without a drafter)."""
        return None if self.dflash is None else self.dflash.tokens == self.ar.tokens


def measure_pair(pipe: Pipeline, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> PairReport:
    """Run the prompts with DFlash (if the pair has a drafter) and with plain decoding."""
    dflash = run_set(pipe, prompts, max_new_tokens, "dflash") if pipe.drafter is not None else None
    return PairReport(dflash=dflash, ar=run_set(pipe, prompts, max_new_tokens, "ar"))


@torch.inference_mode()
def agreement(pipe: Pipeline, prompts: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> float:
    """Share of ``reference`` tokens that ``pipe``'s target also picks greedily (teacher forcing)."""
    hits = total = 0
    device = pipe.target.device
    for ids, ref in zip(prompts, reference, strict=True):
        if not ref:
            continue
        seq = torch.tensor([list(ids) + list(ref)], device=device)
        logits, _ = pipe.target.forward(seq, pipe.target.new_cache(), capture=False)
        # logits[i] predicts token i + 1: the predictions for the reference start at the last prompt slot
        picks = logits[len(ids) - 1 : len(ids) - 1 + len(ref)].argmax(dim=-1).tolist()
        hits += sum(int(a == b) for a, b in zip(picks, ref, strict=True))
        total += len(ref)
    return hits / total if total else 1.0


def prefix_share(a: Sequence[int], b: Sequence[int]) -> float:
    """Share of ``b`` that ``a`` reproduces from the start before the first difference."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n / len(b) if b else 1.0


@dataclass(frozen=True)
class QuantReport:
    """Unquantized pair against quantized pair on the same greedy runs.

    Attributes:
        prompts: prompts run.
        max_new_tokens: tokens per run.
        base: the unquantized pair's runs.
        quantized: the quantized pair's runs.
        agreement: share of the unquantized target's greedy tokens the quantized target also picks
            (teacher forcing).
        prefix_match: mean share of each greedy continuation reproduced before the first divergence.
    """

    prompts: int
    max_new_tokens: int
    base: PairReport
    quantized: PairReport
    agreement: float
    prefix_match: float

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (token lists omitted)."""

        def side(p: PairReport) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for name in ("dflash", "ar"):
                r = getattr(p, name)
                if r is None:
                    out[name] = None
                else:
                    d = asdict(r)
                    d.pop("tokens")
                    out[name] = d
            out["speedup"] = p.speedup
            out["lossless"] = p.lossless
            return out

        return {
            "prompts": self.prompts,
            "max_new_tokens": self.max_new_tokens,
            "unquantized": side(self.base),
            "quantized": side(self.quantized),
            "agreement": self.agreement,
            "prefix_match": self.prefix_match,
        }


def compare(
    base: PairReport, quant_pipe: Pipeline, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> QuantReport:
    """Measure ``quant_pipe`` on the prompts ``base`` was measured on and compare the two."""
    quant = measure_pair(quant_pipe, prompts, max_new_tokens)
    reference = base.ar.tokens  # the unquantized target's own greedy continuation
    shares = [prefix_share(q, r) for q, r in zip(quant.ar.tokens, reference, strict=True)]
    return QuantReport(
        prompts=len(prompts),
        max_new_tokens=max_new_tokens,
        base=base,
        quantized=quant,
        agreement=agreement(quant_pipe, prompts, reference),
        prefix_match=sum(shares) / len(shares),
    )
