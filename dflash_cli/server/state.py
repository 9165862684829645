"""What every route of ``dflash serve`` shares: the backend, configuration, metrics and queue,
the API key check, the bounded JSON body reader, the target's tokenizer and public name, and the
watch that cancels a generation when its client disconnects."""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import replace
from pathlib import Path
from typing import Any

import pydantic_core
from starlette.requests import Request

from runtime.backend import Backend

from . import protocol as P
from .config import ServeConfig
from .metrics import ServerMetrics
from .queue import GenerationQueue, Job
from .responses import now


class ServerState:
    """Routes and state of one server: the base of each group of routes (``app.DFlashServer``)."""

    def __init__(self, backend: Backend, config: ServeConfig) -> None:
        block = getattr(backend, "block_size", None)
        if config.limits.max_block_size is None and isinstance(block, int) and block > 1:
            # per-request block sizes up to the drafter's trained block: larger ones cost quadratic drafter time
            config = replace(config, limits=replace(config.limits, max_block_size=block))
        self.backend = backend
        self.config = config
        self.metrics = ServerMetrics()
        self.queue: GenerationQueue | None = None
        self.created = now()

    def _auth(self, request: Request) -> None:
        key = self.config.api_key
        if not key:
            return
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise P.APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)", code="invalid_api_key")

    async def _read_json(self, request: Request) -> Any:
        limit = self.config.limits.max_body_bytes
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > limit:
            raise P.APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        body = bytearray()
        async for piece in request.stream():
            body += piece
            request.state.body_bytes = len(body)
            if len(body) > limit:
                raise P.APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        try:  # pydantic's parser: a depth limit (no RecursionError), strict UTF-8, no lone surrogates, no NaN
            return pydantic_core.from_json(body, allow_inf_nan=False)
        except ValueError as e:
            raise P.bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None

    @property
    def _tokenizer(self) -> Any:
        """The target's tokenizer where the backend has one (a local pipeline), else None."""
        return getattr(self.backend, "tokenizer", None)

    @property
    def _target_name(self) -> str:
        name = self.backend.describe().get("target")
        return public_name(name) if isinstance(name, str) else self.config.model_names[0]


def public_name(name: str) -> str:
    """A model name without local paths: a folder's last component, a Hub id as it is."""
    p = Path(name).expanduser()
    if p.is_absolute() or name.startswith((".", "~")) or p.exists():
        return p.name or name
    return name


async def cancel_on_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client disconnects (non-streamed requests wait silently)."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                job.cancel.cancel()
                return
    except (asyncio.CancelledError, RuntimeError):
        return
