"""``dflash bench``: one prompt set through several decoding methods on the same target, in one
process, compared as ratios.

Methods (``METHODS``):

- ``ar``: plain greedy decoding, our loop with a block of one token (the baseline);
- ``hf``: transformers' ``generate`` (what most users run today);
- ``pld``: transformers' prompt-lookup decoding (drafts copied from the prompt's n-grams);
- ``assisted``: transformers' assisted generation with a small same-tokenizer draft model;
- ``dflash``: our DFlash decoder, at the runtime's own verify length or at each swept block size.

Protocol: every method gets untimed warm-up runs first; then, prompt by prompt, every method
runs once, the order rotating from prompt to prompt so that machine drift hits all alike. Runs are
timed with the device synchronised around the clock (``runtime.bench.methods``). Greedy methods
must reproduce ``ar``'s tokens; the first divergence is reported when they do not (in bf16 a
batched verify and a one-token forward may break near-ties differently; docs/method.md).

Results are frozen dataclasses (``BenchResult``); the CLI renders them and stores them
(``runtime.bench.store``). Timed runs and the assistant model live in ``runtime.bench.methods``,
pitfall checks in ``runtime.bench.pitfalls``, the recorded environment in ``runtime.bench.env``.
Nothing here prints.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from runtime.bench.datasets import Prompt, PromptMode, PromptSet
from runtime.bench.env import environment
from runtime.bench.methods import Assistant, PeakMemory, PromptRun, load_assistant, run_decoder, run_generate
from runtime.bench.pitfalls import BenchWarning, drafter_dtype, drafter_training, drafter_training_length, find_pitfalls
from runtime.config import GREEDY_BELOW, MAX_LOOKUP, DecodeOptions, SamplingParams
from runtime.engine.acceptance import AcceptanceCounts
from runtime.errors import ConfigError, InputError

if TYPE_CHECKING:
    from runtime.pipeline import Pipeline

__all__ = [
    "Assistant",
    "BenchConfig",
    "BenchResult",
    "BenchWarning",
    "Divergence",
    "MethodResult",
    "MethodSpec",
    "PromptRun",
    "drafter_dtype",
    "drafter_training_length",
    "encode_prompt",
    "environment",
    "find_pitfalls",
    "first_divergence",
    "load_assistant",
    "run_bench",
    "summarise",
]

METHODS = ("ar", "hf", "pld", "assisted", "dflash")
SCHEMA = "dflash.bench/1"
Progress = Callable[[int, int, str], None]
T = TypeVar("T")


@dataclass(frozen=True)
class BenchConfig:
    """What to measure.

    Attributes:
        methods: methods to run (``ar`` is always added: it is the baseline).
        block_sizes: DFlash block sizes to sweep (empty: the runtime's own choice of block and
            verify length, as ``dflash run`` uses).
        verify_length: drafts verified per DFlash step (None: the runtime's choice).
        tree_budgets: tree budgets to sweep for DFlash (0: the chain, None: the runtime's choice);
            empty: one row with ``tree_budget``.
        tree_budget: tree budget of the DFlash rows when not sweeping (None: the runtime's choice).
        lookups: context-lookup lengths to sweep for DFlash (0: off, None: the runtime's default);
            empty: one row with ``lookup``.
        lookup: context-lookup length of the DFlash rows when not sweeping (None: the default).
        max_new_tokens: tokens generated per prompt.
        temperature: 0 for greedy (tokens are then checked against ``ar``).
        seed: sampling seed.
        warmup: untimed runs per method before timing.
        stop_at_eos: stop at EOS (default: fixed-length runs of ``max_new_tokens``).
        pld_tokens: drafts per step for prompt lookup (transformers' ``prompt_lookup_num_tokens``).
        pld_ngram: longest n-gram prompt lookup matches (``max_matching_ngram_size``).
        mode: force "raw" or "chat" prompts (None: each prompt set's own).
        thinking: turn the chat template's thinking mode on (where it has one).
    """

    methods: tuple[str, ...] = ("ar", "hf", "pld", "dflash")
    block_sizes: tuple[int, ...] = ()
    verify_length: int | None = None
    tree_budgets: tuple[int | None, ...] = ()
    tree_budget: int | None = None
    lookups: tuple[int | None, ...] = ()
    lookup: int | None = None
    confidence_cut: bool | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    warmup: int = 1
    stop_at_eos: bool = False
    pld_tokens: int = 10
    pld_ngram: int = 2
    mode: PromptMode | None = None
    thinking: bool = False

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ConfigError(f"unknown bench method {unknown[0]!r}; use some of {', '.join(METHODS)}")
        if not self.methods:
            raise ConfigError(f"name at least one method among {', '.join(METHODS)}")
        bad = [b for b in self.block_sizes if b < 2]
        if bad:
            raise ConfigError(f"--block-size values must be >= 2 (block size 1 is the ar row), got {bad[0]}")
        if self.block_sizes and "dflash" not in self.methods:
            raise ConfigError("--block-size sweeps DFlash block sizes; add dflash to --methods")
        if self.verify_length is not None and self.verify_length < 1:
            raise ConfigError(f"--verify-length must be >= 1, got {self.verify_length}")
        budgets = [b for b in (*self.tree_budgets, self.tree_budget) if b is not None]
        if any(b < 0 for b in budgets):
            raise ConfigError(f"tree budgets must be >= 0 (0 = chain), got {min(budgets)}")
        if self.tree_budgets and "dflash" not in self.methods:
            raise ConfigError("--tree-budgets sweeps DFlash tree budgets; add dflash to --methods")
        if self.lookups and "dflash" not in self.methods:
            raise ConfigError("--lookups sweeps DFlash's context lookup; add dflash to --methods")
        if any(n is not None and not 0 <= n <= MAX_LOOKUP for n in (*self.lookups, self.lookup)):
            raise ConfigError(f"lookup lengths must be in [0, {MAX_LOOKUP}] (0 = off)")
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0, got {self.temperature}")
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {self.warmup}")
        if self.pld_tokens < 1 or self.pld_ngram < 1:
            raise ConfigError("prompt lookup needs --pld-tokens >= 1 and an n-gram size >= 1")
        if self.mode not in (None, "raw", "chat"):
            raise ConfigError(f"prompt mode must be raw or chat, got {self.mode!r}")

    @property
    def greedy(self) -> bool:
        """True when every method decodes greedily (tokens are checked against ``ar``)."""
        return self.temperature < GREEDY_BELOW

    def specs(self) -> list[MethodSpec]:
        """The rows to measure: ``ar`` first, then the other methods in ``METHODS`` order."""
        out = [MethodSpec("ar", "ar")]
        for m in METHODS[1:]:
            if m not in self.methods:
                continue
            if m == "dflash" and (self.block_sizes or self.tree_budgets or self.lookups):
                blocks: tuple[int | None, ...] = tuple(dict.fromkeys(self.block_sizes)) or (None,)
                trees = tuple(dict.fromkeys(self.tree_budgets)) or (self.tree_budget,)
                looks = tuple(dict.fromkeys(self.lookups)) or (self.lookup,)
                for b in blocks:
                    for t in trees:
                        for n in looks:
                            name = "dflash" + (f"-b{b}" if b else "")
                            if self.tree_budgets:
                                name += "-chain" if t == 0 else ("-tree-auto" if t is None else f"-tree{t}")
                            if self.lookups:
                                name += "-lookup-auto" if n is None else f"-lookup{n}"
                            out.append(MethodSpec(name, "dflash", b, t, n))
            elif m == "dflash":
                out.append(MethodSpec(m, m, None, self.tree_budget, self.lookup))
            else:
                out.append(MethodSpec(m, m))
        return out


@dataclass(frozen=True)
class MethodSpec:
    """One row of the bench: a method, and for DFlash a block size (None: the drafter's own), a
    tree budget (0: chain, None: the runtime's choice) and a context-lookup length (0: off, None:
    the default)."""

    name: str
    method: str
    block_size: int | None = None
    tree_budget: int | None = None
    lookup: int | None = None


@dataclass(frozen=True)
class Divergence:
    """Where a greedy method first produced a different token from ``ar``.

    Attributes:
        prompt_index: index of the prompt in the set.
        prompt_id: its id.
        position: index of the first differing generated token.
        expected: ``ar``'s token id there (None: ``ar`` had already stopped).
        got: the method's token id there (None: the method had stopped).
        expected_text, got_text: those tokens decoded on their own.
    """

    prompt_index: int
    prompt_id: str
    position: int
    expected: int | None
    got: int | None
    expected_text: str = ""
    got_text: str = ""


@dataclass(frozen=True)
class MethodResult:
    """Everything measured for one method over the prompt set.

    Attributes:
        name: row name (``ar``, ``hf``, ``pld``, ``assisted``, ``dflash`` or ``dflash-bN``).
        method: the method.
        draft: what proposes the drafts (drafter or assistant name, "prompt n-grams"; None).
        block_size: DFlash block size used (None for the others).
        verify_lengths: DFlash verify length the runtime used, per prompt.
        tree_budgets: DFlash tree budget the runtime used, per prompt (0: chain).
        lookups: DFlash context-lookup length, per prompt (0: off).
        runs: per-prompt measurements, in prompt order.
        tok_s_median, tok_s_mean, tok_s_stdev, tok_s_min, tok_s_max: tokens per second over prompts.
        ttft_median: median time to first token (s).
        tpot_median: median time per output token after the first (s).
        speedup: median over prompts of tok/s divided by ``ar``'s tok/s on the same prompt.
        tau: tokens committed per target verify step (DFlash); tokens per ``generate`` step
            (pld, assisted); 1.0 for plain decoding.
        acceptance_rate: accepted / drafted (None when the method does not tell).
        per_position_acceptance: for draft slot k, the share of steps verifying it in which drafts
            1..k were all accepted (DFlash).
        acceptance_histogram: entry i counts steps that accepted exactly i drafts (DFlash).
        peak_memory: largest peak over the runs (bytes; None when unknown).
        agreement: prompts whose tokens equal ``ar``'s (None when not checked: sampling).
        first_divergence: the first prompt and token where they differ.
    """

    name: str
    method: str
    draft: str | None
    block_size: int | None
    verify_lengths: tuple[int, ...]
    runs: tuple[PromptRun, ...]
    tok_s_median: float
    tok_s_mean: float
    tok_s_stdev: float
    tok_s_min: float
    tok_s_max: float
    ttft_median: float
    tpot_median: float | None
    speedup: float | None
    tau: float | None
    acceptance_rate: float | None
    per_position_acceptance: tuple[float, ...]
    acceptance_histogram: tuple[int, ...]
    peak_memory: int | None
    agreement: int | None
    first_divergence: Divergence | None
    tree_budgets: tuple[int, ...] = ()
    lookups: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        """Display name, e.g. ``dflash b8 (verify 3)``, ``dflash b8 tree16`` or ``dflash b8 tree8 lookup16``."""
        if self.method != "dflash":
            return self.name
        text = f"dflash b{self.block_size}" if self.block_size else "dflash"
        tb = sorted(set(self.tree_budgets))
        if tb and tb[-1] > 0:
            text += f" tree{tb[0]}" if len(tb) == 1 else f" tree{tb[0]}-{tb[-1]}"
            lk = sorted(set(self.lookups))
            if lk and lk[-1] > 0:
                text += f" lookup{lk[0]}" if len(lk) == 1 else f" lookup{lk[0]}-{lk[-1]}"
            return text
        vl = sorted(set(self.verify_lengths))
        if vl:
            text += f" (verify {vl[0]})" if len(vl) == 1 else f" (verify {vl[0]}-{vl[-1]})"
        return text

    def to_json(self, prompt_ids: Sequence[str] = (), with_tokens: bool = False) -> dict[str, Any]:
        """Plain-JSON form (per-prompt runs included; token ids only with ``with_tokens``)."""
        runs = []
        for i, r in enumerate(self.runs):
            d: dict[str, Any] = {
                "prompt": prompt_ids[i] if i < len(prompt_ids) else i,
                "new_tokens": r.new_tokens,
                "seconds": r.seconds,
                "tokens_per_second": r.tokens_per_second,
                "ttft_seconds": r.ttft_seconds,
                "tpot_seconds": r.tpot_seconds,
                "steps": r.steps,
                "drafted": r.drafted,
                "accepted": r.accepted,
                "verify_length": r.verify_length,
                "tree_budget": r.tree_budget,
                "lookup": r.lookup,
                "copied": r.copied,
                "peak_memory_bytes": r.peak_memory,
            }
            if with_tokens:  # null: the server streamed text without token ids
                d["tokens"] = list(r.tokens) if r.generated is None else None
            runs.append(d)
        return {
            "name": self.name,
            "label": self.label,
            "method": self.method,
            "draft": self.draft,
            "block_size": self.block_size,
            "verify_lengths": list(self.verify_lengths),
            "tree_budgets": list(self.tree_budgets),
            "tokens_per_second": {
                "median": self.tok_s_median,
                "mean": self.tok_s_mean,
                "stdev": self.tok_s_stdev,
                "min": self.tok_s_min,
                "max": self.tok_s_max,
            },
            "ttft_seconds": self.ttft_median,
            "tpot_seconds": self.tpot_median,
            "speedup": self.speedup,
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance": list(self.per_position_acceptance),
            "acceptance_histogram": list(self.acceptance_histogram),
            "peak_memory_bytes": self.peak_memory,
            "agreement": None
            if self.agreement is None
            else {
                "prompts": len(self.runs),
                "identical": self.agreement,
                "first_divergence": asdict(self.first_divergence) if self.first_divergence else None,
            },
            "runs": runs,
        }


@dataclass(frozen=True)
class BenchResult:
    """One bench run.

    Attributes:
        config: what was asked.
        dataset: name, kind, source, licence and count of the prompts.
        prompt_ids: ids of the prompts, in order.
        prompt_tokens: their lengths in tokens.
        environment: device, dtype, versions, CPU/GPU name, model ids and revisions.
        methods: one result per row, ``ar`` first.
        warnings: pitfalls found, with fixes.
        created: UTC timestamp (ISO 8601).
    """

    config: BenchConfig
    dataset: dict[str, Any]
    prompt_ids: tuple[str, ...]
    prompt_tokens: tuple[int, ...]
    environment: dict[str, Any]
    methods: tuple[MethodResult, ...]
    warnings: tuple[BenchWarning, ...] = ()
    created: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))

    def method(self, name: str) -> MethodResult:
        """The row called ``name``."""
        for m in self.methods:
            if m.name == name:
                return m
        raise KeyError(name)

    def to_json(self, run_id: int | None = None, with_tokens: bool = False) -> dict[str, Any]:
        """The JSON document of ``dflash bench --format json`` (schema ``dflash.bench/1``)."""
        cfg = asdict(self.config)
        cfg["methods"] = list(self.config.methods)
        cfg["block_sizes"] = list(self.config.block_sizes)
        cfg["tree_budgets"] = list(self.config.tree_budgets)
        cfg["lookups"] = list(self.config.lookups)
        return {
            "schema": SCHEMA,
            "run_id": run_id,
            "created": self.created,
            "environment": self.environment,
            "config": cfg,
            "dataset": {**self.dataset, "prompt_ids": list(self.prompt_ids), "prompt_tokens": list(self.prompt_tokens)},
            "methods": [m.to_json(self.prompt_ids, with_tokens) for m in self.methods],
            "warnings": [asdict(w) for w in self.warnings],
        }


# -- prompts ---------------------------------------------------------------------------------
def encode_prompt(pipe: Pipeline, prompt: Prompt, mode: PromptMode | None = None, thinking: bool = False) -> list[int]:
    """Token ids of a bench prompt.

    Chat prompts go through the target's chat template (thinking mode as asked), or are used as
    raw text when the target has none; raw prompts are tokenised as they are.

    Raises:
        InputError: empty prompt, or a target without a tokenizer.
    """
    tok = pipe.tokenizer
    if tok is None:
        raise InputError("this target has no tokenizer, so it cannot run text prompt sets; use a target with one")
    use = mode or prompt.mode
    if use == "auto":
        use = "chat" if pipe.is_chat_model else "raw"
    if use == "chat" and pipe.is_chat_model:
        messages = list(prompt.messages) if prompt.messages else [{"role": "user", "content": prompt.text}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
        return list(tok.encode(text, add_special_tokens=False))
    if not prompt.text.strip():
        raise InputError(f"prompt {prompt.id} is empty")
    return list(tok.encode(prompt.text, add_special_tokens=True))


def template_has_thinking(pipe: Pipeline) -> bool:
    """True when the target's chat template has a thinking switch (``enable_thinking``)."""
    tmpl = getattr(pipe.tokenizer, "chat_template", None) if pipe.tokenizer is not None else None
    return isinstance(tmpl, str) and "enable_thinking" in tmpl


# -- summaries -------------------------------------------------------------------------------
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


# -- the run ---------------------------------------------------------------------------------
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


def run_bench(
    pipe: Pipeline,
    prompts: PromptSet,
    config: BenchConfig,
    assistant: Assistant | None = None,
    progress: Progress | None = None,
    quantize: str | None = None,
) -> BenchResult:
    """Run every method on every prompt and summarise.

    Args:
        pipe: the loaded pipeline (target, drafter, tokenizer).
        prompts: the prompt set (already limited).
        config: what to measure.
        assistant: the draft model for ``assisted`` (required when that method is asked for).
        progress: called as ``progress(done, total, what)`` after each run, warm-up included.
        quantize: the quantization the target was loaded with (for records and warnings).

    Returns:
        The ``BenchResult``.

    Raises:
        ConfigError: ``dflash`` without a drafter, ``assisted`` without an assistant.
        InputError: an empty prompt, or a prompt that does not fit the target's context.
    """
    specs = config.specs()
    if any(s.method == "dflash" for s in specs) and pipe.drafter is None:
        raise ConfigError(
            f"no drafter is loaded for {pipe.pair.target_name}, so dflash cannot run; "
            "name one with --drafter, or leave dflash out of --methods"
        )
    if any(s.method == "assisted" for s in specs) and assistant is None:
        raise ConfigError("the assisted method needs a draft model: pass --assistant ID|DIR")
    if not prompts.prompts:
        raise InputError(f"prompt set {prompts.name} is empty")

    encoded = [encode_prompt(pipe, p, config.mode, config.thinking) for p in prompts.prompts]
    limit = pipe.target.max_positions
    for p, ids in zip(prompts.prompts, encoded, strict=True):
        if not ids:
            raise InputError(f"prompt {p.id} encodes to no tokens")
        if limit is not None and len(ids) + config.max_new_tokens > limit:
            raise InputError(
                f"prompt {p.id} has {len(ids)} tokens; with --max-tokens {config.max_new_tokens} it exceeds the "
                f"target's context of {limit} tokens; use fewer --max-tokens or other prompts"
            )
    params = SamplingParams(
        temperature=config.temperature,
        seed=config.seed,
        max_new_tokens=config.max_new_tokens,
        ignore_eos=not config.stop_at_eos,
    )
    mem = PeakMemory(pipe.device)

    def measure(spec: MethodSpec, ids: Sequence[int], p: SamplingParams) -> PromptRun:
        if spec.method in ("ar", "dflash"):
            opts = (
                DecodeOptions(decoder="ar", cache_prompt=False)  # every run reads its prompt: comparable TTFT
                if spec.method == "ar"
                else DecodeOptions(
                    cache_prompt=False,
                    block_size=spec.block_size,
                    verify_length=config.verify_length,
                    tree_budget=spec.tree_budget,
                    lookup=spec.lookup,
                    confidence_cut=config.confidence_cut,
                )
            )
            return run_decoder(pipe, opts, ids, p, mem)
        return run_generate(
            pipe,
            spec.method,
            ids,
            p,
            mem,
            pld_tokens=config.pld_tokens,
            pld_ngram=config.pld_ngram,
            assistant=assistant,
        )

    # 1-2. Warm-up, then every prompt with every method.
    runs = timed_protocol(specs, encoded, [p.id for p in prompts.prompts], config, params, measure, progress)

    # 3. Summaries, agreement with ar, pitfalls.
    prompt_ids = [p.id for p in prompts.prompts]
    base = runs["ar"]

    def decode_one(t: int) -> str:
        return str(pipe.tokenizer.decode([t])) if pipe.tokenizer is not None else str(t)

    drafts = {
        "ar": None,
        "hf": None,
        "pld": "prompt n-grams",
        "assisted": assistant.name if assistant else None,
        "dflash": pipe.pair.drafter_name,
    }
    results = [
        summarise(
            s,
            runs[s.name],
            None if s.name == "ar" else base,
            drafts[s.method],
            config.greedy,
            prompt_ids,
            decode_one,
            (s.block_size or pipe.block_size) if s.method == "dflash" else None,
        )
        for s in specs
    ]
    raw = pipe.drafter.config.raw if pipe.drafter is not None else {}
    target_quant = getattr(pipe.target.config, "quantization_config", None)
    quant_name = quantize or (
        str(target_quant.get("quant_method", "quantized")) if isinstance(target_quant, dict) else None
    )
    if quant_name is None and target_quant is not None:
        quant_name = str(getattr(target_quant, "quant_method", "quantized"))
    info = drafter_training(raw)
    warnings = find_pitfalls(
        results,
        drafter_name=pipe.pair.drafter_name,
        thinking=config.thinking and template_has_thinking(pipe),
        drafter_thinking=bool(info.get("thinking", False)),
        quantized=quant_name,
        drafter_dtype_name=drafter_dtype(raw),
        longest_context=max(len(ids) for ids in encoded) + config.max_new_tokens,
        drafter_train_length=drafter_training_length(raw),
    )
    return BenchResult(
        config=config,
        dataset=prompts.describe(),
        prompt_ids=tuple(prompt_ids),
        prompt_tokens=tuple(len(ids) for ids in encoded),
        environment=environment(pipe, assistant, quant_name),
        methods=tuple(results),
        warnings=tuple(warnings),
    )
