"""What the editor routes (``llama_routes``, ``ollama_routes``) share: queue one generation under
the llama-server rules of ``editors.Watch``, wait for its first event, read it to its end."""

from __future__ import annotations

import asyncio
import sys
import time
import traceback
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any

from starlette.requests import Request

from runtime import CancelToken
from runtime.engine.events import DecodeEvent, Finished, PrefillDone

from . import editors as E
from . import protocol as P
from .errors import runtime_error
from .queue import Job, QueueFullError
from .state import ServerState, cancel_on_disconnect

Begun = tuple[Job, E.Watch, DecodeEvent, AsyncIterator[DecodeEvent]]  # queued job, its watch, first event, the rest


class EditorRoutes(ServerState):
    """Generations for the editor wire formats (docs/serve-editors.md)."""

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
    ) -> Begun | P.APIError | None:
        """Queue one generation and wait for its first event (a bad prompt still gets its status);
        None: the client left before it started."""
        assert self.queue is not None
        watch = E.Watch(job.t_max_predict_ms, job.n_indent)
        try:
            queued = self.queue.submit(self._editor_start(job, watch, seed), asyncio.get_running_loop(), job.supersede)
        except QueueFullError as e:
            return P.APIError(503, f"the server is busy ({e}); retry later", type="server_error", code="server_busy")
        events = queued.events()
        watcher = asyncio.ensure_future(cancel_on_disconnect(request, queued))
        try:
            first = await events.__anext__()
        except StopAsyncIteration:
            return None
        except Exception as e:  # noqa: BLE001
            err = runtime_error(e)
            if err.status >= 500 and self.config.debug:
                traceback.print_exception(e, file=sys.stderr)
            return err
        finally:
            watcher.cancel()
        return queued, watch, first, events

    async def _editor_collect(self, request: Request, begun: Begun) -> tuple[str, list[int], Finished | None]:
        """Read a generation to its end: (text, committed ids, the Finished event or None)."""
        queued, watch, event, events = begun
        text: list[str] = []
        ids: list[int] = []
        done: Finished | None = None
        watcher = asyncio.ensure_future(cancel_on_disconnect(request, queued))
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


def event_prompt(event: DecodeEvent) -> int:
    """Prompt tokens, known from the first event of a generation (0 after it)."""
    return event.prompt_tokens if isinstance(event, PrefillDone) else 0
