"""HTTP test helpers: a real `dflash serve` subprocess, an in-thread uvicorn server for fakes, and
small urllib clients (JSON and server-sent events). Loopback only; every server is shut down."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def request(
    method: str, url: str, body: Any = None, raw: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """(status, parsed JSON or text) of one request; HTTP errors are returned, not raised."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    h = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, headers=h, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, payload = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, payload = e.code, e.read()
    text = payload.decode("utf-8", "replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def post(url: str, body: Any, **kw: Any) -> tuple[int, Any]:
    return request("POST", url, body, **kw)


def get(url: str, **kw: Any) -> tuple[int, Any]:
    return request("GET", url, **kw)


def sse(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, list[Any]]:
    """POST a streaming request; (status, list of decoded ``data:`` payloads, "[DONE]" kept as a string)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    out: list[Any] = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for raw in resp:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("data: "):
                payload = line[6:]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
        return resp.status, out


def metric(text: str, name: str, labels: str = "") -> float:
    """Value of one Prometheus sample (0.0 when absent)."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeProcess:
    """`python -m dflash_cli serve ARGS --port 0` in a subprocess; the port is read from stderr."""

    def __init__(self, args: list[str], home: Path, env: dict[str, str] | None = None, wait: bool = True) -> None:
        e = {k: v for k, v in os.environ.items() if k not in ("DFLASH_API_KEY", "OPENAI_API_KEY")}
        e.update(
            {
                "DFLASH_HOME": str(home),
                "HF_HUB_CACHE": str(home / "hf"),
                "HF_HUB_OFFLINE": "1",
                "OMP_NUM_THREADS": "1",
                "TRANSFORMERS_VERBOSITY": "error",
            }
        )
        e.update(env or {})
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dflash_cli", "serve", *args, "--port", "0", "--threads", "1"],
            cwd=ROOT,
            env=e,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._ready = threading.Event()
        self._interrupted = False
        self.url = ""
        threading.Thread(target=self._drain, daemon=True).start()
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 120) -> ServeProcess:
        """Block until the server prints its address (raises with its stderr if it dies first)."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("dflash serve did not start:\n" + "".join(self.lines[-40:]))
        return self

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"serving .* on (http://127\.0\.0\.1:\d+)/v1", line)
            if m and not self.url:
                self.url = m.group(1)
                self._ready.set()

    def interrupt(self) -> None:
        """Send SIGINT (as Ctrl-C) without waiting."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self._interrupted = True

    def stop(self) -> int:
        """SIGINT (as Ctrl-C) unless ``interrupt`` sent it, then kill if it hangs; returns the exit code.

        One Ctrl-C only: a second one that lands while the server shuts down kills the process
        (exit -2), which made the pool's teardown fail at random on a busy machine."""
        if self.proc.poll() is None:
            if not self._interrupted:
                self.proc.send_signal(signal.SIGINT)
                self._interrupted = True
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


class ThreadServer:
    """An ASGI app on a loopback port, served by uvicorn in a thread (for fakes)."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.sock.close()
