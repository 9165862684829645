"""The one place where runtime errors become one-line messages and exit codes."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from typer.exceptions import TyperException

from .common import console, debug_enabled

F = TypeVar("F", bound=Callable[..., Any])


def error_line(message: str) -> None:
    """Print ``dflash: error: message`` on stderr (red on a terminal)."""
    console(stderr=True).print(f"dflash: error: {message}", style="red")


def handle_errors(fn: F) -> F:
    """Decorate a command: DFlashError -> one line + its exit code; Ctrl-C -> exit 130."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from runtime.errors import DFlashError

        try:
            return fn(*args, **kwargs)
        except DFlashError as e:
            if debug_enabled():
                raise
            error_line(str(e))
            raise typer.Exit(code=e.exit_code) from None
        except KeyboardInterrupt:
            try:
                sys.stdout.flush()
            except Exception:
                pass
            print("\ndflash: interrupted", file=sys.stderr, flush=True)
            raise typer.Exit(code=130) from None
        except (typer.Exit, typer.Abort, SystemExit, TyperException):
            raise  # usage errors (BadParameter...) keep click's own message and exit code 2
        except BrokenPipeError:
            # the reader went away (e.g. `dflash run ... | head`): not an error
            try:
                sys.stdout = open(os.devnull, "w")  # noqa: SIM115
            except OSError:
                pass
            raise typer.Exit(code=0) from None
        except Exception as e:
            if debug_enabled() or "PYTEST_CURRENT_TEST" in os.environ:
                raise
            error_line(f"internal error: {type(e).__name__}: {e} (set DFLASH_DEBUG=1 for the traceback)")
            raise typer.Exit(code=1) from None

    return wrapper  # type: ignore[return-value]
