"""The ASGI app of ``dflash serve`` (Starlette): OpenAI-compatible endpoints over a runtime
``Backend``, one generation at a time through ``GenerationQueue``.

Endpoints: ``GET /v1/models``, ``POST /v1/completions`` (``suffix``: fill in the middle),
``POST /v1/chat/completions`` (JSON or server-sent events with ``stream: true``), ``GET /metrics``
(Prometheus), ``GET /health``; on the same port, what editor plugins speak (``editors``):
llama.cpp's ``POST /infill`` and ``POST /completion``, Ollama's ``POST /api/generate``,
``POST /api/show``, ``GET /api/tags`` and ``GET /api/version``.
Every failure is answered as an error object of the endpoint's own format; nothing a client sends
stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
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

from runtime import CancelToken, DecodeOptions, DFlashError, InputError, OutOfMemoryError, fim
from runtime.backend import Backend
from runtime.engine.events import DecodeEvent, Finished, GenerationStats, PrefillDone, event_to_json

from . import editors as E
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
            # editor plugins (docs/serve-editors.md)
            Route("/infill", self.infill, methods=["POST"]),
            Route("/completion", self.llama_completion, methods=["POST"]),
            Route("/api/generate", self.ollama_generate, methods=["POST"]),
            Route("/api/show", self.ollama_show, methods=["POST"]),
            Route("/api/tags", self.ollama_tags, methods=["GET"]),
            Route("/api/version", self.ollama_version, methods=["GET"]),
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
            if req.suffix is not None:  # fill in the middle: the prompt is the prefix
                built = E.fim_prompt(self._tokenizer, self._target_name, req.prompt or "", req.suffix, "suffix")
                req = replace(req, prompt=None, prompt_ids=tuple(built.ids), suffix=None)
                req = replace(req, params=E.with_stop_ids(req.params, built.stop_ids))
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

    # -- editor plugins: llama.cpp and Ollama wire formats (editors.py) ---------------------------
    @property
    def _tokenizer(self) -> Any:
        """The target's tokenizer where the backend has one (a local pipeline), else None."""
        return getattr(self.backend, "tokenizer", None)

    @property
    def _target_name(self) -> str:
        name = self.backend.describe().get("target")
        return _public_name(name) if isinstance(name, str) else self.config.model_names[0]

    def _editor_start(self, job: E.EditorJob, watch: E.Watch, seed: int) -> Any:
        backend, metrics = self.backend, self.metrics
        params = replace(job.params, seed=seed)
        queued = time.time()

        def start(cancel: CancelToken) -> Iterator[DecodeEvent]:
            wait = time.time() - queued
            if job.prompt_ids is not None:
                events = backend.stream_ids(list(job.prompt_ids), params, job.opts, cancel)
            else:
                assert job.prompt is not None
                events = backend.stream(job.prompt, params, job.opts, cancel, chat=job.chat, system=job.system)
            for event in watch.events(events, cancel):
                if isinstance(event, Finished):
                    metrics.generation(event.reason, event.stats, wait)
                yield event

        return start

    async def _editor_begin(
        self, request: Request, job: E.EditorJob, endpoint: str, seed: int
    ) -> tuple[Job, E.Watch, DecodeEvent, AsyncIterator[DecodeEvent]] | P.APIError | None:
        """Queue one generation and wait for its first event (a bad prompt still gets its status);
        None: the client left before it started."""
        assert self.queue is not None
        watch = E.Watch(job.t_max_predict_ms, job.n_indent)
        try:
            queued = self.queue.submit(self._editor_start(job, watch, seed), asyncio.get_running_loop(), job.supersede)
        except QueueFullError as e:
            return P.APIError(503, f"the server is busy ({e}); retry later", type="server_error", code="server_busy")
        events = queued.events()
        watcher = asyncio.ensure_future(_cancel_on_disconnect(request, queued))
        try:
            first = await events.__anext__()
        except StopAsyncIteration:
            return None
        except Exception as e:  # noqa: BLE001
            err = _runtime_error(e)
            if err.status >= 500 and self.config.debug:
                traceback.print_exception(e, file=sys.stderr)
            return err
        finally:
            watcher.cancel()
        return queued, watch, first, events

    async def _editor_collect(
        self, request: Request, begun: tuple[Job, E.Watch, DecodeEvent, AsyncIterator[DecodeEvent]]
    ) -> tuple[str, list[int], Finished | None]:
        """Read a generation to its end: (text, committed ids, the Finished event or None)."""
        queued, watch, event, events = begun
        text: list[str] = []
        ids: list[int] = []
        done: Finished | None = None
        watcher = asyncio.ensure_future(_cancel_on_disconnect(request, queued))
        try:
            while True:
                if isinstance(event, Finished):
                    done = event
                else:
                    text.append(event.text)
                    ids.extend(t.token_id for t in event.tokens)
                try:
                    event = await events.__anext__()
                except StopAsyncIteration:
                    break
        finally:
            watcher.cancel()
        out = "".join(text)
        return (out[: watch.cut] if watch.cut is not None else out), ids, done

    def _eos_ids(self) -> tuple[int, ...]:
        ids = getattr(self.backend, "stop_token_ids", ())
        return tuple(ids) if isinstance(ids, (tuple, list)) else ()

    def _llama_error(self, endpoint: str, e: P.APIError) -> JSONResponse:
        self.metrics.request(endpoint, e.status)
        return JSONResponse(E.llama_error(e), status_code=e.status)

    async def infill(self, request: Request) -> Response:
        return await self._llama(request, "infill")

    async def llama_completion(self, request: Request) -> Response:
        return await self._llama(request, "completion")

    async def _llama(self, request: Request, kind: str) -> Response:
        endpoint = kind
        try:
            self._auth(request)
            body = await self._read_json(request)
            cfg = self.config
            job = E.parse_llama(
                body, kind, cfg.model_names, cfg.limits, cfg.decode, self._tokenizer, self._target_name
            )
        except P.APIError as e:
            return self._llama_error(endpoint, e)
        except ClientDisconnect:
            return Response(status_code=499)
        results: list[dict[str, Any]] = []
        for i in range(job.n_cmpl):
            begun = await self._editor_begin(request, job, endpoint, job.params.seed + i)
            if begun is None:
                self.metrics.request(endpoint, 499)
                return Response(status_code=499)
            if isinstance(begun, P.APIError):
                return self._llama_error(endpoint, begun)
            if job.stream:
                self.metrics.request(endpoint, 200)
                sse = self._llama_sse(job, begun)
                return StreamingResponse(sse, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            try:
                text, ids, done = await self._editor_collect(request, begun)
            except Exception as e:  # noqa: BLE001
                return self._llama_error(endpoint, _runtime_error(e))
            if done is None:
                self.metrics.request(endpoint, 499)
                return Response(status_code=499)
            stop = E.stop_type(job, begun[1], done, ids[-1] if ids else None, self._eos_ids())
            result = E.llama_result(job, i, text, ids, done.stats, stop)
            results.append(E.select_fields(result, job.response_fields))
        self.metrics.request(endpoint, 200)
        return JSONResponse(results[0] if job.n_cmpl == 1 else results)

    async def _llama_sse(
        self, job: E.EditorJob, begun: tuple[Job, E.Watch, DecodeEvent, AsyncIterator[DecodeEvent]]
    ) -> AsyncIterator[str]:
        queued, watch, first, events = begun

        def line(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        sent, text, predicted = 0, "", 0
        ids: list[int] = []
        event: DecodeEvent | None = first
        try:
            while event is not None:
                if isinstance(event, Finished):
                    stop = E.stop_type(job, watch, event, ids[-1] if ids else None, self._eos_ids())
                    result = E.llama_result(job, 0, text, ids, event.stats, stop, streamed=True)
                    yield line(E.select_fields(result, job.response_fields))
                elif not job.warm_only:
                    text += event.text
                    new = [t.token_id for t in event.tokens]
                    ids += new
                    predicted += len(new)
                    end = len(text) if watch.cut is None else min(watch.cut, len(text))
                    if end > sent or new:
                        piece, sent = text[sent:end], max(sent, end)
                        yield line(E.llama_chunk(job, piece, new, predicted, event_prompt(event)))
                try:
                    event = await events.__anext__()
                except StopAsyncIteration:
                    event = None
        except asyncio.CancelledError:
            queued.cancel.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - reported in-band: the status line is already sent
            err = _runtime_error(e)
            if self.config.debug:
                traceback.print_exception(e, file=sys.stderr)
            yield f"error: {json.dumps(E.llama_error(err), ensure_ascii=False)}\n\n"
        finally:
            queued.cancel.cancel()

    # Ollama
    def _ollama_error(self, e: P.APIError) -> JSONResponse:
        self.metrics.request("ollama", e.status)
        return JSONResponse({"error": e.message}, status_code=e.status)

    async def ollama_generate(self, request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            self._auth(request)
            body = await self._read_json(request)
            cfg = self.config
            job = E.parse_ollama(body, cfg.model_names, cfg.limits, cfg.decode, self._tokenizer, self._target_name)
            if job is None:  # no prompt: Ollama only loads the model
                model = E.resolve_model(body.get("model"), cfg.model_names, ollama=True)
                self.metrics.request("ollama", 200)
                return JSONResponse(E.ollama_final(model, "", "load", None, time.perf_counter() - t0))
        except P.APIError as e:
            return self._ollama_error(e)
        except ClientDisconnect:
            return Response(status_code=499)
        begun = await self._editor_begin(request, job, "ollama", job.params.seed)
        if begun is None:
            self.metrics.request("ollama", 499)
            return Response(status_code=499)
        if isinstance(begun, P.APIError):
            return self._ollama_error(begun)
        if job.stream:
            self.metrics.request("ollama", 200)
            return StreamingResponse(self._ollama_lines(job, begun, t0), media_type="application/x-ndjson")
        try:
            text, _ids, done = await self._editor_collect(request, begun)
        except Exception as e:  # noqa: BLE001
            return self._ollama_error(_runtime_error(e))
        if done is None:
            self.metrics.request("ollama", 499)
            return Response(status_code=499)
        self.metrics.request("ollama", 200)
        reason = "length" if done.reason == "length" else "stop"
        out = E.ollama_final(job.model, "" if job.warm_only else text, reason, done.stats, time.perf_counter() - t0)
        return JSONResponse(out)

    async def _ollama_lines(
        self, job: E.EditorJob, begun: tuple[Job, E.Watch, DecodeEvent, AsyncIterator[DecodeEvent]], t0: float
    ) -> AsyncIterator[str]:
        queued, _watch, first, events = begun

        def line(obj: dict[str, Any]) -> str:
            return json.dumps(obj, ensure_ascii=False) + "\n"

        event: DecodeEvent | None = first
        try:
            while event is not None:
                if isinstance(event, Finished):
                    reason = "length" if event.reason == "length" else "stop"
                    yield line(E.ollama_final(job.model, "", reason, event.stats, time.perf_counter() - t0))
                elif event.text and not job.warm_only:
                    yield line(E.ollama_chunk(job.model, event.text))
                try:
                    event = await events.__anext__()
                except StopAsyncIteration:
                    event = None
        except asyncio.CancelledError:
            queued.cancel.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - reported in-band
            yield line({"error": _runtime_error(e).message})
        finally:
            queued.cancel.cancel()

    def _ollama_model(self, name: str) -> dict[str, Any]:
        describe = self.backend.describe()
        dtype = describe.get("quantization") or describe.get("dtype")
        return {
            "name": name,
            "model": name,
            "modified_at": E.iso_now(),
            "size": 0,
            "digest": hashlib.sha256(name.encode()).hexdigest(),
            "details": E.ollama_details(self._architecture(), str(dtype) if dtype else None),
        }

    def _architecture(self) -> str | None:
        config = getattr(getattr(self.backend, "target", None), "config", None)
        arch = getattr(config, "model_type", None)
        return arch if isinstance(arch, str) else None

    async def ollama_show(self, request: Request) -> Response:
        try:
            self._auth(request)
            body = await self._read_json(request)
            if not isinstance(body, dict):
                raise P.bad("the request body must be a JSON object")
            name = body.get("model") or body.get("name")
            model = E.resolve_model(name if isinstance(name, str) else None, self.config.model_names, ollama=True)
        except P.APIError as e:
            return self._ollama_error(e)
        fmt = fim.detect(self._tokenizer)
        config = getattr(getattr(self.backend, "target", None), "config", None)
        ctx = getattr(config, "max_position_embeddings", None)
        arch = self._architecture() or "dflash"
        info: dict[str, Any] = {"general.architecture": arch}
        if isinstance(ctx, int):
            info[f"{arch}.context_length"] = ctx
        card = self._ollama_model(model)
        self.metrics.request("ollama", 200)
        return JSONResponse(
            {
                "modelfile": f"# served by dflash serve\nFROM {model}\n",
                "parameters": f"num_ctx {ctx}" if isinstance(ctx, int) else "",
                "template": fim.ollama_template(fmt),
                "details": card["details"],
                "model_info": info,
                "capabilities": ["completion", "insert"] if fmt is not None else ["completion"],
                "modified_at": card["modified_at"],
            }
        )

    async def ollama_tags(self, request: Request) -> Response:
        try:
            self._auth(request)
        except P.APIError as e:
            return self._ollama_error(e)
        self.metrics.request("ollama", 200)
        return JSONResponse({"models": [self._ollama_model(n) for n in self.config.model_names]})

    async def ollama_version(self, _request: Request) -> Response:
        return JSONResponse({"version": E.OLLAMA_API_VERSION})


def event_prompt(event: DecodeEvent) -> int:
    """Prompt tokens, known from the first event of a generation (0 after it)."""
    return event.prompt_tokens if isinstance(event, PrefillDone) else 0
ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/models": "models",
    "/infill": "infill",
    "/completion": "completion",
    "/api/generate": "ollama",
    "/api/show": "ollama",
    "/api/tags": "ollama",
}


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
