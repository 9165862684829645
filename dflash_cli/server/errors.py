"""Failures as HTTP answers: runtime errors mapped to an OpenAI-style ``APIError`` (status, type,
code), and the middleware that turns any exception a handler lets through into a counted 500."""

from __future__ import annotations

import sys
import traceback
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse

from runtime import DFlashError, InputError, OutOfMemoryError

from . import protocol as P

if TYPE_CHECKING:
    from .state import ServerState


def error_response(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def runtime_error(e: Exception) -> P.APIError:
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


class Contain:
    """Any exception a handler lets through becomes an OpenAI-style 500, counted in /metrics; its
    traceback is printed only with DFLASH_DEBUG (Starlette's own handler would re-raise it into the log)."""

    def __init__(self, app: Any, server: ServerState) -> None:
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
            err = runtime_error(exc)
            self.server.metrics.request(ENDPOINTS.get(scope.get("path", ""), "other"), err.status)
            if not started:
                await error_response(err)(scope, receive, send)
