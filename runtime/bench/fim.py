"""``dflash bench --dataset fim``: code completion as editors ask for it, case by case.

Each case of ``runtime/assets/prompts/fim.jsonl`` (hand-written files with one hole, see the README
there) is completed through the target's own fill-in-the-middle prompt (``runtime.fim.build``),
greedy, up to N new tokens, stopping at the family's end-of-middle tokens:

- cold, prompt cache off: plain decoding (``ar``) and DFlash on the same prompt; per case tau,
  decode tok/s, time to the first token, time to the first complete line and whether DFlash's
  tokens equal plain decoding's (at float32 they must: DFlash is lossless);
- warm, prompt cache on: the file is opened (a one-token request on it), then the user types one
  more character at the cursor (``prefix + middle[:1]``) and asks again: the share of that prompt
  taken from the cache, its time to the first token and to the first complete line.

A llama.cpp server (``/infill``; ``dflash serve`` answers it too) is measured on the same cases with
the same requests (``InfillClient``): its rows carry the client's own TTFT and first-line times and
the server's own ``timings`` (``prompt_n``, ``prompt_ms``, ``predicted_per_second``, ``cache_n``).

The time to the first complete line runs from the request's start to the arrival of the event (or
stream chunk) after which the middle holds a newline following some non-whitespace; a middle that
ends (an end-of-middle token) with text but no newline is complete when it ends; one cut by the
token limit before any line ended has none. Times are taken on arrival (``time.perf_counter``),
so both engines are measured the way an editor waits for them.

No UI imports here: the CLI prints ``markdown_table`` and ``to_json``.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from runtime.config import DecodeOptions, SamplingParams
from runtime.engine.events import BlockVerified, Finished, PrefillDone
from runtime.errors import ConfigError, InputError

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "prompts"
FIM_FILE = ASSETS / "fim.jsonl"
FIELDS = ("id", "language", "filename", "cut", "prefix", "suffix", "middle")
CUTS = ("line", "lines", "block", "body")
DEFAULT_MAX_TOKENS = 64

Progress = Callable[[int, int, str], None]


# -- the cases ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FimCase:
    """One file with a hole.

    Attributes:
        id: stable identifier.
        language: the file's language.
        filename: a plausible path for it.
        cut: how the hole was cut: "line" (rest of a line), "lines", "block" or "body".
        prefix, suffix: the text before and after the hole.
        middle: the reference middle (for information: bench compares DFlash with plain decoding).
    """

    id: str
    language: str
    filename: str
    cut: str
    prefix: str
    suffix: str
    middle: str

    def edited(self) -> tuple[str, str]:
        """The same file one keystroke later: the middle's first character typed at the cursor."""
        return self.prefix + self.middle[:1], self.suffix


def load_fim_cases(path: str | Path = FIM_FILE) -> tuple[FimCase, ...]:
    """The cases of a FIM case file (JSONL, one object with ``FIELDS`` per line).

    Raises:
        InputError: a missing file, invalid JSON, a missing or empty field, an unknown cut, a
            repeated id.
    """
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise InputError(f"cannot read FIM cases {p}: {e}") from None
    cases: list[FimCase] = []
    seen: set[str] = set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{p.name} line {n} is not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise InputError(f"{p.name} line {n}: expected a JSON object")
        missing = [k for k in FIELDS if not isinstance(obj.get(k), str) or (k != "suffix" and not obj[k])]
        if missing:
            raise InputError(f"{p.name} line {n}: missing or empty {', '.join(missing)}")
        if obj["cut"] not in CUTS:
            raise InputError(f"{p.name} line {n}: cut must be one of {', '.join(CUTS)}, got {obj['cut']!r}")
        if obj["id"] in seen:
            raise InputError(f"{p.name} line {n}: id {obj['id']!r} appears twice")
        seen.add(obj["id"])
        cases.append(FimCase(*(str(obj[k]) for k in FIELDS)))
    if not cases:
        raise InputError(f"{p} holds no FIM cases")
    return tuple(cases)


def limit_cases(cases: Sequence[FimCase], n: int | None) -> tuple[FimCase, ...]:
    """The first ``n`` cases (all when None).

    Raises:
        ConfigError: ``n`` < 1.
    """
    if n is None:
        return tuple(cases)
    if n < 1:
        raise ConfigError(f"--limit must be >= 1, got {n}")
    return tuple(cases[:n])


