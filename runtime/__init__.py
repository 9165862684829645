"""dflash runtime: the DFlash speculative-decoding engine.

The runtime knows nothing about terminals, colours or command lines: it never imports typer,
click, rich or textual (a test enforces this). The CLI and the TUI build a ``SessionOptions``, call
``open_backend`` (a local ``Pipeline`` or a remote server, both ``Backend``s) and consume the typed
events of ``Backend.stream``:

    PrefillDone -> BlockVerified* -> Finished

Every committed token appears once, with its origin (ACCEPTED draft or TARGET token).
Configuration arrives as frozen dataclasses; nothing here reads environment variables.
"""

from __future__ import annotations

from runtime.backend import Backend, Capabilities
from runtime.config import DecodeOptions, DFlashConfig, RuntimeConfig, SamplingParams
from runtime.engine import CancelToken, Decoder, SpeculativeDecoder, chain_decoder, plain_decoder, tree_decoder
from runtime.engine.events import (
    BlockVerified,
    DecodeEvent,
    Finished,
    GenerationStats,
    PrefillDone,
    TokenEvent,
    TokenStatus,
    event_to_json,
)
from runtime.errors import (
    ConfigError,
    DFlashError,
    EmbeddedModelMissingError,
    IncompatibleDraftError,
    InputError,
    ModelLoadError,
    ModelNotFoundError,
    OutOfMemoryError,
    UnsupportedModelError,
)
from runtime.pipeline import LoadOptions, ModelRef, Pipeline, load_pipeline
from runtime.session import SessionOptions, open_backend

__all__ = [
    "Backend",
    "BlockVerified",
    "CancelToken",
    "Capabilities",
    "ConfigError",
    "DFlashConfig",
    "SpeculativeDecoder",
    "chain_decoder",
    "plain_decoder",
    "tree_decoder",
    "DFlashError",
    "DecodeEvent",
    "DecodeOptions",
    "Decoder",
    "EmbeddedModelMissingError",
    "Finished",
    "GenerationStats",
    "IncompatibleDraftError",
    "InputError",
    "LoadOptions",
    "ModelLoadError",
    "ModelNotFoundError",
    "ModelRef",
    "OutOfMemoryError",
    "Pipeline",
    "PrefillDone",
    "RuntimeConfig",
    "SamplingParams",
    "SessionOptions",
    "TokenEvent",
    "TokenStatus",
    "UnsupportedModelError",
    "event_to_json",
    "load_pipeline",
    "open_backend",
]
