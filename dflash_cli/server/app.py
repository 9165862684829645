"""The ASGI app of ``dflash serve`` (Starlette): OpenAI-compatible endpoints over a runtime
``Backend``, one generation at a time through ``GenerationQueue``.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or
server-sent events with ``stream: true``), ``GET /metrics`` (Prometheus), ``GET /health``.
Every failure is answered as an OpenAI-style error object; nothing a client sends stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import sys
import time
import traceback
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pydantic_core
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from runtime import CancelToken, DecodeOptions, DFlashError, InputError, OutOfMemoryError
from runtime.backend import Backend
from runtime.engine.events import DecodeEvent, Finished, GenerationStats, PrefillDone, event_to_json

from . import protocol as P
from .memory import TRIM_AFTER_BYTES, release_free_memory
from .metrics import CONTENT_TYPE, ServerMetrics
from .queue import GenerationQueue, Job, QueueFullError


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


def _error(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _runtime_error(e: Exception) -> P.APIError:
    if isinstance(e, InputError):
        code = "context_length_exceeded" if "context" in str(e) else "invalid_prompt"
        return P.APIError(400, str(e), code=code)
    if isinstance(e, OutOfMemoryError):
        return P.APIError(503, str(e), type="server_error", code="out_of_memory")
    if isinstance(e, DFlashError):
        return P.APIError(
            400 if e.exit_code == 2 else 500,
            str(e),
            type="server_error" if e.exit_code != 2 else "invalid_request_error",
        )
    return P.APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error", code="internal_error")


class DFlashServer:
    """Routes and state of one server."""

    def __init__(self, backend: Backend, config: ServeConfig) -> None:
        block = getattr(backend, "block_size", None)
        if config.limits.max_block_size is None and isinstance(block, int) and block > 1:
            # per-request block sizes up to the drafter's trained block: larger ones cost quadratic drafter time
            config = replace(config, limits=replace(config.limits, max_block_size=block))
        self.backend = backend
        self.config = config
        self.metrics = ServerMetrics()
        self.queue: GenerationQueue | None = None
        self.created = P.now()

    # -- lifecycle -------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        self.queue = GenerationQueue(self.config.max_queue, self.metrics.queue_changed, self.metrics.skipped)
        try:
            yield
        finally:  # off the event loop: a running step may take a moment to notice its cancellation
            await asyncio.get_running_loop().run_in_executor(None, self.queue.close)

    def cancel_all(self) -> None:
        """Cancel the running and waiting generations (the server is shutting down)."""
        if self.queue is not None:
            self.queue.cancel_all()

    def app(self) -> Starlette:
        """The Starlette app."""
        routes = [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        return Starlette(
            routes=routes,
            lifespan=self.lifespan,
            middleware=[Middleware(_Contain, server=self)],
            exception_handlers={HTTPException: self._http_exception},
        )

    async def _http_exception(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        status = exc.status_code
        message = f"{request.method} {request.url.path} is not an endpoint of dflash serve"
        if status == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        kind = "not_found" if status == 404 else "method_not_allowed" if status == 405 else None
        self.metrics.request("other", status)
        return _error(P.APIError(status, message if status in (404, 405) else str(exc.detail), code=kind))

    def _auth(self, request: Request) -> None:
        key = self.config.api_key
        if not key:
            return
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise P.APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)", code="invalid_api_key")

    # -- simple endpoints ------------------------------------------------------------------
    def _model_card(self, name: str) -> dict[str, Any]:
        details = {k: v for k, v in self.backend.describe().items() if not k.endswith("_dir")}
        for key in ("target", "drafter"):  # names only: a local folder is shown by its name, never its path
            value = details.get(key)
            if isinstance(value, str):
                details[key] = _public_name(value)
        caps = self.backend.capabilities
        details["chat_template"] = caps.chat_template
        details["tokenizer"] = caps.tokenizer  # False: token ids, no text
        return {"id": name, "object": "model", "created": self.created, "owned_by": "dflash", "dflash": details}

    async def models(self, request: Request) -> Response:
        try:
            self._auth(request)
        except P.APIError as e:
            self.metrics.request("models", e.status)
            return _error(e)
        self.metrics.request("models", 200)
        return JSONResponse({"object": "list", "data": [self._model_card(n) for n in self.config.model_names]})

    async def model(self, request: Request) -> Response:
        try:
            self._auth(request)
            name = request.path_params["model_id"]
            if name not in self.config.model_names:
                raise P.APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        except P.APIError as e:
            self.metrics.request("models", e.status)
            return _error(e)
        self.metrics.request("models", 200)
        return JSONResponse(self._model_card(name))

    async def prometheus(self, _request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def health(self, _request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    # -- generation ------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

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

    def _start(self, req: P.ParsedRequest) -> Any:
        backend, metrics = self.backend, self.metrics
        queued = time.time()

        def start(cancel: CancelToken) -> Iterator[DecodeEvent]:
            wait = time.time() - queued
            for event in events(cancel):
                if isinstance(event, Finished):  # counted here, also when nobody reads it (client gone)
                    metrics.generation(event.reason, event.stats, wait)
                yield event

        def events(cancel: CancelToken) -> Iterator[DecodeEvent]:
            if req.kind == "chat":
                return backend.stream_messages(list(req.messages), req.params, req.opts, cancel)
            if req.prompt_ids is not None:
                return backend.stream_ids(list(req.prompt_ids), req.params, req.opts, cancel)
            assert req.prompt is not None
            return backend.stream(req.prompt, req.params, req.opts, cancel, chat=False)

        return start

    async def _generate(self, request: Request, kind: str) -> Response:
        try:
            return await self._answer(request, kind)
        finally:
            if getattr(request.state, "body_bytes", 0) >= TRIM_AFTER_BYTES:
                # its prompt's tokenization freed hundreds of MB that malloc would keep: give them back
                await asyncio.get_running_loop().run_in_executor(None, release_free_memory)

    async def _answer(self, request: Request, kind: str) -> Response:
        endpoint = "chat" if kind == "chat" else "completions"
        try:
            self._auth(request)
            body = await self._read_json(request)
            req = P.parse_request(body, kind, self.config.model_names, self.config.limits, self.config.decode)
            assert self.queue is not None
            try:
                job = self.queue.submit(self._start(req), asyncio.get_running_loop())
            except QueueFullError as e:
                raise P.APIError(
                    503, f"the server is busy ({e}); retry later", type="server_error", code="server_busy"
                ) from None
        except P.APIError as e:
            self.metrics.request(endpoint, e.status)
            return _error(e)
        except ClientDisconnect:
            return Response(status_code=499)
        # Wait for the first event: a bad prompt is still answered with a proper status code.
        events = job.events()
        watcher = asyncio.ensure_future(_cancel_on_disconnect(request, job))
        try:
            first = await events.__anext__()
        except StopAsyncIteration:
            watcher.cancel()
            self.metrics.request(endpoint, 499)
            return Response(status_code=499)  # cancelled before it started: the client is gone
        except Exception as e:  # noqa: BLE001
            watcher.cancel()
            err = _runtime_error(e)
            if err.status >= 500 and self.config.debug:
                traceback.print_exception(e, file=sys.stderr)
            self.metrics.request(endpoint, err.status)
            return _error(err)
        if req.stream:
            watcher.cancel()  # StreamingResponse notices disconnects itself
            self.metrics.request(endpoint, 200)
            sse = self._sse(req, job, first, events)
            return StreamingResponse(sse, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            return await self._complete(req, job, first, events, endpoint)
        finally:
            watcher.cancel()

    async def _complete(
        self, req: P.ParsedRequest, job: Job, first: DecodeEvent, events: AsyncIterator[DecodeEvent], endpoint: str
    ) -> Response:
        rid, created = P.new_id(req.kind), P.now()
        text: list[str] = []
        done: Finished | None = None
        event = first
        try:
            while True:
                if isinstance(event, Finished):
                    done = event
                else:
                    text.append(event.text)
                try:
                    event = await events.__anext__()
                except StopAsyncIteration:
                    break
        except Exception as e:  # noqa: BLE001
            err = _runtime_error(e)
            self.metrics.request(endpoint, err.status)
            return _error(err)
        if done is None:
            self.metrics.request(endpoint, 499)
            return Response(status_code=499)
        self.metrics.request(endpoint, 200)
        body = P.response(req, rid, created, "".join(text), done.reason, done.stats, job.timing())
        return JSONResponse(body)

    async def _sse(
        self, req: P.ParsedRequest, job: Job, first: DecodeEvent, events: AsyncIterator[DecodeEvent]
    ) -> AsyncIterator[str]:
        rid, created = P.new_id(req.kind), P.now()
        stats: GenerationStats | None = None

        def line(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        event: DecodeEvent | None = first
        try:
            while event is not None:
                if isinstance(event, Finished):
                    stats = event.stats
                    ext = {**event_to_json(event), "queue": job.timing()}
                    yield line(P.chunk(req, rid, created, None, P.FINISH.get(event.reason, "stop"), ext))
                else:
                    role = isinstance(event, PrefillDone)
                    yield line(P.chunk(req, rid, created, event.text, None, event_to_json(event), role=role))
                try:
                    event = await events.__anext__()
                except StopAsyncIteration:
                    event = None
        except asyncio.CancelledError:
            job.cancel.cancel()  # the client went away: free the generation slot
            raise
        except Exception as e:  # noqa: BLE001 - reported in-band: the status line is already sent
            err = _runtime_error(e)
            if self.config.debug:
                traceback.print_exception(e, file=sys.stderr)
            yield line(err.body())
        finally:
            job.cancel.cancel()
        if stats is not None and req.include_usage:
            yield line(P.usage_chunk(req, rid, created, stats))
        yield "data: [DONE]\n\n"


ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/models": "models"}


class _Contain:
    """Any exception a handler lets through becomes an OpenAI-style 500, counted in /metrics; its
    traceback is printed only with DFLASH_DEBUG (Starlette's own handler would re-raise it into the log)."""

    def __init__(self, app: Any, server: DFlashServer) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sender(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sender)
        except Exception as exc:  # noqa: BLE001 - the server must keep serving
            if self.server.config.debug:
                traceback.print_exception(exc, file=sys.stderr)
            err = _runtime_error(exc)
            self.server.metrics.request(ENDPOINTS.get(scope.get("path", ""), "other"), err.status)
            if not started:
                await _error(err)(scope, receive, send)


def _public_name(name: str) -> str:
    """A model name without local paths: a folder's last component, a Hub id as it is."""
    p = Path(name).expanduser()
    if p.is_absolute() or name.startswith((".", "~")) or p.exists():
        return p.name or name
    return name


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client disconnects (non-streamed requests wait silently)."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                job.cancel.cancel()
                return
    except (asyncio.CancelledError, RuntimeError):
        return


def create_app(backend: Backend, config: ServeConfig) -> Starlette:
    """Build the ASGI app for a backend (a loaded ``Pipeline`` in ``dflash serve``)."""
    return DFlashServer(backend, config).app()
