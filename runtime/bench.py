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
timed with the device synchronised around the clock (``runtime.bench_methods``). Greedy methods
must reproduce ``ar``'s tokens; the first divergence is reported when they do not (in bf16 a
batched verify and a one-token forward may break near-ties differently; DFLASH.md).

Results are frozen dataclasses (``BenchResult``); the CLI renders them and stores them
(``runtime.bench_store``). Nothing here prints.
"""

from __future__ import annotations

import platform
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .bench_methods import PeakMemory, PromptRun, run_decoder, run_generate
from .config import DecodeOptions, SamplingParams
from .datasets import Prompt, PromptMode, PromptSet
from .errors import ConfigError, IncompatibleDraftError, InputError

METHODS = ("ar", "hf", "pld", "assisted", "dflash")
SCHEMA = "dflash.bench/1"
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class BenchConfig:
    """What to measure.

    Attributes:
        methods: methods to run (``ar`` is always added: it is the baseline).
        block_sizes: DFlash block sizes to sweep (empty: the runtime's own choice of block and
            verify length, as ``dflash run`` uses).
        verify_length: drafts verified per DFlash step (None: the runtime's choice).
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
        return self.temperature == 0.0

    def specs(self) -> list[MethodSpec]:
        """The rows to measure: ``ar`` first, then the other methods in ``METHODS`` order."""
        out = [MethodSpec("ar", "ar")]
        for m in METHODS[1:]:
            if m not in self.methods:
                continue
            if m == "dflash" and self.block_sizes:
                out += [MethodSpec(f"dflash-b{b}", "dflash", b) for b in dict.fromkeys(self.block_sizes)]
            else:
                out.append(MethodSpec(m, m))
        return out


@dataclass(frozen=True)
class MethodSpec:
    """One row of the bench: a method, and for DFlash a block size (None: the drafter's own)."""

    name: str
    method: str
    block_size: int | None = None


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

    @property
    def label(self) -> str:
        """Display name, e.g. ``dflash b8 (verify 3)``."""
        if self.method != "dflash":
            return self.name
        text = f"dflash b{self.block_size}" if self.block_size else "dflash"
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
                "new_tokens": len(r.tokens),
                "seconds": r.seconds,
                "tokens_per_second": r.tokens_per_second,
                "ttft_seconds": r.ttft_seconds,
                "tpot_seconds": r.tpot_seconds,
                "steps": r.steps,
                "drafted": r.drafted,
                "accepted": r.accepted,
                "verify_length": r.verify_length,
                "peak_memory_bytes": r.peak_memory,
            }
            if with_tokens:
                d["tokens"] = list(r.tokens)
            runs.append(d)
        return {
            "name": self.name,
            "label": self.label,
            "method": self.method,
            "draft": self.draft,
            "block_size": self.block_size,
            "verify_lengths": list(self.verify_lengths),
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
class BenchWarning:
    """A pitfall found in a run, with its fix."""

    code: str
    message: str
    fix: str


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
def encode_prompt(pipe: Any, prompt: Prompt, mode: PromptMode | None = None, thinking: bool = False) -> list[int]:
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


def template_has_thinking(pipe: Any) -> bool:
    """True when the target's chat template has a thinking switch (``enable_thinking``)."""
    tmpl = getattr(pipe.tokenizer, "chat_template", None) if pipe.tokenizer is not None else None
    return isinstance(tmpl, str) and "enable_thinking" in tmpl


# -- the assistant model (assisted generation) ------------------------------------------------
@dataclass
class Assistant:
    """A small draft model for transformers' assisted generation.

    Attributes:
        name: what the user named.
        path: its folder.
        model: the loaded causal LM (same device and dtype as the target).
        tokenizer: its tokenizer (None when the folder has none).
        same_vocab_size: its embedding has as many rows as the target's.
    """

    name: str
    path: Path
    model: Any
    tokenizer: Any | None
    same_vocab_size: bool


def load_assistant(ref: str, pipe: Any, opts: Any) -> Assistant:
    """Resolve, check and load an assistant model for ``assisted`` runs.

    The tokenizers are compared before any weight is loaded: assisted generation as benchmarked
    here needs the target's tokenizer.

    Args:
        ref: Hub id or local folder.
        pipe: the loaded target pipeline.
        opts: ``LoadOptions`` (cache, offline, token).

    Raises:
        ModelNotFoundError, ModelLoadError: as for targets.
        IncompatibleDraftError: the assistant uses another tokenizer.
    """
    from .hub import resolve_model
    from .pipeline import load_target_model, load_tokenizer, read_target_config

    path = resolve_model(ref, "assistant", cache_dir=opts.hf_cache_dir, offline=opts.offline, token=opts.token)
    cfg = read_target_config(path)
    tok = load_tokenizer(path)
    target_name = pipe.pair.target_name
    a_vocab = int(cfg.get_text_config().vocab_size) if hasattr(cfg, "get_text_config") else int(cfg.vocab_size)
    t_vocab = pipe.target.vocab_size
    fix = (
        "assisted generation needs a draft model with the target's tokenizer (e.g. a smaller model of the same family)"
    )
    if tok is not None and pipe.tokenizer is not None:
        if tok.get_vocab() != pipe.tokenizer.get_vocab():
            raise IncompatibleDraftError(
                f"assistant {ref} uses a different tokenizer ({len(tok)} tokens) from target {target_name} "
                f"({len(pipe.tokenizer)} tokens); {fix}"
            )
    elif a_vocab != t_vocab:
        raise IncompatibleDraftError(
            f"assistant {ref} has a vocabulary of {a_vocab} tokens but target {target_name} has {t_vocab}; {fix}"
        )
    model = load_target_model(path, pipe.device, pipe.dtype)
    return Assistant(ref, path, model, tok or pipe.tokenizer, a_vocab == t_vocab)


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
    steps = sum(r.steps for r in runs)
    tau = sum(r.committed_in_steps for r in runs) / steps if steps else None
    drafted = [r.drafted for r in runs if r.drafted is not None]
    accepted = [r.accepted for r in runs if r.accepted is not None]
    rate = sum(accepted) / sum(drafted) if drafted and sum(drafted) else (0.0 if drafted else None)
    n_pos = max((len(r.position_tried) for r in runs), default=0)
    tried = [sum(r.position_tried[j] for r in runs if j < len(r.position_tried)) for j in range(n_pos)]
    ok = [sum(r.position_ok[j] for r in runs if j < len(r.position_ok)) for j in range(n_pos)]
    n_hist = max((len(r.histogram) for r in runs), default=0)
    hist = tuple(sum(r.histogram[j] for r in runs if j < len(r.histogram)) for j in range(n_hist))
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
        runs=tuple(runs),
        tok_s_median=_median(tps),
        tok_s_mean=float(statistics.fmean(tps)) if tps else 0.0,
        tok_s_stdev=float(statistics.stdev(tps)) if len(tps) > 1 else 0.0,
        tok_s_min=min(tps, default=0.0),
        tok_s_max=max(tps, default=0.0),
        ttft_median=_median([r.ttft_seconds for r in runs]),
        tpot_median=_median(tpots) if tpots else None,
        speedup=speedup,
        tau=tau,
        acceptance_rate=rate,
        per_position_acceptance=tuple(o / t if t else 0.0 for o, t in zip(ok, tried, strict=True)),
        acceptance_histogram=hist,
        peak_memory=max(peaks) if peaks else None,
        agreement=agreement,
        first_divergence=divergence,
    )


