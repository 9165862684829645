"""Standard streams that are closed or cannot be written (``<&-``, ``>&-``, ``> /dev/full``).

``guard_std_streams`` runs first in ``main``: a closed descriptor 0, 1 or 2 is taken by
``/dev/null`` (so no file dflash opens later lands on it and gets the output), ``sys.stdin`` stays
``None`` (``read_prompt`` says that stdin is closed when it needs it) and ``sys.stdout`` becomes a
writer that fails with ``OutputError``. An open stdout is wrapped so that a failed write (a full
disk, an I/O error) is an ``OutputError`` too. ``OutputError`` exits with code 2, one line on
stderr, like any other input/output the user pointed dflash at and that cannot be used.
A reader that went away (``BrokenPipeError``, e.g. ``| head``) is left to ``handle_errors``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from typing import Any

from runtime.errors import DFlashError


class OutputError(DFlashError):
    """stdout is closed or cannot be written."""

    exit_code = 2


def _take_fd(fd: int, flags: int) -> bool:
    """Put /dev/null on descriptor ``fd`` if it is closed; True when it was closed."""
    try:
        os.fstat(fd)
        return False
    except OSError:
        pass
    null = os.open(os.devnull, flags)
    if null != fd:
        os.dup2(null, fd)
        os.close(null)
    return True


class _ClosedOutput:
    """sys.stdout when descriptor 1 was closed at start: every write is an error."""

    encoding = "utf-8"
    errors = "strict"

    def write(self, _text: str) -> int:
        raise OutputError("stdout is closed; redirect it to a file or to /dev/null instead of closing it")

    def flush(self) -> None:
        return None

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return 1

    def writable(self) -> bool:
        return True


class _CheckedOutput:
    """Wraps sys.stdout: an OSError on write or flush (other than a closed pipe) becomes OutputError.

    Before raising it puts /dev/null on the descriptor, so that the interpreter's final flush of
    what is still buffered does not fail a second time (Python would print a traceback and exit 120).
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def _failed(self, e: OSError) -> OutputError:
        with contextlib.suppress(OSError, ValueError):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
        return OutputError(f"cannot write to stdout: {e.strerror or e}")

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except BrokenPipeError:
            raise
        except OSError as e:
            if e.errno == errno.EPIPE:
                raise
            raise self._failed(e) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            if e.errno == errno.EPIPE:
                raise
            raise self._failed(e) from None


def guard_std_streams() -> None:
    """Make closed or unwritable standard streams errors dflash reports (see the module docstring)."""
    if sys.stdin is None:
        _take_fd(0, os.O_RDONLY)
    if sys.stderr is None:  # errors go nowhere, but the exit code stays true
        _take_fd(2, os.O_WRONLY)
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    if sys.stdout is None:
        _take_fd(1, os.O_WRONLY)
        sys.stdout = _ClosedOutput()
    elif not isinstance(sys.stdout, _CheckedOutput):
        sys.stdout = _CheckedOutput(sys.stdout)


def finish_stdout() -> None:
    """Flush stdout at exit.

    Raises:
        OutputError: what is still buffered cannot be written.
    """
    if sys.stdout is not None:
        sys.stdout.flush()
