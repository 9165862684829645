"""``dflash bench --server``: the bench protocol through a remote backend (an OpenAI-compatible server).

``dflash serve`` takes the decoder per request, so ``ar`` and ``dflash`` (and a block-size sweep)
run on one server as they do locally; its chunks carry token ids, so greedy runs are checked
against ``ar`` token for token. vLLM and SGLang fix speculative decoding when they start: one
row, named after the engine, measures what the server does, with the statistics it exposes
(``runtime.client.remote``); a second server started without speculative decoding and
``dflash bench compare`` give the speedup.

Timing is the client's clock: from the request to the last chunk (network and queue included),
TTFT at the first text. The methods that run transformers' ``generate`` (hf, pld, assisted) need
local weights and are not available here. Nothing here prints.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.bench.config import BenchConfig, MethodSpec
from runtime.bench.datasets import Prompt, PromptMode, PromptSet
from runtime.bench.methods import PromptRun, count_events
from runtime.bench.pitfalls import find_pitfalls
from runtime.bench.protocol import Progress, timed_protocol
from runtime.bench.results import BenchResult
from runtime.bench.summary import summarise
from runtime.config import DecodeOptions, SamplingParams
from runtime.engine.events import Finished, PrefillDone
from runtime.errors import ConfigError, InputError

if TYPE_CHECKING:
    from runtime.client.remote import RemoteBackend

LOCAL_ONLY = ("hf", "pld", "assisted")  # transformers' generate on local weights


@dataclass(frozen=True)
class RemoteRun:
    """One prompt through the server: the measurements, the prompt's length and the token texts seen."""

    run: PromptRun
    prompt_tokens: int
    texts: dict[int, str]


def refuse_local_methods(config: BenchConfig) -> None:
    """Raise ConfigError when ``config`` asks for hf, pld or assisted (they need local weights)."""
    local = [m for m in config.methods if m in LOCAL_ONLY]
    if local:
        raise ConfigError(
            f"--methods {','.join(local)} run transformers' generate on local weights, not on a server; "
            "use ar,dflash with --server (or drop --server)"
        )


def remote_specs(config: BenchConfig, flavour: str) -> list[MethodSpec]:
    """The rows a server can run.

    Raises:
        ConfigError: a method that needs local weights; for vLLM/SGLang, anything set per request
            (ar, block sizes, verify length), which those engines fix when they start.
    """
    refuse_local_methods(config)
    if flavour == "dflash":
        return config.specs()
    per_request = config.block_sizes or config.verify_length is not None or config.tree_budgets or config.lookups
    if (
        per_request
        or config.tree_budget is not None
        or config.lookup is not None
        or set(config.methods) - {"ar", "dflash"}
    ):
        raise ConfigError(
            f"a {flavour} server fixes its decoding when it starts, so --block-size/--verify-length/--methods "
            "cannot be chosen per request; bench it as it runs (and bench a server started without speculative "
            "decoding, then `dflash bench compare`)"
        )
    return [MethodSpec(flavour, "server")]


def run_remote(
    backend: RemoteBackend, prompt: Prompt, mode: PromptMode | None, params: SamplingParams, opts: DecodeOptions | None
) -> RemoteRun:
    """Time one prompt through the server.

    Chat prompts go to the chat endpoint (the server applies its template), raw prompts to the
    completion endpoint; ``mode`` overrides the prompt's own.
    """
    use = mode or prompt.mode
    if use == "auto":
        use = "chat" if backend.info().details.get("chat_template", True) else "raw"
    t0 = time.perf_counter()
    if use == "chat":
        messages = list(prompt.messages) if prompt.messages else [{"role": "user", "content": prompt.text}]
        stream = backend.stream_messages(messages, params, opts)
    else:
        if not prompt.text.strip():
            raise InputError(f"prompt {prompt.id} is empty")
        stream = backend.stream(prompt.text, params, opts, chat=False)
    events: list[Any] = []
    ttft = 0.0
    for ev in stream:
        if isinstance(ev, PrefillDone):
            ttft = time.perf_counter() - t0
        events.append(ev)
    seconds = time.perf_counter() - t0
    done = events[-1]
    assert isinstance(done, Finished)
    stats = done.stats
    texts = {t.token_id: t.text for ev in events[:-1] for t in ev.tokens if t.token_id >= 0}
    if backend.capabilities.per_token_origin:  # dflash serve: the runtime's own events, token ids and drafts
        block = stats.block_size if stats.decoder == "dflash" else 1
        return RemoteRun(count_events(events, seconds, ttft, block, None), stats.prompt_tokens, texts)
    # Text chunks only: counts from the server's final statistics (none when it exposes none).
    spec = stats.verify_steps > 0
    if stats.decoder == "llama.cpp":  # llama-server measures its own prompt and decode times: use them
        seconds, ttft = stats.total_seconds, stats.ttft_seconds
    run = PromptRun(
        tokens=(),
        seconds=seconds,
        ttft_seconds=ttft,
        acceptance=stats.acceptance,
        drafts_known=spec,
        verify_length=stats.verify_length if spec else None,
        generated=stats.generated_tokens,
    )
    return RemoteRun(run, stats.prompt_tokens, texts)


