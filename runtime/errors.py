"""User-facing errors of the runtime.

Every error carries a one-line message that names the offending value and the fix. The CLI maps
each class to a documented exit code (see ``EXIT_CODES`` and the README); nothing in the runtime
prints or exits.
"""

from __future__ import annotations


class DFlashError(Exception):
    """Base class of every error the runtime raises on purpose."""

    exit_code = 1


class ConfigError(DFlashError, ValueError):
    """A configuration value is out of range or inconsistent."""

    exit_code = 2


class InputError(DFlashError, ValueError):
    """The prompt or request cannot be served (empty, too long for the context, ...)."""

    exit_code = 2


class ModelNotFoundError(DFlashError):
    """A model id, preset or folder cannot be found (locally, in the cache or on the Hub)."""

    exit_code = 3


class ModelLoadError(DFlashError):
    """A model was found but its files are unusable (corrupt, truncated, unsupported layout)."""

    exit_code = 4


class UnsupportedModelError(ModelLoadError):
    """The target architecture does not expose what DFlash needs (embedding, head, layers)."""


class IncompatibleDraftError(DFlashError):
    """The drafter was not built for this target (vocab, hidden size, layer ids, mask id)."""

    exit_code = 5


class OutOfMemoryError(DFlashError):
    """The device ran out of memory; the message says what to try."""

    exit_code = 6


class EmbeddedModelMissingError(ModelNotFoundError):
    """The embedded default target has not been installed yet."""


EXIT_CODES: dict[str, int] = {
    "ok": 0,
    "error": DFlashError.exit_code,
    "usage/config/input": ConfigError.exit_code,
    "model not found": ModelNotFoundError.exit_code,
    "model load failed": ModelLoadError.exit_code,
    "incompatible drafter": IncompatibleDraftError.exit_code,
    "out of memory": OutOfMemoryError.exit_code,
    "interrupted (Ctrl-C)": 130,
}
