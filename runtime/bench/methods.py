"""Timed runs of one prompt with one decoding method, for ``runtime.bench.runner``.

Two kinds of method:

- our decoders (``ar`` and ``dflash``), through ``Pipeline.make_decoder`` and the event stream;
- transformers' ``generate`` (``hf``, ``pld``: prompt lookup, ``assisted``: a draft model),
  run with a neutral generation config so that only the method differs (no repetition penalty or
  other processors from the model's ``generation_config``).

Every run is timed the same way: the device is synchronised, the clock starts, the method runs,
the device is synchronised again and the clock stops. Consumer work (counting acceptance) happens
after the clock stops; events are only appended to a list while timing.
"""

from __future__ import annotations

import contextlib
import re
import resource
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from runtime.config import DecodeOptions, SamplingParams
from runtime.engine.acceptance import AcceptanceCounter, AcceptanceCounts
from runtime.engine.events import BlockVerified, Finished, PrefillDone
from runtime.errors import IncompatibleDraftError

if TYPE_CHECKING:
    from runtime.pipeline import LoadOptions, Pipeline


def sync(device: torch.device) -> None:
    """Wait for queued device work so that host timers measure it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class PeakMemory:
    """Peak memory of one run: CUDA allocator peak on GPUs, peak RSS of the process on CPUs.

    On Linux the RSS high-water mark is reset before each run (``/proc/self/clear_refs``), so the
    peak belongs to that run; elsewhere it is the process's lifetime peak (``kind`` says which).
    """

    _CLEAR = Path("/proc/self/clear_refs")
    _STATUS = Path("/proc/self/status")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            self.kind = "cuda-allocated"
        elif device.type == "mps":
            self.kind = "mps-allocated"
        else:
            self.kind = "rss" if self._can_reset() else "rss-lifetime"

    def _can_reset(self) -> bool:
        try:
            self._CLEAR.write_text("5")
            return self._hwm() is not None
        except OSError:
            return False

    def _hwm(self) -> int | None:
        try:
            m = re.search(r"VmHWM:\s+(\d+)\s*kB", self._STATUS.read_text())
        except OSError:
            return None
        return int(m.group(1)) * 1024 if m else None

    def reset(self) -> None:
        """Start a new measurement."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.kind == "rss":
            with contextlib.suppress(OSError):
                self._CLEAR.write_text("5")

    def peak(self) -> int | None:
        """Bytes at the peak since ``reset`` (None when unknown)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.device.type == "mps":
            return int(torch.mps.driver_allocated_memory())
        if self.kind == "rss":
            return self._hwm()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)


@dataclass(frozen=True)
class PromptRun:
    """One method on one prompt.

    Attributes:
        tokens: generated ids (the stop token included when one ended the run).
        seconds: wall time from start to the last token, device-synchronised.
        ttft_seconds: time to the first generated token.
        acceptance: raw counts of the steps: target verify forwards after the first token (our
            decoders), or decoding steps of ``generate`` (one per streamer update) with the tokens
            they committed; drafts, per-slot counts and the histogram for DFlash.
        drafts_known: the method reports its drafts (DFlash); else ``drafted``/``accepted`` are None.
        verify_length: drafts verified per step, as the runtime chose it (DFlash only).
        tree_budget: drafted nodes per tree verify, as the runtime last chose it (0: chain; DFlash only).
        lookup: context tokens copied per step at most (0: off; DFlash only).
        copied: accepted tokens that only the context lookup proposed (DFlash).
        peak_memory: bytes (see ``PeakMemory``).
        generated: tokens generated when their ids are unknown (a server that streams text
            only; ``tokens`` is then empty). None: ``len(tokens)``.
    """

    tokens: tuple[int, ...]
    seconds: float
    ttft_seconds: float
    acceptance: AcceptanceCounts = AcceptanceCounts()
    drafts_known: bool = False
    verify_length: int | None = None
    peak_memory: int | None = None
    generated: int | None = None
    tree_budget: int | None = None
    lookup: int | None = None
    copied: int = 0

    @property
    def steps(self) -> int:
        """Verify (or ``generate``) steps after the first token."""
        return self.acceptance.steps

    @property
    def drafted(self) -> int | None:
        """Drafts proposed to the target (None when the method does not tell)."""
        return self.acceptance.drafted if self.drafts_known else None

    @property
    def accepted(self) -> int | None:
        """Drafts the target accepted (None when unknown)."""
        return self.acceptance.accepted if self.drafts_known else None

    @property
    def new_tokens(self) -> int:
        """Tokens generated."""
        return len(self.tokens) if self.generated is None else self.generated

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens / total time (end to end, prefill included)."""
        return self.new_tokens / max(self.seconds, 1e-9)

    @property
    def tpot_seconds(self) -> float | None:
        """Time per output token after the first (None with fewer than two tokens)."""
        n = self.new_tokens
        return (self.seconds - self.ttft_seconds) / (n - 1) if n > 1 else None


def run_decoder(
    pipe: Pipeline, opts: DecodeOptions, prompt: Sequence[int], params: SamplingParams, mem: PeakMemory
) -> PromptRun:
    """Time our own decoder (``ar`` or ``dflash``) on one prompt."""
    if opts.decoder == "ar":
        pipe.target.set_taps(())  # no feature hooks on the target during plain decoding
    decoder = pipe.make_decoder(opts)
    events: list[Any] = []
    ttft = 0.0
    mem.reset()
    sync(pipe.device)
    t0 = time.perf_counter()
    for ev in decoder.stream(prompt, params):
        if isinstance(ev, PrefillDone):
            ttft = time.perf_counter() - t0
        events.append(ev)
    sync(pipe.device)
    seconds = time.perf_counter() - t0
    return count_events(events, seconds, ttft, decoder.block_size, mem.peak())


