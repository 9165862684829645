"""The `dflash` command: thin Typer commands over the runtime (heavy imports stay lazy)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from .commands.bench import bench_app
from .commands.chat import chat
from .commands.doctor import doctor
from .commands.download import download
from .commands.models import models_app
from .commands.quantize import quantize
from .commands.run import run
from .commands.serve import serve
from .commands.setup import setup
from .commands.train import train

app = typer.Typer(
    name="dflash",
    help="Fast local code completion with DFlash block-diffusion speculative decoding.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            from runtime.config import DISTRIBUTION

            v = version(DISTRIBUTION)
        except PackageNotFoundError:
            v = "0.1.0 (source tree)"
        typer.echo(f"dflash {v}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = False,
) -> None:
    """Fast local code completion with DFlash speculative decoding."""


app.command("run")(run)
app.command("setup")(setup)
app.command("train")(train)
app.command("download")(download)
app.add_typer(models_app, name="models")
app.command("doctor")(doctor)
app.command("chat")(chat)
app.add_typer(bench_app, name="bench")
app.command("quantize")(quantize)
app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(serve)


def quiet_libraries() -> None:
    """Keep transformers' and huggingface_hub's chatter off stderr (errors still surface)."""
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    """Console-script entry point."""
    from .errors import error_line
    from .streams import OutputError, finish_stdout, guard_std_streams

    guard_std_streams()  # closed stdin/stdout/stderr and unwritable stdout: one line and exit 2, not a crash
    quiet_libraries()
    code: int | str | None = 0
    try:
        app()  # standalone mode: ends with SystemExit
    except SystemExit as e:
        code = e.code
    except OutputError as e:  # outside a command (e.g. --help with stdout closed)
        error_line(str(e))
        code = e.exit_code
    try:
        finish_stdout()  # what is still buffered: a full disk shows here, after the command returned
    except OutputError as e:
        if code in (0, None):
            error_line(str(e))
            code = e.exit_code
    sys.exit(code)
