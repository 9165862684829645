"""`dflash bench`: speed tests of DFlash against plain decoding and the methods users pick instead.

The table goes to stderr; stdout carries one document in the chosen --format (JSON by default).
Every run is stored in SQLite under the state dir; `dflash bench history` lists the runs and
`dflash bench compare A B` shows what changed. Measuring happens in runtime.bench.runner (local pair) and
runtime.bench.remote (`--server URL`: ar and dflash through an OpenAI-compatible server); `--dataset fim`
is run by dflash_cli.commands.bench_fim.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from enum import Enum
from typing import Annotated, Any

import typer

from ..common import (
    CompileOpt,
    ConfidenceCutOpt,
    DeviceOpt,
    DrafterOpt,
    DtypeChoice,
    DtypeOpt,
    EngineOpt,
    LookupOpt,
    ModelOpt,
    OfflineOpt,
    QuantizeOpt,
    RevisionOpt,
    SeedOpt,
    ServerOpt,
    TargetOpt,
    ThreadsOpt,
    TreeBudgetOpt,
    VerifyOpt,
    open_pipeline,
    session_options,
    state_dir,
    status,
)
from ..common import (
    confidence_cut as confidence_cut_setting,
)
from ..errors import handle_errors
from ..render import warn_block_size
from .bench_options import BenchFormat, _block_sizes, _err, _ints_or_auto, _run_with_progress, _split

bench_app = typer.Typer(
    help="Speed tests: DFlash vs plain decoding and the methods users pick instead, in one run.",
    no_args_is_help=False,
    invoke_without_command=True,
)


class ListFormat(str, Enum):
    """--format values of `history` and `compare`."""

    table = "table"
    json = "json"


def db_path() -> Any:
    """The bench history database."""
    return state_dir() / "bench.sqlite"


@bench_app.callback(invoke_without_command=True)
@handle_errors
def bench(
    ctx: typer.Context,
    model: ModelOpt = None,
    target: TargetOpt = None,
    drafter: DrafterOpt = None,
    dataset: Annotated[
        str | None,
        typer.Option(
            "--dataset",
            "-d",
            help="Prompt set: humaneval (default), mbpp, gsm8k, mt-bench, ood-chat, chat-coding; fim = code "
            "completion cases (fill-in-the-middle, its own table: docs/bench.md).",
        ),
    ] = None,
    prompts_file: Annotated[
        str | None,
        typer.Option("--prompts", "-p", help="Prompt file: JSONL ('prompt'/'messages' keys) or text, one per line."),
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", "-l", help="Use the first N prompts.")] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option("--max-tokens", "-n", help="New tokens per prompt (default 128; 64 with --dataset fim)."),
    ] = None,
    temperature: Annotated[float, typer.Option("--temperature", "-t", help="0 = greedy (checked against ar).")] = 0.0,
    methods: Annotated[
        str | None,
        typer.Option(
            "--methods", help="Comma list of ar,hf,pld,assisted,dflash (default: all available; ar always runs)."
        ),
    ] = None,
    block_size: Annotated[
        str | None,
        typer.Option(
            "--block-size", "-b", help="DFlash block sizes to sweep, e.g. 4,8,16 (default: the runtime's choice)."
        ),
    ] = None,
    verify_length: VerifyOpt = None,
    tree_budget: TreeBudgetOpt = None,
    tree_budgets: Annotated[
        str | None,
        typer.Option(
            "--tree-budgets",
            help="DFlash tree budgets to sweep, one row each, e.g. 0,4,8,16,32,auto (0 = chain, auto = the "
            "runtime's choice).",
        ),
    ] = None,
    lookup: LookupOpt = None,
    confidence_cut: ConfidenceCutOpt = None,
    lookups: Annotated[
        str | None,
        typer.Option(
            "--lookups",
            help="DFlash context-lookup lengths to sweep, one row each, e.g. 0,16,auto (0 = off, auto = the default).",
        ),
    ] = None,
    assistant: Annotated[
        str | None,
        typer.Option("--assistant", help="Draft model for transformers' assisted generation (Hub id or folder)."),
    ] = None,
    pld_tokens: Annotated[int, typer.Option("--pld-tokens", help="Drafts per step for prompt lookup.")] = 10,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed warm-up runs per method.")] = 1,
    stop_at_eos: Annotated[
        bool, typer.Option("--stop-at-eos", help="Stop at EOS (default: fixed-length runs of --max-tokens).")
    ] = False,
    raw: Annotated[bool, typer.Option("--raw", help="All prompts as raw completions (no chat template).")] = False,
    chat: Annotated[bool, typer.Option("--chat", help="All prompts through the chat template.")] = False,
    thinking: Annotated[bool, typer.Option("--thinking", help="Turn the chat template's thinking mode on.")] = False,
    seed: SeedOpt = 0,
    fmt: Annotated[BenchFormat, typer.Option("--format", "-f", help="stdout format.")] = BenchFormat.json,
    label: Annotated[str | None, typer.Option("--label", help="A note stored with the run (shown in history).")] = None,
    tokens: Annotated[bool, typer.Option("--tokens", help="Include generated token ids in the JSON.")] = False,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = DtypeChoice.auto,
    offline: OfflineOpt = False,
    revision: RevisionOpt = None,
    quantize: QuantizeOpt = None,
    threads: ThreadsOpt = None,
    engine: EngineOpt = None,
    compile_mode: CompileOpt = None,
    server: ServerOpt = None,
    llama_infill: Annotated[
        str | None,
        typer.Option(
            "--llama-infill",
            help="With --dataset fim: also measure a llama.cpp server's /infill (same cases, same requests), "
            "e.g. http://127.0.0.1:8080.",
        ),
    ] = None,
) -> None:
    """Run a prompt set through ar, hf, pld, assisted and dflash on the same target; compare speed."""
    if ctx.invoked_subcommand is not None:
        return
    if dataset is not None and dataset.strip().lower() == "fim":
        ignored = {
            "--prompts": prompts_file is not None,
            "--temperature": temperature != 0.0,
            "--methods": methods is not None,
            "--tree-budgets": tree_budgets is not None,
            "--lookups": lookups is not None,
            "--assistant": assistant is not None,
            "--pld-tokens": pld_tokens != 10,
            "--stop-at-eos": stop_at_eos,
            "--raw": raw,
            "--chat": chat,
            "--thinking": thinking,
            "--label": label is not None,
            "--tokens": tokens,
        }
        if server and (target or drafter):
            raise typer.BadParameter("--server excludes --target/--drafter: the server decides the models")
        from .bench_fim import bench_fim

        bench_fim(
            [flag for flag, given in ignored.items() if given],
            session=None
            if server
            else (model, target, drafter, device, dtype, offline, revision, quantize, threads, engine, compile_mode),
            server=server,
            llama_infill=llama_infill,
            limit=limit,
            max_tokens=64 if max_tokens is None else max_tokens,
            warmup=warmup,
            block_size=block_size,
            decode=(verify_length, tree_budget, lookup, confidence_cut),
            fmt=fmt,
        )
        return
    if llama_infill:
        raise typer.BadParameter("--llama-infill measures /infill: it goes with --dataset fim")
    max_tokens = 128 if max_tokens is None else max_tokens
    from runtime.bench.config import BenchConfig
    from runtime.bench.datasets import load_dataset, load_prompt_file
    from runtime.bench.store import BenchStore
    from runtime.errors import ConfigError, DFlashError

    if server and (target or drafter):
        raise typer.BadParameter("--server excludes --target/--drafter: the server decides the models")
    if server and assistant:
        raise ConfigError("--assistant runs assisted generation on local weights; it cannot run with --server")
    if server and thinking:
        raise ConfigError("--thinking is not available with --server: the server's chat template decides")
    if raw and chat:
        raise ConfigError("--raw and --chat exclude each other")
    if dataset and prompts_file:
        raise ConfigError("use --dataset or --prompts, not both")
    method_list = _split(methods, "--methods")
    sizes = _block_sizes(block_size)
    # Cheap checks before loading any model: the prompt set and the configuration.
    prompt_set = (load_prompt_file(prompts_file) if prompts_file else load_dataset(dataset or "humaneval")).limit(limit)
    if method_list:
        wanted = tuple(method_list)
    elif server:  # transformers' generate needs the weights here
        wanted = ("ar", "dflash")
        _err("dflash: note: --server: skipping hf and pld (they run transformers' generate on local weights)")
    else:
        wanted = ("ar", "hf", "pld", "dflash") + (("assisted",) if assistant else ())
    config = BenchConfig(
        methods=wanted,
        block_sizes=sizes,
        verify_length=verify_length,
        tree_budgets=_ints_or_auto(tree_budgets, "--tree-budgets", "budgets like 0,4,8,16,auto"),
        tree_budget=tree_budget,
        lookups=_ints_or_auto(lookups, "--lookups", "lengths like 0,8,16,auto"),
        lookup=lookup,
        confidence_cut=confidence_cut_setting(confidence_cut),
        max_new_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        warmup=warmup,
        stop_at_eos=stop_at_eos,
        pld_tokens=pld_tokens,
        mode="raw" if raw else ("chat" if chat else None),
        thinking=thinking,
    )
    if server:
        from runtime.bench.remote import refuse_local_methods

        refuse_local_methods(config)
    if "assisted" in config.methods and not assistant:
        raise ConfigError("the assisted method needs a draft model: pass --assistant ID|DIR")

    if server:
        from runtime.bench.remote import remote_specs, run_bench_remote
        from runtime.session import open_remote

        backend = open_remote(session_options(model, server=server), status)
        remote_specs(config, backend.flavour)  # refuse what the server cannot run before any request
        result = _run_with_progress(lambda progress: run_bench_remote(backend, prompt_set, config, progress))
    else:
        from runtime.bench.methods import load_assistant
        from runtime.bench.runner import run_bench

        session = session_options(
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
        pipe = open_pipeline(session)
        warn_block_size(pipe, sizes)
        if not method_list and pipe.drafter is None:
            _err(f"dflash: note: no drafter loaded for {pipe.pair.target_name}; skipping the dflash rows")
            config = replace(
                config, methods=tuple(m for m in config.methods if m != "dflash"), block_sizes=(), tree_budgets=()
            )
        helper = (
            load_assistant(assistant, pipe, replace(session.load, revision=None, quantize=None)) if assistant else None
        )
        result = _run_with_progress(lambda progress: run_bench(pipe, prompt_set, config, helper, progress, quantize))
    doc = result.to_json(with_tokens=tokens)
    store = BenchStore(db_path())
    try:
        run_id: int | None = store.save(doc, label)
    except DFlashError as e:  # the measurements still go out
        _err(f"dflash: warning: {e}; this run was not stored")
        run_id = None

    from ..bench_render import bench_csv, bench_details, bench_header, bench_table

    _err(bench_header(doc))
    _err(bench_table(doc))
    for line in bench_details(doc):
        _err(line)
    if run_id is not None:
        _err(f"saved as run {run_id} in {store.path} (dflash bench history; dflash bench compare <A> {run_id})")
    if fmt == BenchFormat.json:
        sys.stdout.write(json.dumps(doc, ensure_ascii=False) + "\n")
    elif fmt == BenchFormat.md:
        sys.stdout.write(bench_table(doc) + "\n")
    else:
        sys.stdout.write(bench_csv(doc))
    sys.stdout.flush()


@bench_app.command("history")
@handle_errors
def history(
    limit: Annotated[int, typer.Option("--limit", "-l", help="Show the last N runs.")] = 20,
    fmt: Annotated[ListFormat, typer.Option("--format", "-f", help="table or json.")] = ListFormat.table,
) -> None:
    """List stored bench runs, newest first."""
    from runtime.bench.store import BenchStore

    from ..bench_render import history_table

    runs = BenchStore(db_path()).history(limit)
    if fmt == ListFormat.json:
        sys.stdout.write(json.dumps([r.to_json() for r in runs], ensure_ascii=False) + "\n")
        return
    if not runs:
        _err("no bench runs recorded yet; run `dflash bench`")
        return
    sys.stdout.write(history_table(runs) + "\n")


@bench_app.command("compare")
@handle_errors
def compare(
    run_a: Annotated[str, typer.Argument(help="Run id (see history), or 'last' / 'prev'.")],
    run_b: Annotated[str, typer.Argument(help="Run id to compare against the first.")],
    fmt: Annotated[ListFormat, typer.Option("--format", "-f", help="table or json.")] = ListFormat.table,
) -> None:
    """Show how tok/s, TTFT, tau, acceptance and speedup changed from run A to run B."""
    from runtime.bench.store import BenchStore, compare_runs

    from ..bench_render import compare_header, compare_table

    store = BenchStore(db_path())
    cmp = compare_runs(store.get(run_a), store.get(run_b))
    if fmt == ListFormat.json:
        sys.stdout.write(json.dumps(cmp.to_json(), ensure_ascii=False) + "\n")
        return
    sys.stdout.write("\n".join([*compare_header(cmp), compare_table(cmp)]) + "\n")