def count_events(events: Sequence[Any], seconds: float, ttft: float, block: int, peak: int | None) -> PromptRun:
    """A ``PromptRun`` from the events of one of our decoders (local, or ``dflash serve``'s).

    Args:
        events: the run's events, ``Finished`` included.
        seconds, ttft: the run's timing.
        block: the decoder's block size (1: plain decoding).
        peak: peak memory in bytes (None: unknown).
    """
    tokens: list[int] = []
    counter = AcceptanceCounter(slots=max(block - 1, 0))
    verify_length = tree_budget = lookup = None
    copied = 0
    for ev in events:
        if isinstance(ev, Finished):
            verify_length = ev.stats.verify_length
            tree_budget = getattr(ev.stats, "tree_budget", 0)
            lookup = getattr(ev.stats, "lookup", 0)
            copied = getattr(ev.stats, "copied_tokens", 0)
            continue
        tokens.extend(t.token_id for t in ev.tokens)
        if isinstance(ev, BlockVerified):
            counter.record(len(ev.draft), ev.accepted, depth=ev.depth)  # a tree tests its depth, not its nodes
    is_dflash = block > 1
    counts = counter.counts()
    return PromptRun(
        tokens=tuple(tokens),
        seconds=seconds,
        ttft_seconds=ttft,
        acceptance=counts if is_dflash else AcceptanceCounts(steps=counts.steps, committed=counts.committed),
        drafts_known=is_dflash,
        verify_length=verify_length if is_dflash else None,
        peak_memory=peak,
        tree_budget=tree_budget if is_dflash else None,
        lookup=lookup if is_dflash else None,
        copied=copied if is_dflash else 0,
    )


class _Clock:
    """A ``generate`` streamer that only notes when tokens arrive (the first call is the prompt)."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.first: float | None = None
        self.calls = -1
        self.tokens = 0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 0:
            return
        if self.first is None:
            self.first = time.perf_counter() - self.t0
        self.tokens += int(value.numel())

    def end(self) -> None:
        pass


@contextlib.contextmanager
def neutral_generation_config(models: Sequence[Any], eos: Sequence[int] | None) -> Iterator[None]:
    """Swap each model's ``generation_config`` for transformers' defaults while benchmarking.

    ``generate`` fills unset values from ``model.generation_config`` (repetition penalty, top-k,
    EOS...). A fresh default config keeps the comparison with our greedy loop exact; ``eos``
    None means fixed-length runs.
    """
    from transformers import GenerationConfig

    saved = [m.generation_config for m in models]
    try:
        for m in models:
            cfg = GenerationConfig()
            if eos:
                cfg.eos_token_id = list(eos)
                cfg.pad_token_id = int(eos[0])
            m.generation_config = cfg
        yield
    finally:
        for m, cfg in zip(models, saved, strict=True):
            m.generation_config = cfg


def run_generate(
    pipe: Pipeline,
    method: str,
    prompt: Sequence[int],
    params: SamplingParams,
    mem: PeakMemory,
    *,
    pld_tokens: int = 10,
    pld_ngram: int = 2,
    assistant: Any | None = None,
) -> PromptRun:
    """Time transformers' ``generate`` on one prompt: plain (``hf``), prompt lookup (``pld``)
    or assisted generation with a draft model (``assisted``)."""
    pipe.target.set_taps(())  # DFlash feature hooks stay off the target for transformers' loops
    model: Any = pipe.target.model  # a transformers model: generate()
    kw: dict[str, Any] = {"max_new_tokens": params.max_new_tokens, "num_beams": 1}
    if params.greedy:
        kw["do_sample"] = False
    else:
        kw.update(do_sample=True, temperature=params.temperature, top_k=params.top_k or 0, top_p=params.top_p or 1.0)
        torch.manual_seed(params.seed)
    models = [model]
    if method == "pld":
        kw.update(prompt_lookup_num_tokens=pld_tokens, max_matching_ngram_size=pld_ngram)
    elif method == "assisted":
        assert assistant is not None, "assisted generation needs an assistant model"
        kw["assistant_model"] = assistant.model
        models.append(assistant.model)
        if not assistant.same_vocab_size:  # same tokenizer, different embedding rows: transformers wants both
            kw.update(tokenizer=pipe.tokenizer, assistant_tokenizer=assistant.tokenizer)
    elif method != "hf":
        raise ValueError(f"unknown generate method {method!r}")
    eos = None if params.ignore_eos else list(pipe.stop_token_ids)
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=pipe.device)
    clock = _Clock()
    with neutral_generation_config(models, eos), torch.inference_mode():
        mem.reset()
        sync(pipe.device)
        clock.t0 = t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), streamer=clock, **kw)
        sync(pipe.device)
        seconds = time.perf_counter() - t0
    peak = mem.peak()
    tokens = tuple(int(t) for t in out[0, ids.shape[1] :].tolist())
    steps = max(clock.calls, 0)
    return PromptRun(
        tokens=tokens,
        seconds=seconds,
        ttft_seconds=clock.first if clock.first is not None else seconds,
        acceptance=AcceptanceCounts(steps=steps, committed=len(tokens)),
        peak_memory=peak,
    )


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


def load_assistant(ref: str, pipe: Pipeline, opts: LoadOptions) -> Assistant:
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
    from runtime.models.hub import resolve_model
    from runtime.pipeline import load_target_model, load_tokenizer, read_target_config

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
