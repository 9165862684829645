"""One generation at a time: a worker thread runs queued jobs in order (the runtime is batch 1).

Request handlers (asyncio) submit a job and read its events from an ``asyncio.Queue`` that the
worker thread fills with ``loop.call_soon_threadsafe``. A job whose client went away is cancelled
through its ``CancelToken``: skipped if still waiting, stopped after the current verify step if
running.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from runtime import CancelToken
from runtime.engine.events import DecodeEvent

StartFn = Callable[[CancelToken], Iterator[DecodeEvent]]

_END = object()


class QueueFullError(Exception):
    """More requests are waiting than the server accepts."""


@dataclass
class Job:
    """One queued generation.

    Attributes:
        start: called on the worker thread with the job's cancel token; returns the event stream.
        position: requests ahead of this one when it was queued (0: it started at once).
        key: a newer job with the same key cancels this one (None: never).
        queued_at, started_at, finished_at: wall-clock times (``time.time()``).
    """

    start: StartFn
    loop: asyncio.AbstractEventLoop
    position: int = 0
    key: str | None = None
    cancel: CancelToken = field(default_factory=CancelToken)
    queued_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    items: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)

    def _put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the loop is closed (server shutting down)
            pass

    async def events(self) -> AsyncIterator[DecodeEvent]:
        """The job's events as they come; re-raises the generation's exception."""
        while True:
            item = await self.items.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def timing(self) -> dict[str, Any]:
        """Queue position and times, for the response's ``dflash.queue`` field."""
        started = self.started_at or self.queued_at
        return {
            "position": self.position,
            "wait_seconds": round(started - self.queued_at, 6),
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }


class GenerationQueue:
    """A FIFO of generations served by one worker thread.

    Args:
        max_waiting: jobs allowed to wait behind the running one; more raise ``QueueFullError``.
        on_change: called (on any thread) with (waiting, running) whenever they change.
        on_skip: called (on the worker thread) for a job cancelled before it started.
    """

    def __init__(
        self,
        max_waiting: int,
        on_change: Callable[[int, int], None] | None = None,
        on_skip: Callable[[], None] | None = None,
    ) -> None:
        self.max_waiting = max_waiting
        self.on_change = on_change
        self.on_skip = on_skip
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._running: Job | None = None
        self._thread = threading.Thread(target=self._work, name="dflash-generation", daemon=True)
        self._thread.start()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self._waiting, 1 if self._running is not None else 0)

    def submit(self, start: StartFn, loop: asyncio.AbstractEventLoop, key: str | None = None) -> Job:
        """Queue a generation; with a ``key``, first cancel the running or waiting job that has it
        (stopped after its current step, or skipped).

        Raises:
            QueueFullError: ``max_waiting`` jobs are already waiting.
        """
        if key is not None:
            self._supersede(key)
        with self._lock:
            busy = self._running is not None
            if busy and self._waiting >= self.max_waiting:
                raise QueueFullError(f"{self._waiting} requests are already waiting")
            job = Job(start=start, loop=loop, position=self._waiting + int(busy), key=key)
            self._waiting += 1
            self._jobs.put(job)
            self._changed()
        return job

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                self._waiting -= 1
                self._running = job
                self._changed()
            job.started_at = time.time()
            try:
                if not job.cancel.cancelled:
                    for event in job.start(job.cancel):
                        job._put(event)
                elif self.on_skip is not None:
                    self.on_skip()
            except BaseException as e:  # noqa: BLE001 - handed to the request handler
                job._put(e)
            finally:
                job.finished_at = time.time()
                with self._lock:
                    self._running = None
                    self._changed()
                job._put(_END)

    def _supersede(self, key: str) -> None:
        """Cancel the running and waiting jobs that have ``key``."""
        with self._lock:
            running = self._running
            with self._jobs.mutex:
                jobs = [j for j in self._jobs.queue if j is not None]
        for job in ([running] if running is not None else []) + jobs:
            if job.key == key:
                job.cancel.cancel()

    def cancel_all(self) -> None:
        """Cancel the running job (it stops after its current step) and every waiting one (skipped)."""
        with self._lock:
            if self._running is not None:
                self._running.cancel.cancel()
            with self._jobs.mutex:
                waiting = [j for j in self._jobs.queue if j is not None]
        for job in waiting:
            job.cancel.cancel()

    def close(self) -> None:
        """Cancel what is running or waiting and stop the worker."""
        with self._lock:
            if self._running is not None:
                self._running.cancel.cancel()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel.cancel()
                job._put(_END)
        self._jobs.put(None)
        self._thread.join(timeout=10)
