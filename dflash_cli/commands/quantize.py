"""`dflash quantize`: weight-only quantization of a target (and drafter), saved for reuse.

stdout carries only the saved folder (or, with --json, one JSON document); progress, the summary
and the --report table go to stderr.
"""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..common import (
    DeviceOpt,
    DrafterOpt,
    DtypeChoice,
    DtypeOpt,
    ModelOpt,
    OfflineOpt,
    RevisionOpt,
    TargetOpt,
    ThreadsOpt,
    quiet_transformers,
    session_options,
)
from ..errors import handle_errors

if TYPE_CHECKING:
    from runtime.quantize.job import QuantizeResult


class SchemeChoice(str, Enum):
    """--scheme values (runtime.models.quant_schemes.SCHEMES)."""

    int8 = "int8"
    int4 = "int4"
    q4 = "q4"
    bnb_int8 = "bnb-int8"
    bnb_nf4 = "bnb-nf4"


def human_bytes(n: int | None) -> str:
    """1234567 -> '1.2 MB' (decimal units, as disk tools print them)."""
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1000
    return f"{size:.2f} TB"


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def _ratio(before: int, after: int) -> str:
    return f"{after / before:.2f}x" if before else "-"


def render_summary(res: QuantizeResult, console: Any) -> None:
    """Sizes and times, then the --report comparison, as tables on ``console`` (stderr)."""
    from rich.table import Table

    lib = f"{res.library} {res.library_version or ''}".strip()
    table = Table(title=f"dflash quantize: {res.scheme} ({lib}) on {res.device}, {res.dtype}", title_justify="left")
    table.add_column("")
    table.add_column("unquantized", justify="right")
    table.add_column(res.scheme, justify="right")
    table.add_column("ratio", justify="right")
    disk_note = "" if res.stored_quantized else " (float; quantized at load)"
    table.add_row(
        "target weights on disk",
        human_bytes(res.disk_before),
        human_bytes(res.disk_after) + disk_note,
        _ratio(res.disk_before, res.disk_after),
    )
    table.add_row(
        "target weights in memory",
        human_bytes(res.memory_before),
        human_bytes(res.memory_after),
        _ratio(res.memory_before, res.memory_after),
    )
    if res.drafter_memory_before is not None and res.drafter_memory_after is not None:
        table.add_row(
            "drafter weights in memory",
            human_bytes(res.drafter_memory_before),
            human_bytes(res.drafter_memory_after),
            _ratio(res.drafter_memory_before, res.drafter_memory_after),
        )
    table.add_row("pair load time", f"{res.load_seconds_before:.2f} s", f"{res.load_seconds_after:.2f} s", "")
    table.add_row("quantize / save time", "", f"{res.quantize_seconds:.2f} s / {res.save_seconds:.2f} s", "")
    total = res.layers_quantized + res.layers_float
    table.add_row("linear layers quantized", "", f"{res.layers_quantized} of {total}", "")
    console.print(table)
    rep = res.report
    if rep is not None:
        t = Table(
            title=f"report: {rep.prompts} prompts x {rep.max_new_tokens} tokens, greedy, same prompts for both pairs",
            title_justify="left",
        )
        t.add_column("")
        t.add_column("unquantized", justify="right")
        t.add_column(res.scheme, justify="right")
        b, q = rep.base, rep.quantized
        if b.dflash is not None and q.dflash is not None:
            t.add_row("DFlash tok/s", f"{b.dflash.tokens_per_second:.1f}", f"{q.dflash.tokens_per_second:.1f}")
            t.add_row("tau (tokens per verify step)", f"{b.dflash.tau:.2f}", f"{q.dflash.tau:.2f}")
            t.add_row("draft acceptance", _pct(b.dflash.acceptance_rate), _pct(q.dflash.acceptance_rate))
        t.add_row("plain decoding tok/s", f"{b.ar.tokens_per_second:.1f}", f"{q.ar.tokens_per_second:.1f}")
        if b.speedup is not None and q.speedup is not None:
            t.add_row("DFlash speedup", f"{b.speedup:.2f}x", f"{q.speedup:.2f}x")
        t.add_row("greedy tokens matching the unquantized target", "100%", _pct(rep.agreement))
        t.add_row("identical greedy prefix", "100%", _pct(rep.prefix_match))
        if b.lossless is not None and q.lossless is not None:
            t.add_row(
                "lossless (DFlash == plain greedy)",
                "yes" if b.lossless else "NO",
                "yes" if q.lossless else "NO",
            )
        console.print(t)


