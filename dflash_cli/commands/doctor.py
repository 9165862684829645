"""`dflash doctor`: check device, dtype, memory and a pair's files and compatibility, with fixes.

Nothing is loaded, downloaded or converted (except with --speed, which loads the pair to measure). The report goes to stdout (or JSON with --json);
the exit code is that of the first failed check (0 when everything can run).
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from ..common import (
    DeviceOpt,
    DrafterOpt,
    DtypeChoice,
    DtypeOpt,
    ModelOpt,
    QuantizeOpt,
    RevisionOpt,
    TargetOpt,
    console,
    session_options,
    state_dir,
)
from ..errors import handle_errors

_MARK = {"ok": "✓", "warn": "!", "fail": "✗", "info": "·"}
_STYLE = {"ok": "green", "warn": "yellow", "fail": "red", "info": "dim"}


@handle_errors
def doctor(
    model: ModelOpt = None,
    target: TargetOpt = None,
    drafter: DrafterOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = DtypeChoice.auto,
    revision: RevisionOpt = None,
    quantize: QuantizeOpt = None,
    context: Annotated[
        int, typer.Option("--context", min=1, help="Tokens of context the memory check sizes both KV caches for.")
    ] = 4096,
    json_out: Annotated[bool, typer.Option("--json", help="Print the checks as JSON.")] = False,
    speed: Annotated[
        bool,
        typer.Option(
            "--speed",
            help="Load the pair and measure which precision (bf16, int8, int4) and decoder is fastest here, "
            "and which bf16 GEMM (about a minute; remembered for later `dflash doctor` runs).",
        ),
    ] = False,
) -> None:
    """Check that this machine can run a pair (the embedded one by default) and print fixes."""
    from runtime.doctor.report import exit_code
    from runtime.doctor.run import run_doctor

    opts = session_options(model, target, drafter, device, dtype, offline=True, revision=revision, quantize=quantize)
    speed_file = state_dir() / "speed.json"
    if speed and exit_code(run_doctor(opts.ref, opts.runtime, opts.load)) == 0:
        from dataclasses import replace

        from runtime.bench.probe import measure_speed, save_result
        from runtime.engine.models.bf16_choice import remeasure_bf16
        from runtime.pipeline import Pipeline
        from runtime.session import calibrate, open_pipeline

        def load_with(scheme: str | None) -> Pipeline:
            return open_pipeline(replace(opts, quantize=scheme, calibration_file=None))

        def measure_costs(pipe: Pipeline) -> None:
            if opts.calibration_file is not None:
                calibrate(pipe, opts.calibration_file)

        say = lambda m: print(m, file=sys.stderr)  # noqa: E731
        remeasure_bf16()  # the bf16 GEMM paths are timed again too (kernel-choice.json)
        save_result(measure_speed(load_with, progress=say, calibrate=measure_costs), speed_file)
    from runtime.engine.models.kernels.choice import choice_file

    checks = run_doctor(
        opts.ref, opts.runtime, opts.load, speed_file=speed_file, kernel_file=choice_file(), context=context
    )
    code = exit_code(checks)
    if json_out:
        print(json.dumps({"ok": code == 0, "exit_code": code, "checks": [c.to_json() for c in checks]}, indent=2))
    else:
        from rich.text import Text

        out = console()
        width = max(len(c.area) for c in checks)
        for c in checks:
            out.print(Text.assemble((_MARK[c.status], _STYLE[c.status]), f" {c.area.ljust(width)}  {c.message}"))
            if c.fix:
                out.print(f"  {' ' * width}  fix: {c.fix}")
        fails = sum(c.status == "fail" for c in checks)
        warns = sum(c.status == "warn" for c in checks)
        if fails:
            verdict = f"{fails} problem{'s' if fails > 1 else ''} to fix"
        else:
            verdict = "ready to run"
        if warns:
            verdict += f", {warns} warning{'s' if warns > 1 else ''}"
        print(verdict, file=sys.stderr)
    if code:
        raise typer.Exit(code=code)
