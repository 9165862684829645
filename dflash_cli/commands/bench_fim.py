"""`dflash bench --dataset fim`: the FIM cases on the local pair and on /infill servers.

`dflash bench` (dflash_cli.commands.bench) hands `--dataset fim` here; runtime.bench.fim measures.
The table goes to stderr; stdout carries one document in the chosen --format (JSON by default).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from ..common import (
    confidence_cut as confidence_cut_setting,
)
from ..common import open_pipeline, session_options
from ..render import warn_block_size
from .bench_options import BenchFormat, _block_sizes, _err, _run_with_progress


def bench_fim(
    refused: list[str],
    session: tuple[Any, ...] | None,
    server: str | None,
    llama_infill: str | None,
    limit: int | None,
    max_tokens: int,
    warmup: int,
    block_size: str | None,
    decode: tuple[Any, ...],
    fmt: BenchFormat,
) -> None:
    """`dflash bench --dataset fim`: the FIM cases on the local pair (ar and dflash, cold and warm) and
    on the /infill servers named (``--server``, ``--llama-infill``); runtime.bench.fim measures."""
    from runtime.bench.fim import (
        FimConfig,
        InfillClient,
        csv_text,
        header_lines,
        limit_cases,
        load_fim_cases,
        markdown_table,
        run_fim_bench,
    )
    from runtime.config import DecodeOptions
    from runtime.errors import ConfigError

    if refused:
        raise ConfigError(
            f"--dataset fim does not take {', '.join(refused)}: it runs greedy ar and dflash on each case "
            "and is not stored in bench history (docs/bench.md)"
        )
    sizes = _block_sizes(block_size)
    if len(sizes) > 1:
        raise ConfigError("--dataset fim takes one --block-size, not a sweep")
    verify_length, tree_budget, lookup, confidence_cut = decode
    dflash_opts = DecodeOptions(
        block_size=sizes[0] if sizes else None,
        verify_length=verify_length,
        tree_budget=tree_budget,
        lookup=lookup,
        confidence_cut=confidence_cut_setting(confidence_cut),
    )
    config = FimConfig(max_new_tokens=max_tokens, warmup=warmup, dflash=dflash_opts)
    cases = limit_cases(load_fim_cases(), limit)
    from ..common import api_key_from_env

    key = api_key_from_env()
    servers = ([InfillClient(server, "server", key)] if server else []) + (
        [InfillClient(llama_infill, "llama.cpp", key)] if llama_infill else []
    )
    pipe = None
    quantize = None
    if session is not None:
        model, target, drafter, device, dtype, offline, revision, quantize, threads, engine, compile_mode = session
        pipe = open_pipeline(
            session_options(
                model,
                target,
                drafter,
                device,
                dtype,
                offline,
                revision,
                quantize,
                threads,
                engine=engine,
                compile=compile_mode,
            )
        )
        warn_block_size(pipe, sizes)
        if pipe.drafter is None:
            _err(f"dflash: note: no drafter loaded for {pipe.pair.target_name}; skipping the dflash rows")
    result = _run_with_progress(lambda progress: run_fim_bench(pipe, cases, config, servers, progress, quantize))
    table = markdown_table(result)
    for line in header_lines(result):
        _err(line)
    _err(table)
    if fmt == BenchFormat.json:
        sys.stdout.write(json.dumps(result.to_json(), ensure_ascii=False) + "\n")
    elif fmt == BenchFormat.md:
        sys.stdout.write(table + "\n")
    else:
        sys.stdout.write(csv_text(result))
    sys.stdout.flush()