@handle_errors
def quantize(
    scheme: Annotated[
        SchemeChoice,
        typer.Option(
            "--scheme",
            help="int8 / int4: torchao weight-only (CPU, CUDA); q4: dflash's 4-bit kernel (CPU); "
            "bnb-int8 / bnb-nf4: bitsandbytes (CUDA only).",
            case_sensitive=False,
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder to save the quantized target in.")],
    model: ModelOpt = None,
    target: TargetOpt = None,
    drafter: DrafterOpt = None,
    quantize_drafter: Annotated[
        bool | None,
        typer.Option(
            "--quantize-drafter/--float-drafter",
            help="Quantize the drafter too, into OUT/drafter (default: when --drafter names one).",
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace OUT if it exists.")] = False,
    report: Annotated[
        bool, typer.Option("--report", help="Compare tok/s, tau and greedy agreement with the unquantized pair.")
    ] = False,
    report_tokens: Annotated[int, typer.Option("--report-tokens", help="Tokens per --report run.", min=1)] = 64,
    report_prompts: Annotated[
        int, typer.Option("--report-prompts", help="Prompts per --report (1-5).", min=1, max=5)
    ] = 3,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = DtypeChoice.auto,
    offline: OfflineOpt = False,
    revision: RevisionOpt = None,
    threads: ThreadsOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Write the summary as one JSON document on stdout.")] = False,
) -> None:
    """Quantize a target's weights (int8/int4 with torchao, 8/4-bit with bitsandbytes) and save it.

    The saved folder loads directly: `dflash run --target OUT`.

    --report decodes the same prompts with both pairs and compares speed, tau and output.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from runtime.quantize.job import QuantizeRequest, quantize_pair

    console = Console(stderr=True, highlight=False)
    if quantize_drafter is None:
        quantize_drafter = drafter is not None and drafter.lower() != "none"
    session = session_options(model, target, drafter, device, dtype, offline, revision, threads=threads)
    req = QuantizeRequest(
        scheme=scheme.value,
        out=out,
        ref=session.ref,
        runtime=session.runtime,
        load=session.load,
        quantize_drafter=quantize_drafter,
        force=force,
        report=report,
        report_tokens=report_tokens,
        report_prompts=report_prompts,
    )

    quiet_transformers()
    bar: Progress | None = None  # shown while layers are quantized (the slow part on big models)

    def status(message: str) -> None:
        console.print(message, style="dim", soft_wrap=True, markup=False)

    def layers(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = Progress(
                TextColumn("quantizing layers"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=True,
                disable=not console.is_terminal,
            )
            bar.add_task("layers", total=total)
            bar.start()
        bar.update(bar.task_ids[0], completed=done)
        if done >= total:
            bar.stop()

    try:
        result = quantize_pair(req, status=status, layers=layers)
    finally:
        if bar is not None:
            bar.stop()
    render_summary(result, console)
    if result.reload_max_diff != 0.0:
        console.print(
            "warning: the reloaded folder's logits differ from the quantized model by up to "
            f"{result.reload_max_diff:.3g}",
            style="yellow",
            soft_wrap=True,
        )
    if result.drafter_out is not None:
        pair_note = f" (drafter: the quantized {result.drafter_out})"
    elif result.drafter is not None:
        pair_note = f" (drafter: {result.drafter}, unquantized)"
    else:
        pair_note = " --decoder ar (no drafter)"
    console.print(
        f"saved {result.out}; run it with: dflash run --target {result.out}{pair_note}", soft_wrap=True, markup=False
    )
    if json_out:
        sys.stdout.write(json.dumps(result.to_json()) + "\n")
    else:
        sys.stdout.write(f"{result.out}\n")
    sys.stdout.flush()
