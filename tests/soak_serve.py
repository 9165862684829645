"""Soak `dflash serve` on the tiny test pair and watch its memory (issue 46, defect 10).

    PYTHONPATH=. python tests/soak_serve.py [--requests 2000] [--every 100] [--workers 4] [--json FILE]

Starts a real `dflash serve` subprocess (the tiny random qwen3 pair of tests/fakes.py, CPU,
float32), warms it up with two of each small request, then sends a fixed mix from a few client
threads in rounds of 40: small chat and completion requests, streamed ones (some left mid-stream),
sampled ones, malformed ones (400/404), and in every round one 1 MB body (parsed, then refused: the
prompt is longer than the context) and two 5 MB bodies (413: one refused by its Content-Length,
sent with ``Expect: 100-continue``, one chunked, refused while it is read). Every ``--every``
requests it reads the server's resident memory (``VmRSS`` in /proc/PID/status) and prints one line.
At the end it prints the series and whether RSS settled: the median RSS sampled over the last
quarter of the run (at least 500 requests) is at most ``--max-growth`` (5 %) above the median over
the same number of requests before. Exits 1 if it did not settle or
any request got another status than its kind calls for (a 5xx, no answer).
Not collected by pytest (no test_ prefix); ``tests/test_serve_soak.py`` runs a shorter soak.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fakes import save_pair  # noqa: E402
from tests.http_helpers import ServeProcess  # noqa: E402

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "def fib(n):"}]
MB = 1024 * 1024


def _big(size: int) -> bytes:
    """A valid chat request of about ``size`` bytes (one long user message)."""
    head, tail = b'{"messages": [{"role": "user", "content": "', b'"}], "max_tokens": 4}'
    return head + b"x " * ((size - len(head) - len(tail)) // 2) + tail


BIG_1MB = _big(1 * MB)  # under the 4 MB body limit: parsed, tokenized, refused as longer than the context
BIG_5MB = _big(5 * MB)  # over it: 413


SMALL: list[tuple[str, str, Any, set[int]]] = [
    ("chat", CHAT, {"messages": MSG, "max_tokens": 16, "temperature": 0}, {200}),
    ("chat-stream", CHAT, {"messages": MSG, "max_tokens": 16, "stream": True, "ignore_eos": True}, {200}),
    ("chat-sampled", CHAT, {"messages": MSG, "max_tokens": 16, "temperature": 0.8, "top_k": 20}, {200}),
    ("completion", COMPLETIONS, {"prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0}, {200}),
    ("completion-ids", COMPLETIONS, {"prompt": [5, 6, 7, 8], "max_tokens": 12}, {200}),
    ("completion-stream", COMPLETIONS, {"prompt": "x", "max_tokens": 16, "stream": True}, {200}),
    ("disconnect", CHAT, {"messages": MSG, "max_tokens": 48, "stream": True, "ignore_eos": True}, {200}),
    ("invalid-json", CHAT, b"{not json", {400}),
    ("bad-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, {400}),
    ("too-many-tokens", CHAT, {"messages": MSG, "max_tokens": 100000}, {400}),
    ("unknown-model", CHAT, {"model": "gpt-9", "messages": MSG}, {404}),
    ("prompt-beyond-context", COMPLETIONS, {"prompt": [5] * 600, "max_tokens": 4}, {400}),
]
BIG: list[tuple[str, str, Any, set[int]]] = [
    ("body-1mb", CHAT, BIG_1MB, {400}),  # a few seconds each: its 500k tokens are counted
    ("body-5mb", CHAT, BIG_5MB, {413}),  # refused by its Content-Length
    ("body-5mb-chunked", CHAT, BIG_5MB, {413}),  # refused while it is read
]
ROUND = 40  # each round of 40 requests holds one of each BIG kind


def kinds() -> list[tuple[str, str, Any, set[int]]]:
    """(name, path, JSON body or raw bytes, accepted statuses) of each kind of request in the mix."""
    return SMALL + BIG


def plan(requests: int, rng: random.Random) -> list[tuple[str, str, Any, set[int]]]:
    """The requests in order: rounds of ``ROUND`` (the big bodies once each, small kinds for the rest), shuffled."""
    out: list[tuple[str, str, Any, set[int]]] = []
    while len(out) < requests:
        one = BIG + [SMALL[i % len(SMALL)] for i in range(ROUND - len(BIG))]
        rng.shuffle(one)
        out += one
    return out[:requests]


def _expect_continue(url: str, path: str, data: bytes) -> int:
    """POST with ``Expect: 100-continue``: a body the server refuses by its Content-Length is never sent
    (as curl does; sent blindly, the refusal races the upload and the client may see a reset instead)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        conn.putrequest("POST", path)
        for key, value in (("Content-Type", "application/json"), ("Content-Length", str(len(data)))):
            conn.putheader(key, value)
        conn.putheader("Expect", "100-continue")
        conn.endheaders()
        assert conn.sock is not None
        conn.sock.settimeout(5)  # a server that waits for the body instead: send it
        try:
            resp = conn.getresponse()
        except TimeoutError:
            conn.sock.settimeout(120)
            conn.send(data)
            resp = conn.getresponse()
        resp.read()
        return int(resp.status)
    finally:
        conn.close()