# -- one request -------------------------------------------------------------------------------------
class LineClock:
    """When the streamed middle first holds a complete line (see the module docstring)."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.text = ""
        self.at: float | None = None

    def feed(self, text: str, now: float) -> None:
        """Text that arrived at ``now``."""
        self.text += text
        if self.at is not None or not text:
            return
        stripped = self.text.lstrip()
        if "\n" in stripped and stripped.split("\n", 1)[0].strip():
            self.at = now - self.t0

    def end(self, now: float, stopped: bool) -> None:
        """The request ended at ``now``; ``stopped``: at an end-of-middle token (not the limit)."""
        if self.at is None and stopped and self.text.strip():
            self.at = now - self.t0


@dataclass
class Run:
    """One request, measured on arrival.

    Attributes:
        text: the middle.
        token_ids: its ids (empty for a server that does not return them).
        prompt_tokens: prompt length in tokens.
        tokens_cached: leading prompt tokens taken from the cache.
        generated: tokens generated (the end-of-middle token included when one ended it).
        ttft_s: request start to the first token's arrival.
        first_line_s: request start to the first complete line (None: no line completed).
        total_s: request start to its end.
        decode_tps: tokens after the first per second after the first (the server's own
            ``predicted_per_second`` for a server).
        tau: tokens committed per verify step (None: not reported).
        finish: "stop" (end of middle) or "length".
        timings: a server's own ``timings`` object (None locally).
    """

    text: str
    token_ids: list[int]
    prompt_tokens: int
    tokens_cached: int
    generated: int
    ttft_s: float | None
    first_line_s: float | None
    total_s: float
    decode_tps: float
    tau: float | None
    finish: str
    timings: dict[str, Any] | None = None

    @property
    def cached_share(self) -> float:
        """Share of the prompt taken from the cache."""
        return self.tokens_cached / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_json(self, with_tokens: bool = True) -> dict[str, Any]:
        """Plain-JSON form."""
        out: dict[str, Any] = {
            "text": self.text,
            "prompt_tokens": self.prompt_tokens,
            "tokens_cached": self.tokens_cached,
            "cached_share": self.cached_share,
            "generated_tokens": self.generated,
            "ttft_seconds": self.ttft_s,
            "first_line_seconds": self.first_line_s,
            "total_seconds": self.total_s,
            "decode_tokens_per_second": self.decode_tps,
            "tau": self.tau,
            "finish": self.finish,
        }
        if with_tokens:
            out["token_ids"] = list(self.token_ids)
        if self.timings is not None:
            out["timings"] = self.timings
        return out


def run_local(pipe: Any, ids: Sequence[int], params: SamplingParams, opts: DecodeOptions) -> Run:
    """One request through a loaded pipeline, timed as its events arrive."""
    t0 = time.perf_counter()
    clock = LineClock(t0)
    tokens: list[int] = []
    ttft: float | None = None
    cached = prompt_tokens = 0
    stats = None
    reason = "length"
    for ev in pipe.stream_ids(ids, params, opts):
        now = time.perf_counter()
        if isinstance(ev, PrefillDone):
            ttft = now - t0
            cached, prompt_tokens = ev.tokens_cached, ev.prompt_tokens
        if isinstance(ev, (PrefillDone, BlockVerified)):
            tokens += [t.token_id for t in ev.tokens]
            clock.feed(ev.text, now)
        elif isinstance(ev, Finished):
            stats, reason = ev.stats, ev.reason
            clock.end(now, ev.reason == "stop")
    end = time.perf_counter()
    if stats is None:  # a decoder always ends with Finished; keep the type checker honest
        raise RuntimeError("the decoder ended without a Finished event")
    return Run(
        text=clock.text,
        token_ids=tokens,
        prompt_tokens=prompt_tokens or len(ids),
        tokens_cached=cached,
        generated=stats.generated_tokens,
        ttft_s=ttft,
        first_line_s=clock.at,
        total_s=end - t0,
        decode_tps=stats.decode_tokens_per_second,
        tau=stats.tau if stats.decoder == "dflash" else 1.0,
        finish="stop" if reason == "stop" else "length",
    )


class InfillClient:
    """llama.cpp's ``POST /infill`` (llama-server, or ``dflash serve``), streamed.

    Args:
        url: the server (``http://host:port``; a bare ``host:port`` works).
        label: the engine name of its rows ("llama.cpp", "server").
        api_key: sent as ``Authorization: Bearer`` (llama-server ``--api-key``, ``dflash serve``'s key).
        timeout: seconds per request.
    """

    def __init__(self, url: str, label: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        from runtime.client.http import normalize_url

        self.url = normalize_url(url)
        self.label = label
        self.api_key = api_key
        self.timeout = timeout

    def run(self, prefix: str, suffix: str, n_predict: int, cache_prompt: bool) -> Run:
        """One greedy request; times from the client, counts and ``timings`` from the server.

        Raises:
            ConfigError: the server refused the API key (401, 403).
            RemoteError: the server cannot be reached, answers an error, or streams no final chunk.
        """
        import httpx

        from runtime.client.http import RemoteError

        body = {
            "input_prefix": prefix,
            "input_suffix": suffix,
            "input_extra": [],
            "n_predict": n_predict,
            "temperature": 0,
            "cache_prompt": cache_prompt,
            "stream": True,
        }
        where = f"{self.url}/infill"
        t0 = time.perf_counter()
        clock = LineClock(t0)
        ttft: float | None = None
        final: dict[str, Any] | None = None
        pieces = 0
        try:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            with httpx.stream("POST", where, json=body, headers=headers, timeout=self.timeout) as resp:
                if resp.status_code in (401, 403):
                    raise ConfigError(
                        f"{where} refused the API key ({resp.status_code}); set DFLASH_API_KEY (or OPENAI_API_KEY)"
                    )
                if resp.status_code >= 400:
                    detail = resp.read().decode("utf-8", "replace").strip().splitlines()
                    raise RemoteError(
                        f"{where} answered {resp.status_code}: {(detail or [resp.reason_phrase])[0][:300]}"
                        + ("; is it llama-server (or dflash serve)?" if resp.status_code == 404 else "")
                    )
                for chunk in _sse_objects(resp.iter_lines(), where):
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - t0
                    content = chunk.get("content")
                    if isinstance(content, str) and content:
                        pieces += 1
                        clock.feed(content, now)
                    if chunk.get("stop") is True:
                        final = chunk
                        break
        except httpx.TransportError as e:
            raise RemoteError(f"cannot reach {where}: {e or type(e).__name__}; is the server running?") from None
        end = time.perf_counter()
        if final is None:
            raise RemoteError(f'{where} ended its stream without a final chunk ("stop": true)')
        stopped = str(final.get("stop_type", "")) in ("eos", "word")
        clock.end(end, stopped)
        timings = final.get("timings") if isinstance(final.get("timings"), dict) else None
        t = timings or {}
        cached = int(t.get("cache_n", final.get("tokens_cached", 0)) or 0)
        evaluated = int(final.get("tokens_evaluated") or 0) or int(t.get("prompt_n") or 0) + cached
        stats = (final.get("dflash") or {}).get("stats") if isinstance(final.get("dflash"), dict) else None
        tau = float(stats["tau"]) if isinstance(stats, dict) and stats.get("tau") is not None else None
        return Run(
            text=clock.text,
            token_ids=[],
            prompt_tokens=evaluated,
            tokens_cached=cached,
            generated=int(final.get("tokens_predicted") or t.get("predicted_n") or pieces),
            ttft_s=ttft,
            first_line_s=clock.at,
            total_s=end - t0,
            decode_tps=float(t.get("predicted_per_second") or 0.0),
            tau=tau,
            finish="stop" if stopped else "length",
            timings=timings,
        )


def _sse_objects(lines: Iterator[str], where: str) -> Iterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream (``data: {...}`` lines)."""
    from runtime.client.http import RemoteError

    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if not payload or payload == "[DONE]":
            continue
        try:
            obj = json.loads(payload)
        except json.JSONDecodeError:
            raise RemoteError(f"{where} streamed something that is not JSON: {payload[:120]!r}") from None
        if isinstance(obj, dict):
            if "error" in obj and "content" not in obj:
                raise RemoteError(f"{where} failed: {obj['error']}")
            yield obj


# -- the bench ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FimConfig:
    """What ``run_fim_bench`` runs.

    Attributes:
        max_new_tokens: new tokens per request (N).
        warmup: untimed runs of each local decoder on the first case before the timed ones.
        dflash: DFlash's decoding options (block size, verify length, tree, lookup, confidence cut);
            the bench sets ``decoder`` and ``cache_prompt`` itself.
    """

    max_new_tokens: int = DEFAULT_MAX_TOKENS
    warmup: int = 1
    dflash: DecodeOptions = field(default_factory=DecodeOptions)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-tokens must be >= 1, got {self.max_new_tokens}")
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {self.warmup}")


@dataclass
class EngineRun:
    """One engine on one case: the cold request, the warm one and the equality with plain decoding."""

    cold: Run
    warm: Run | None = None
    same_as_ar: bool | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return {
            "cold": self.cold.to_json(),
            "warm": None if self.warm is None else self.warm.to_json(),
            "same_as_ar": self.same_as_ar,
        }


@dataclass
class CaseResult:
    """Every engine on one case."""

    case: FimCase
    engines: dict[str, EngineRun]

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form."""
        c = self.case
        return {
            "id": c.id,
            "language": c.language,
            "filename": c.filename,
            "cut": c.cut,
            "engines": {name: e.to_json() for name, e in self.engines.items()},
        }


@dataclass
class FimBenchResult:
    """A FIM bench run: the cases, per engine, and where it ran."""

    config: FimConfig
    cases: list[CaseResult]
    engines: list[str]
    environment: dict[str, Any] | None = None
    servers: dict[str, str] = field(default_factory=dict)
    dtype: str | None = None

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per engine: medians over the cases, and how many cases equalled plain decoding."""
        out: dict[str, dict[str, Any]] = {}
        for name in self.engines:
            runs = [c.engines[name] for c in self.cases if name in c.engines]
            warm = [r.warm for r in runs if r.warm is not None]
            same = [r.same_as_ar for r in runs if r.same_as_ar is not None]
            out[name] = {
                "cases": len(runs),
                "prompt_tokens": _median([r.cold.prompt_tokens for r in runs]),
                "generated_tokens": _median([r.cold.generated for r in runs]),
                "tau": _median([r.cold.tau for r in runs if r.cold.tau is not None]),
                "decode_tokens_per_second": _median([r.cold.decode_tps for r in runs]),
                "ttft_seconds": _median([r.cold.ttft_s for r in runs if r.cold.ttft_s is not None]),
                "first_line_seconds": _median([r.cold.first_line_s for r in runs if r.cold.first_line_s is not None]),
                "lines_completed": sum(r.cold.first_line_s is not None for r in runs),
                "warm_cached_share": _median([w.cached_share for w in warm]),
                "warm_ttft_seconds": _median([w.ttft_s for w in warm if w.ttft_s is not None]),
                "warm_first_line_seconds": _median([w.first_line_s for w in warm if w.first_line_s is not None]),
                "same_as_ar": sum(same) if same else None,
                "compared": len(same),
            }
        return out

    def to_json(self) -> dict[str, Any]:
        """The document ``dflash bench --dataset fim`` prints (``--format json``)."""
        return {
            "kind": "fim",
            "dataset": {"name": "fim", "source": str(FIM_FILE.name), "count": len(self.cases)},
            "config": {
                "max_new_tokens": self.config.max_new_tokens,
                "warmup": self.config.warmup,
                "temperature": 0.0,
                "dflash": _opts_json(self.config.dflash),
                "warm_edit": "prefix + middle[:1] (one character typed at the cursor)",
            },
            "dtype": self.dtype,
            "environment": self.environment,
            "servers": dict(self.servers),
            "engines": list(self.engines),
            "cases": [c.to_json() for c in self.cases],
            "summary": self.summary(),
        }


def _opts_json(o: DecodeOptions) -> dict[str, Any]:
    return {
        "block_size": o.block_size,
        "verify_length": o.verify_length,
        "tree_budget": o.tree_budget,
        "lookup": o.lookup,
        "confidence_cut": o.confidence_cut,
    }


def _median(xs: Sequence[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


def run_fim_bench(
    pipe: Any | None,
    cases: Sequence[FimCase],
    config: FimConfig,
    servers: Sequence[InfillClient] = (),
    progress: Progress | None = None,
    quantize: str | None = None,
) -> FimBenchResult:
    """Measure every case on the local pair (``pipe``; None: servers only) and on each server.

    Raises:
        InputError: the target's tokenizer has no FIM tokens.
        RemoteError: a server cannot be reached or fails.
    """
    import runtime.fim as fim

    if not cases:
        raise ConfigError("no FIM cases to run")
    params = SamplingParams(temperature=0.0, max_new_tokens=config.max_new_tokens)
    local: list[str] = []
    prompts: list[tuple[list[int], list[int]]] = []
    if pipe is not None:
        target_name = pipe.pair.target_name
        stops = fim.require(pipe.tokenizer, target_name).stop_ids  # no FIM tokens: fails before anything runs
        for c in cases:
            p = fim.build(pipe.tokenizer, c.prefix, c.suffix, target_name=target_name)
            e = fim.build(pipe.tokenizer, *c.edited(), target_name=target_name)
            context = getattr(pipe.target, "max_positions", None)
            if isinstance(context, int) and max(len(p.ids), len(e.ids)) >= context:
                raise InputError(
                    f"FIM case {c.id}'s prompt has {max(len(p.ids), len(e.ids))} tokens but {target_name}'s "
                    f"context is {context} tokens"
                )
            prompts.append((p.ids, e.ids))
        params = replace(params, stop_token_ids=stops)
        local = ["ar"] + (["dflash"] if pipe.drafter is not None else [])
    engines = local + [s.label for s in servers]
    ar_opts = DecodeOptions(decoder="ar", cache_prompt=False)
    df_opts = replace(config.dflash, decoder="dflash", cache_prompt=False, slot=None)
    warm_opts = replace(df_opts, cache_prompt=True) if "dflash" in local else replace(ar_opts, cache_prompt=True)
    total = len(cases) * len(engines) + (config.warmup * len(local) if local else 0)
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, what)

    if pipe is not None:  # untimed warm-up: first allocations, kernels, calibration reads
        short = replace(params, max_new_tokens=min(config.max_new_tokens, 16))
        for _ in range(config.warmup):
            for name in local:
                run_local(pipe, prompts[0][0], short, ar_opts if name == "ar" else df_opts)
                tick(f"warm-up {name}")

    results: list[CaseResult] = []
    for i, c in enumerate(cases):
        runs: dict[str, EngineRun] = {}
        if pipe is not None:
            ids, edited = prompts[i]
            runs["ar"] = EngineRun(run_local(pipe, ids, params, ar_opts))
            tick(f"{c.id} ar")
            if "dflash" in local:
                runs["dflash"] = EngineRun(run_local(pipe, ids, params, df_opts))
                runs["dflash"].same_as_ar = runs["dflash"].cold.token_ids == runs["ar"].cold.token_ids
                tick(f"{c.id} dflash")
            cache = getattr(pipe, "prompt_cache", None)
            if cache is not None:
                cache.clear()  # the file is opened: nothing of another case in the cache
            run_local(pipe, ids, replace(params, max_new_tokens=1), warm_opts)
            runs[local[-1]].warm = run_local(pipe, edited, params, warm_opts)
        for s in servers:
            cold = s.run(c.prefix, c.suffix, config.max_new_tokens, cache_prompt=False)
            s.run(c.prefix, c.suffix, 1, cache_prompt=True)  # the file is opened
            runs[s.label] = EngineRun(cold, s.run(*c.edited(), config.max_new_tokens, cache_prompt=True))
            tick(f"{c.id} {s.label}")
        results.append(CaseResult(c, runs))

    env = None
    dtype = None
    if pipe is not None:
        from runtime.bench.env import environment
        from runtime.engine.models.device import dtype_name

        env = environment(pipe, quantize=quantize)
        dtype = dtype_name(pipe.dtype)
    return FimBenchResult(
        config=config,
        cases=results,
        engines=engines,
        environment=env,
        servers={s.label: s.url for s in servers},
        dtype=dtype,
    )


# -- rendering ---------------------------------------------------------------------------------------
COLUMNS = (
    "case",
    "language",
    "cut",
    "engine",
    "prompt",
    "tokens",
    "tau",
    "decode tok/s",
    "TTFT ms",
    "1st line ms",
    "warm cached",
    "warm TTFT ms",
    "warm 1st line ms",
    "= ar",
)


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.0f}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _same(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "NO")


def table_rows(result: FimBenchResult) -> list[list[str]]:
    """The table's rows (cells as text): one per case and engine, then one median row per engine."""
    rows: list[list[str]] = []
    for cr in result.cases:
        c = cr.case
        for name in result.engines:
            e = cr.engines.get(name)
            if e is None:
                continue
            r, w = e.cold, e.warm
            rows.append(
                [
                    c.id,
                    c.language,
                    c.cut,
                    name,
                    str(r.prompt_tokens),
                    str(r.generated),
                    _num(r.tau, ".2f"),
                    _num(r.decode_tps, ".1f"),
                    _ms(r.ttft_s),
                    _ms(r.first_line_s),
                    "-" if w is None else f"{w.cached_share:.0%}",
                    "-" if w is None else _ms(w.ttft_s),
                    "-" if w is None else _ms(w.first_line_s),
                    _same(e.same_as_ar),
                ]
            )
    for name, s in result.summary().items():
        rows.append(
            [
                "**median**",
                f"{s['cases']} cases",
                "",
                name,
                _num(s["prompt_tokens"], ".0f"),
                _num(s["generated_tokens"], ".0f"),
                _num(s["tau"], ".2f"),
                _num(s["decode_tokens_per_second"], ".1f"),
                _ms(s["ttft_seconds"]),
                _ms(s["first_line_seconds"]),
                _num(s["warm_cached_share"], ".0%"),
                _ms(s["warm_ttft_seconds"]),
                _ms(s["warm_first_line_seconds"]),
                "-" if s["same_as_ar"] is None else f"{s['same_as_ar']}/{s['compared']}",
            ]
        )
    return rows


def markdown_table(result: FimBenchResult) -> str:
    """The Markdown table of ``table_rows`` under ``COLUMNS``."""
    lines = [_row(COLUMNS), _row(["---"] * len(COLUMNS))]
    lines += [_row(r) for r in table_rows(result)]
    return "\n".join(lines)


def csv_text(result: FimBenchResult) -> str:
    """``table_rows`` as CSV (header first)."""
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for r in table_rows(result):
        w.writerow([cell.replace("**", "") for cell in r])
    return buf.getvalue()


def header_lines(result: FimBenchResult) -> list[str]:
    """What ran, and the speedups of the medians (for stderr above the table)."""
    env = result.environment or {}
    where = (
        f"{env.get('target', {}).get('id')} + {(env.get('drafter') or {}).get('id')}, "
        f"{env.get('device_name') or env.get('device')}, {result.dtype}"
        if env
        else "servers only"
    )
    out = [
        f"dflash bench --dataset fim: {len(result.cases)} cases, greedy, up to {result.config.max_new_tokens} "
        f"new tokens, end-of-middle stops; {where}"
    ]
    for label, url in result.servers.items():
        out.append(f"  {label}: {url}/infill (decode tok/s = its timings.predicted_per_second)")
    s = result.summary()
    base = (s.get("ar") or {}).get("decode_tokens_per_second")
    df = (s.get("dflash") or {}).get("decode_tokens_per_second")
    if df and base:
        out.append(f"  dflash decode speedup over ar (medians): {df / base:.2f}x")
    for label in result.servers:
        other = s[label]["decode_tokens_per_second"]
        if df and other:
            out.append(f"  dflash decode speedup over {label} (medians): {df / other:.2f}x")
    if "dflash" in s and s["dflash"]["same_as_ar"] is not None:
        same, n = s["dflash"]["same_as_ar"], s["dflash"]["compared"]
        note = "" if result.dtype == "float32" or same == n else " (outside float32, rounding may part them)"
        out.append(f"  dflash tokens equal plain decoding's on {same}/{n} cases{note}")
    return out
