"""The ASGI app of ``dflash serve`` (Starlette): its route table and lifespan over a runtime
``Backend``, one generation at a time through ``GenerationQueue``.

Endpoints: ``GET /v1/models``, ``POST /v1/completions`` (``suffix``: fill in the middle),
``POST /v1/chat/completions`` (JSON or server-sent events with ``stream: true``), ``GET /metrics``
(Prometheus), ``GET /health``; on the same port, what editor plugins speak: llama.cpp's
``POST /infill`` and ``POST /completion``, Ollama's ``POST /api/generate``, ``POST /api/show``,
``GET /api/tags`` and ``GET /api/version``. The routes live in ``openai_routes``, ``llama_routes``
and ``ollama_routes`` (wire formats: ``protocol``, ``llama``, ``ollama``).
Every failure is answered as an error object of the endpoint's own format (``errors``); nothing a
client sends stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from runtime.backend import Backend

from . import protocol as P
from .config import ServeConfig
from .errors import Contain, error_response
from .llama_routes import LlamaRoutes
from .metrics import CONTENT_TYPE
from .ollama_routes import OllamaRoutes
from .openai_routes import OpenAIRoutes
from .queue import GenerationQueue


class DFlashServer(OpenAIRoutes, LlamaRoutes, OllamaRoutes):
    """One server: its routes (OpenAI, llama.cpp, Ollama, /metrics, /health) and its lifespan."""

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
            middleware=[Middleware(Contain, server=self)],
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
        return error_response(P.APIError(status, message if status in (404, 405) else str(exc.detail), code=kind))

    async def prometheus(self, _request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def health(self, _request: Request) -> Response:
        return JSONResponse({"status": "ok"})


def create_app(backend: Backend, config: ServeConfig) -> Starlette:
    """Build the ASGI app for a backend (a loaded ``Pipeline`` in ``dflash serve``)."""
    return DFlashServer(backend, config).app()