def _chunked(url: str, path: str, data: bytes) -> int:
    """POST ``data`` with Transfer-Encoding: chunked (no Content-Length): the server reads until its limit."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        step = 256 * 1024
        chunks = (data[i : i + step] for i in range(0, len(data), step))
        try:
            conn.request("POST", path, body=chunks, headers={"Content-Type": "application/json"}, encode_chunked=True)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered 413 and closed before the rest was sent: read its answer
        resp = conn.getresponse()
        resp.read()
        return int(resp.status)
    finally:
        conn.close()


def send(url: str, kind: tuple[str, str, Any, set[int]], seed: int) -> tuple[str, int]:
    """One request of ``kind``; returns (name, status) (-1: no answer)."""
    name, path, body, _ = kind
    if isinstance(body, dict) and name == "chat-sampled":
        body = {**body, "seed": seed}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        if name == "body-5mb-chunked":
            return name, _chunked(url, path, data)
        if name == "body-5mb":
            return name, _expect_continue(url, path, data)
        req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            if isinstance(body, dict) and body.get("stream"):
                for i, _line in enumerate(resp):
                    if name == "disconnect" and i >= 2:
                        break  # the client goes away mid-stream
            else:
                resp.read()
            return name, int(resp.status)
    except urllib.error.HTTPError as e:
        e.read()
        return name, int(e.code)
    except (ConnectionResetError, BrokenPipeError):
        return name, -1
    except Exception:  # noqa: BLE001 - counted as a failure
        return name, -1


def rss_kb(pid: int) -> int:
    """Resident memory of a process in kB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def soak(url: str, pid: int, requests: int, every: int, workers: int, seed: int, say: Any = print) -> dict[str, Any]:
    """Send ``requests`` requests of the mix; RSS of ``pid`` before and after every ``every``."""
    rng = random.Random(seed)
    mix = kinds()
    todo = plan(requests, rng)
    started = rss_kb(pid)
    for kind in SMALL * 2:  # warm up: the first generations of each kind allocate the working buffers
        send(url, kind, 0)
    series = [(0, rss_kb(pid))]
    say(
        f"server RSS {started / 1024:.1f} MB at start, {series[0][1] / 1024:.1f} MB after {2 * len(SMALL)} warm-up requests"
    )
    say(f"{0:>6} requests  RSS {series[0][1] / 1024:7.1f} MB")
    bad: list[tuple[str, int]] = []
    counts: dict[str, int] = {}
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for start in range(0, requests, every):
            batch = todo[start : start + every]
            for name, status in pool.map(lambda k: send(url, k, rng.randrange(2**31)), batch):
                counts[f"{name} {status}"] = counts.get(f"{name} {status}", 0) + 1
                want = next(k[3] for k in mix if k[0] == name)
                if status not in want:
                    bad.append((name, status))
            done = start + len(batch)
            series.append((done, rss_kb(pid)))
            say(f"{done:>6} requests  RSS {series[-1][1] / 1024:7.1f} MB  ({time.monotonic() - t0:.0f}s)")
    return {
        "start_rss_kb": started,
        "series": series,
        "unexpected": bad,
        "statuses": counts,
        "seconds": time.monotonic() - t0,
    }


def growth(series: list[tuple[int, int]], tail: int) -> float:
    """Relative RSS growth over the last ``tail`` requests: the median of the samples taken in them
    against the median of those taken in the ``tail`` requests before (or the warm-up sample when the
    run is shorter). Medians, because a sample may land while freed memory waits for its trim."""
    last = series[-1][0]
    now = [rss for n, rss in series if n > last - tail]
    before = [rss for n, rss in series if last - 2 * tail < n <= last - tail] or [series[0][1]]
    return statistics.median(now) / statistics.median(before) - 1


def start_server(tmp: Path) -> ServeProcess:
    t, d = save_pair(tmp / "pair", block_size=4)
    args = ["--target", str(t), "--drafter", str(d), "--max-tokens-limit", "64", "--max-queue", "64"]
    return ServeProcess([*args, "--dtype", "float32", "--device", "cpu", "--log-level", "warning"], tmp / "home")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--every", type=int, default=100, help="requests between RSS samples")
    ap.add_argument("--workers", type=int, default=4, help="concurrent clients")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-growth", type=float, default=0.05, help="allowed RSS growth over the tail")
    ap.add_argument("--json", type=Path, help="write the series and statuses here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dflash-soak-") as tmp:
        srv = start_server(Path(tmp))
        try:
            print(f"server: {srv.url} pid {srv.proc.pid} (tiny pair, block 4)", flush=True)
            res = soak(srv.url, srv.proc.pid, args.requests, args.every, args.workers, args.seed, say=_say)
        finally:
            code = srv.stop()
    tail = max(500, args.requests // 4)
    g = growth(res["series"], tail)
    res.update(tail=tail, tail_growth=g, exit_code=code)
    print("RSS MB: " + ", ".join(f"{n}:{kb / 1024:.0f}" for n, kb in res["series"]))
    print("statuses: " + json.dumps(dict(sorted(res["statuses"].items()))))
    total = growth(res["series"], args.requests)
    res["total_growth"] = total
    peak = max(kb for _, kb in res["series"])
    print(f"median RSS of the last {tail} requests against the {tail} before: {g:+.1%}")
    print(f"against the warmed-up server: {total:+.1%} (highest sample {peak / 1024:.0f} MB)")
    print(f"server exit {code}; {res['seconds']:.0f}s")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    ok = not res["unexpected"] and g < args.max_growth and code == 0
    if res["unexpected"]:
        print(f"unexpected statuses: {res['unexpected'][:10]}")
    print("SETTLED" if ok else "NOT SETTLED")
    return 0 if ok else 1


def _say(line: str) -> None:
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
