"""The OpenAI-compatible routes of ``dflash serve``: ``GET /v1/models``, ``POST /v1/completions``
(``suffix``: fill in the middle) and ``POST /v1/chat/completions``, as JSON or server-sent events."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import traceback
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from runtime import CancelToken
from runtime.engine.events import DecodeEvent, Finished, GenerationStats, PrefillDone, event_to_json

from . import editors as E
from . import protocol as P
from . import responses as R
from .errors import error_response, runtime_error
from .memory import TRIM_AFTER_BYTES, release_free_memory
from .queue import Job, QueueFullError
from .state import ServerState, cancel_on_disconnect, public_name


class OpenAIRoutes(ServerState):
    """``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``."""

    def _model_card(self, name: str) -> dict[str, Any]:
        details = {k: v for k, v in self.backend.describe().items() if not k.endswith("_dir")}
        for key in ("target", "drafter"):  # names only: a local folder is shown by its name, never its path
            value = details.get(key)
            if isinstance(value, str):
                details[key] = public_name(value)
        caps = self.backend.capabilities
        details["chat_template"] = caps.chat_template
        details["tokenizer"] = caps.tokenizer  # False: token ids, no text
        return {"id": name, "object": "model", "created": self.created, "owned_by": "dflash", "dflash": details}

    async def models(self, request: Request) -> Response:
        try:
            self._auth(request)
        except P.APIError as e:
            self.metrics.request("models", e.status)
            return error_response(e)
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
            return error_response(e)
        self.metrics.request("models", 200)
        return JSONResponse(self._model_card(name))

    # -- generation ------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

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
            return error_response(e)
        except ClientDisconnect:
            return Response(status_code=499)
        # Wait for the first event: a bad prompt is still answered with a proper status code.
        events = job.events()
        watcher = asyncio.ensure_future(cancel_on_disconnect(request, job))
        try:
            first = await events.__anext__()
        except StopAsyncIteration:
            watcher.cancel()
            self.metrics.request(endpoint, 499)
            return Response(status_code=499)  # cancelled before it started: the client is gone
        except Exception as e:  # noqa: BLE001
            watcher.cancel()
            err = runtime_error(e)
            if err.status >= 500 and self.config.debug:
                traceback.print_exception(e, file=sys.stderr)
            self.metrics.request(endpoint, err.status)
            return error_response(err)
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
        rid, created = R.new_id(req.kind), R.now()
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
            err = runtime_error(e)
            self.metrics.request(endpoint, err.status)
            return error_response(err)
        if done is None:
            self.metrics.request(endpoint, 499)
            return Response(status_code=499)
        self.metrics.request(endpoint, 200)
        body = R.response(req, rid, created, "".join(text), done.reason, done.stats, job.timing())
        return JSONResponse(body)

    async def _sse(
        self, req: P.ParsedRequest, job: Job, first: DecodeEvent, events: AsyncIterator[DecodeEvent]
    ) -> AsyncIterator[str]:
        rid, created = R.new_id(req.kind), R.now()
        stats: GenerationStats | None = None

        def line(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        event: DecodeEvent | None = first
        try:
            while event is not None:
                if isinstance(event, Finished):
                    stats = event.stats
                    ext = {**event_to_json(event), "queue": job.timing()}
                    yield line(R.chunk(req, rid, created, None, R.FINISH.get(event.reason, "stop"), ext))
                else:
                    role = isinstance(event, PrefillDone)
                    yield line(R.chunk(req, rid, created, event.text, None, event_to_json(event), role=role))
                try:
                    event = await events.__anext__()
                except StopAsyncIteration:
                    event = None
        except asyncio.CancelledError:
            job.cancel.cancel()  # the client went away: free the generation slot
            raise
        except Exception as e:  # noqa: BLE001 - reported in-band: the status line is already sent
            err = runtime_error(e)
            if self.config.debug:
                traceback.print_exception(e, file=sys.stderr)
            yield line(err.body())
        finally:
            job.cancel.cancel()
        if stats is not None and req.include_usage:
            yield line(R.usage_chunk(req, rid, created, stats))
        yield "data: [DONE]\n\n"