# -- pitfalls --------------------------------------------------------------------------------
def _drafter_training(raw: dict[str, Any]) -> dict[str, Any]:
    """Training metadata a drafter config may carry (``training`` or inside ``dflash_config``)."""
    info = dict(raw.get("dflash_config", {}).get("training") or {})
    info.update(raw.get("training") or {})
    return info


def drafter_training_length(raw: dict[str, Any]) -> int | None:
    """Sequence length the drafter was trained on, when its config records it.

    Looks at ``training.max_len`` (also ``max_length``/``seq_len``, at top level or inside
    ``dflash_config``); published configs do not record it (None).
    """
    info = _drafter_training(raw)
    for key in ("max_len", "max_length", "seq_len", "max_seq_len"):
        if info.get(key):
            return int(info[key])
    return None


def drafter_dtype(raw: dict[str, Any]) -> str | None:
    """Dtype of the target features the drafter was trained on (``training.dtype``, else the
    checkpoint's ``torch_dtype``/``dtype``)."""
    info = _drafter_training(raw)
    value = info.get("dtype") or raw.get("torch_dtype") or raw.get("dtype")
    return str(value) if value else None


def find_pitfalls(
    results: Sequence[MethodResult],
    *,
    drafter_name: str | None = None,
    thinking: bool = False,
    drafter_thinking: bool = False,
    quantized: str | None = None,
    drafter_dtype_name: str | None = None,
    longest_context: int = 0,
    drafter_train_length: int | None = None,
) -> list[BenchWarning]:
    """The known ways a bench result misleads, each with its fix.

    Args:
        results: the rows (``ar`` included).
        drafter_name: the DFlash drafter (None: no DFlash row).
        thinking: the chat template's thinking mode was on.
        drafter_thinking: the drafter was trained on thinking-mode answers.
        quantized: the target's quantization scheme (None: not quantized).
        drafter_dtype_name: dtype of the features the drafter was trained on.
        longest_context: the longest prompt + new tokens of the run.
        drafter_train_length: the drafter's training sequence length (None: unknown).
    """
    out: list[BenchWarning] = []
    fixes = {
        "dflash-b": (
            "a long verify block costs more than it saves at this acceptance: leave --block-size out so the runtime "
            "picks the verify length for the device, or sweep smaller blocks (--block-size 2,3,4)"
        ),
        "dflash": (
            "the drafter's acceptance is too low to pay for drafting on this device: train it longer (`dflash train`), "
            "or decode plainly here (dflash run --decoder ar)"
        ),
        "pld": "prompt lookup only pays when the answer repeats the prompt (edits, refactors); for new code use dflash",
        "assisted": "the assistant is too slow or too often wrong for this target: pick a smaller assistant or dflash",
    }
    for m in results:
        key = "dflash-b" if m.name.startswith("dflash-b") else m.method
        if key in fixes and m.speedup is not None and m.speedup < 1.0:
            tau = f", tau {m.tau:.2f}" if m.tau is not None else ""
            out.append(
                BenchWarning(
                    "slower-than-ar",
                    f"{m.label} is slower than plain decoding ({m.speedup:.2f}x{tau})",
                    fixes[key],
                )
            )
    has_dflash = drafter_name is not None and any(m.method == "dflash" for m in results)
    if has_dflash and thinking and not drafter_thinking:
        out.append(
            BenchWarning(
                "thinking-mode",
                f"thinking mode is on but drafter {drafter_name} was trained on answers without thinking, "
                "so acceptance drops on the reasoning text",
                "drop --thinking (published DFlash results are with thinking off) or use a drafter trained with it",
            )
        )
    if has_dflash and quantized:
        dt = drafter_dtype_name or "bfloat16"
        if dt in ("bfloat16", "float16", "float32"):
            out.append(
                BenchWarning(
                    "quantized-target",
                    f"the target is quantized ({quantized}) but drafter {drafter_name} was trained on {dt} features "
                    "of the unquantized target; its inputs shift and acceptance can drop",
                    "compare with the unquantized target (run without --quantize), or fine-tune the drafter on the "
                    "quantized target with `dflash train`",
                )
            )
    if has_dflash and drafter_train_length and longest_context > drafter_train_length:
        out.append(
            BenchWarning(
                "context-beyond-training",
                f"prompts run to {longest_context} tokens, beyond the {drafter_train_length} tokens drafter "
                f"{drafter_name} was trained on; acceptance falls off past that",
                "use shorter prompts or fewer --max-tokens, or a drafter trained on longer sequences",
            )
        )
    return out


