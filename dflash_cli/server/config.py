"""How ``dflash serve`` serves: ``ServeConfig``, filled by the CLI from its options."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime import DecodeOptions

from . import protocol as P


@dataclass(frozen=True)
class ServeConfig:
    """How the app serves.

    Attributes:
        model_names: ids clients may ask for; the first is listed first and is the default.
        limits: per-request limits.
        max_queue: requests allowed to wait behind the running generation.
        api_key: required as ``Authorization: Bearer`` on /v1 when set.
        decode: decoder options used when a request does not say.
        debug: print tracebacks of internal errors.
    """

    model_names: tuple[str, ...]
    limits: P.Limits = field(default_factory=P.Limits)
    max_queue: int = 16
    api_key: str | None = None
    decode: DecodeOptions = field(default_factory=DecodeOptions)
    debug: bool = False
