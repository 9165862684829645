"""llama.cpp's routes on ``dflash serve``: ``POST /infill`` and ``POST /completion`` (wire format in
``llama``), JSON, a JSON array for ``n_cmpl`` > 1, or server-sent events."""

from __future__ import annotations

import asyncio
import json
import sys
import traceback
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from runtime.engine.events import DecodeEvent, Finished

from . import editors as E
from . import llama as L
from . import protocol as P
from .editor_routes import Begun, EditorRoutes, event_prompt
from .errors import runtime_error


class LlamaRoutes(EditorRoutes):
    """``/infill`` and ``/completion``."""

    def _eos_ids(self) -> tuple[int, ...]:
        ids = getattr(self.backend, "stop_token_ids", ())
        return tuple(ids) if isinstance(ids, (tuple, list)) else ()

    def _llama_error(self, endpoint: str, e: P.APIError) -> JSONResponse:
        self.metrics.request(endpoint, e.status)
        return JSONResponse(L.llama_error(e), status_code=e.status)

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
            job = L.parse_llama(body, kind, cfg.model_names, cfg.limits, cfg.decode, self._tokenizer, self._target_name)
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
                return self._llama_error(endpoint, runtime_error(e))
            if done is None:
                self.metrics.request(endpoint, 499)
                return Response(status_code=499)
            stop = L.stop_type(job, begun[1], done, ids[-1] if ids else None, self._eos_ids())
            result = L.llama_result(job, i, text, ids, done.stats, stop)
            results.append(L.select_fields(result, job.response_fields))
        self.metrics.request(endpoint, 200)
        return JSONResponse(results[0] if job.n_cmpl == 1 else results)

    async def _llama_sse(self, job: E.EditorJob, begun: Begun) -> AsyncIterator[str]:
        queued, watch, first, events = begun

        def line(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        sent, text, predicted = 0, "", 0
        ids: list[int] = []
        event: DecodeEvent | None = first
        try:
            while event is not None:
                if isinstance(event, Finished):
                    stop = L.stop_type(job, watch, event, ids[-1] if ids else None, self._eos_ids())
                    result = L.llama_result(job, 0, text, ids, event.stats, stop, streamed=True)
                    yield line(L.select_fields(result, job.response_fields))
                elif not job.warm_only:
                    text += event.text
                    new = [t.token_id for t in event.tokens]
                    ids += new
                    predicted += len(new)
                    end = len(text) if watch.cut is None else min(watch.cut, len(text))
                    if end > sent or new:
                        piece, sent = text[sent:end], max(sent, end)
                        yield line(L.llama_chunk(job, piece, new, predicted, event_prompt(event)))
                try:
                    event = await events.__anext__()
                except StopAsyncIteration:
                    event = None
        except asyncio.CancelledError:
            queued.cancel.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - reported in-band: the status line is already sent
            err = runtime_error(e)
            if self.config.debug:
                traceback.print_exception(e, file=sys.stderr)
            yield f"error: {json.dumps(L.llama_error(err), ensure_ascii=False)}\n\n"
        finally:
            queued.cancel.cancel()