# -- environment -----------------------------------------------------------------------------
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_revision(path: Path | None) -> str | None:
    """Revision of a model folder: the Hub commit of a cache snapshot, or the embedded GGUF's sha256."""
    if path is None:
        return None
    parts = Path(path).parts
    if "snapshots" in parts and parts.index("snapshots") + 1 < len(parts):
        return parts[parts.index("snapshots") + 1]
    marker = Path(path) / "dflash-embedded.json"
    if marker.exists():
        import json

        try:
            return "gguf-sha256:" + str(json.loads(marker.read_text()).get("gguf_sha256"))
        except (OSError, ValueError):
            return None
    return None


def environment(pipe: Any, assistant: Assistant | None = None, quantize: str | None = None) -> dict[str, Any]:
    """Device, dtype, library versions, CPU/GPU name, models with their revisions."""
    import torch
    import transformers

    from .device import device_description, dtype_name

    try:
        from importlib.metadata import version

        dflash_version = version("dflash")
    except Exception:
        dflash_version = None
    gpu = torch.cuda.get_device_name(pipe.device) if pipe.device.type == "cuda" else None
    pair = pipe.pair
    return {
        "device": str(pipe.device),
        "device_name": device_description(pipe.device),
        "cpu": _cpu_name(),
        "gpu": gpu,
        "dtype": dtype_name(pipe.dtype),
        "threads": torch.get_num_threads(),
        "quantize": quantize,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "dflash": dflash_version,
        "target": {"id": pair.target_name, "path": str(pair.target_dir), "revision": model_revision(pair.target_dir)},
        "drafter": None
        if pair.drafter_dir is None
        else {"id": pair.drafter_name, "path": str(pair.drafter_dir), "revision": model_revision(pair.drafter_dir)},
        "assistant": None
        if assistant is None
        else {"id": assistant.name, "path": str(assistant.path), "revision": model_revision(assistant.path)},
    }


# -- the run ---------------------------------------------------------------------------------
def run_bench(
    pipe: Any,
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
                DecodeOptions(decoder="ar")
                if spec.method == "ar"
                else DecodeOptions(block_size=spec.block_size, verify_length=config.verify_length)
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

    total = len(specs) * (config.warmup + len(encoded))
    done = 0
    # 1. Warm-up, untimed: every method once (or --warmup times) on the first prompt, short.
    warm = SamplingParams(
        temperature=config.temperature,
        seed=config.seed,
        max_new_tokens=min(config.max_new_tokens, 16),
        ignore_eos=True,
    )
    for _ in range(config.warmup):
        for spec in specs:
            measure(spec, encoded[0], warm)
            done += 1
            if progress:
                progress(done, total, f"warm-up {spec.name}")

    # 2. Timed: prompt by prompt, every method, the order rotating by one each prompt.
    runs: dict[str, list[PromptRun]] = {s.name: [] for s in specs}
    for i, ids in enumerate(encoded):
        shift = i % len(specs)
        for spec in specs[shift:] + specs[:shift]:
            runs[spec.name].append(measure(spec, ids, params))
            done += 1
            if progress:
                progress(done, total, f"{prompts.prompts[i].id} {spec.name}")

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
    info = _drafter_training(raw)
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
