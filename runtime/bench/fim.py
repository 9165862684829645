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

The time to the first complete line is defined in ``runtime.bench.fim_requests``. The pieces:
``runtime.bench.fim_cases`` (the case file), ``runtime.bench.fim_requests`` (one timed request, local
or ``/infill``), ``runtime.bench.fim_results`` (settings and result), this module (the bench: cold
and warm per case and engine) and ``runtime.bench.fim_table`` (the tables). Their public names are importable from here.

No UI imports here: the CLI prints ``markdown_table`` and ``to_json``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from runtime.bench.fim_cases import (
    ASSETS,
    CUTS,
    DEFAULT_MAX_TOKENS,
    FIELDS,
    FIM_FILE,
    FimCase,
    limit_cases,
    load_fim_cases,
)
from runtime.bench.fim_requests import InfillClient, LineClock, Run, run_local
from runtime.bench.fim_results import CaseResult, EngineRun, FimBenchResult, FimConfig
from runtime.bench.fim_table import COLUMNS, csv_text, header_lines, markdown_table, table_rows
from runtime.config import DecodeOptions, SamplingParams
from runtime.errors import ConfigError, InputError

Progress = Callable[[int, int, str], None]


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


__all__ = [
    "ASSETS",
    "COLUMNS",
    "CUTS",
    "DEFAULT_MAX_TOKENS",
    "FIELDS",
    "FIM_FILE",
    "CaseResult",
    "EngineRun",
    "FimBenchResult",
    "FimCase",
    "FimConfig",
    "InfillClient",
    "LineClock",
    "Progress",
    "Run",
    "csv_text",
    "header_lines",
    "limit_cases",
    "load_fim_cases",
    "markdown_table",
    "run_fim_bench",
    "run_local",
    "table_rows",
]