def remote_environment(backend: RemoteBackend) -> dict[str, Any]:
    """What a remote run records: the server (URL, engine, served model) and what it says about its models.

    The keys of a local run's environment are kept (``runtime.bench.env``); what only the server
    knows (its torch, CPU, GPU) is None.
    """
    try:
        from importlib.metadata import version

        from runtime.config import DISTRIBUTION

        dflash_version: str | None = version(DISTRIBUTION)
    except Exception:
        dflash_version = None
    info = backend.info()
    d = backend.describe()
    engine = "dflash serve" if info.flavour == "dflash" else info.flavour
    device = d.get("device")
    return {
        "device": device or "remote",
        "device_name": f"{engine} at {backend.url}" + (f" ({device})" if device else ""),
        "cpu": None,
        "gpu": None,
        "dtype": d.get("dtype") or "-",
        "threads": None,
        "quantize": d.get("quantization"),
        "torch": None,
        "transformers": None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "dflash": dflash_version,
        "server": {
            "url": backend.url,
            "engine": info.flavour,
            "model": backend.model,
            "models": list(info.models),
            "target": d.get("target"),
            "drafter": d.get("drafter"),
            "block_size": d.get("block_size"),
        },
        "target": {"id": backend.model, "path": None, "revision": None},
        "drafter": None if not d.get("drafter") else {"id": str(d["drafter"]), "path": None, "revision": None},
        "assistant": None,
    }


def run_bench_remote(
    backend: RemoteBackend, prompts: PromptSet, config: BenchConfig, progress: Progress | None = None
) -> BenchResult:
    """Run the bench protocol through a server and summarise (``runtime.bench.runner.run_bench``'s contract).

    Args:
        backend: a ``runtime.client.remote.RemoteBackend``.
        prompts: the prompt set (already limited).
        config: what to measure (``hf``/``pld``/``assisted`` are refused, see ``remote_specs``).
        progress: called as ``progress(done, total, what)`` after each run, warm-up included.

    Raises:
        ConfigError: a method or option the server cannot run; ``--thinking``.
        InputError: an empty prompt set, a prompt the server rejects, a server without a tokenizer.
        RemoteError: the server fails or cannot be reached.
    """
    info = backend.info()
    specs = remote_specs(config, info.flavour)
    if config.thinking:
        raise ConfigError("--thinking is not available with --server: the server's chat template decides")
    if not prompts.prompts:
        raise InputError(f"prompt set {prompts.name} is empty")
    if info.details.get("tokenizer") is False:
        raise InputError(
            "the served target has no tokenizer, so it cannot run text prompt sets; serve a target with one"
        )
    params = SamplingParams(
        temperature=config.temperature,
        seed=config.seed,
        max_new_tokens=config.max_new_tokens,
        ignore_eos=not config.stop_at_eos,
    )
    prompt_tokens: dict[int, int] = {}
    texts: dict[int, str] = {}
    index = {id(p): i for i, p in enumerate(prompts.prompts)}

    def measure(spec: MethodSpec, prompt: Prompt, p: SamplingParams) -> PromptRun:
        if spec.method == "server":
            opts = None
        elif spec.method == "ar":
            opts = DecodeOptions(decoder="ar")
        else:
            opts = DecodeOptions(
                block_size=spec.block_size,
                verify_length=config.verify_length,
                tree_budget=spec.tree_budget,
                lookup=spec.lookup,
            )
        r = run_remote(backend, prompt, config.mode, p, opts)
        prompt_tokens.setdefault(index[id(prompt)], r.prompt_tokens)
        texts.update(r.texts)
        return r.run

    names = [p.id for p in prompts.prompts]
    runs = timed_protocol(specs, prompts.prompts, names, config, params, measure, progress)
    base = runs.get("ar")
    drafter = backend.describe().get("drafter")
    served_block = backend.describe().get("block_size")

    def block_of(s: MethodSpec, rs: Sequence[PromptRun]) -> int | None:
        if s.method == "dflash":
            return s.block_size or served_block
        if s.method == "server":
            vl = [r.verify_length for r in rs if r.verify_length]
            return vl[0] + 1 if vl else None
        return None

    results = [
        summarise(
            s,
            runs[s.name],
            None if s.name == "ar" or base is None else base,
            None if s.method == "ar" else drafter,
            config.greedy and base is not None,
            names,
            lambda t: texts.get(t, str(t)),
            block_of(s, runs[s.name]),
        )
        for s in specs
    ]
    return BenchResult(
        config=config,
        dataset=prompts.describe(),
        prompt_ids=tuple(names),
        prompt_tokens=tuple(prompt_tokens.get(i, 0) for i in range(len(names))),
        environment=remote_environment(backend),
        methods=tuple(results),
        warnings=tuple(find_pitfalls(results, drafter_name=drafter)),
    )
