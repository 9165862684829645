"""Ollama's routes on ``dflash serve``: ``POST /api/generate`` (JSON or newline-delimited JSON),
``POST /api/show``, ``GET /api/tags`` and ``GET /api/version`` (wire format in ``ollama``)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from runtime import fim
from runtime.engine.events import DecodeEvent, Finished

from . import editors as E
from . import ollama as O
from . import protocol as P
from .editor_routes import Begun, EditorRoutes
from .errors import runtime_error


class OllamaRoutes(EditorRoutes):
    """``/api/generate``, ``/api/show``, ``/api/tags`` and ``/api/version``."""

    def _ollama_error(self, e: P.APIError) -> JSONResponse:
        self.metrics.request("ollama", e.status)
        return JSONResponse({"error": e.message}, status_code=e.status)

    async def ollama_generate(self, request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            self._auth(request)
            body = await self._read_json(request)
            cfg = self.config
            job = O.parse_ollama(body, cfg.model_names, cfg.limits, cfg.decode, self._tokenizer, self._target_name)
            if job is None:  # no prompt: Ollama only loads the model
                model = E.resolve_model(body.get("model"), cfg.model_names, ollama=True)
                self.metrics.request("ollama", 200)
                return JSONResponse(O.ollama_final(model, "", "load", None, time.perf_counter() - t0))
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
            return self._ollama_error(runtime_error(e))
        if done is None:
            self.metrics.request("ollama", 499)
            return Response(status_code=499)
        self.metrics.request("ollama", 200)
        reason = "length" if done.reason == "length" else "stop"
        out = O.ollama_final(job.model, "" if job.warm_only else text, reason, done.stats, time.perf_counter() - t0)
        return JSONResponse(out)

    async def _ollama_lines(self, job: E.EditorJob, begun: Begun, t0: float) -> AsyncIterator[str]:
        queued, _watch, first, events = begun

        def line(obj: dict[str, Any]) -> str:
            return json.dumps(obj, ensure_ascii=False) + "\n"

        event: DecodeEvent | None = first
        try:
            while event is not None:
                if isinstance(event, Finished):
                    reason = "length" if event.reason == "length" else "stop"
                    yield line(O.ollama_final(job.model, "", reason, event.stats, time.perf_counter() - t0))
                elif event.text and not job.warm_only:
                    yield line(O.ollama_chunk(job.model, event.text))
                try:
                    event = await events.__anext__()
                except StopAsyncIteration:
                    event = None
        except asyncio.CancelledError:
            queued.cancel.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - reported in-band
            yield line({"error": runtime_error(e).message})
        finally:
            queued.cancel.cancel()

    def _ollama_model(self, name: str) -> dict[str, Any]:
        describe = self.backend.describe()
        dtype = describe.get("quantization") or describe.get("dtype")
        return {
            "name": name,
            "model": name,
            "modified_at": O.iso_now(),
            "size": 0,
            "digest": hashlib.sha256(name.encode()).hexdigest(),
            "details": O.ollama_details(self._architecture(), str(dtype) if dtype else None),
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
        return JSONResponse({"version": O.OLLAMA_API_VERSION})
