"""Stress `dflash serve` on the tiny test pair: 50 concurrent mixed requests plus hostile ones.

    PYTHONPATH=. python tests/stress_serve.py [--requests 50] [--seed 0]

Starts a real `dflash serve` subprocess (a tiny random qwen3 target + drafter, CPU, float32, a few
MB), fires the mixed requests and the bad ones (issue 11) all at once, then checks:
  - no 5xx answer, and every request got the status its kind calls for;
  - no stuck slot: the queue gauges return to 0 and a last request is answered at once;
  - /metrics agrees with what the clients saw (requests by endpoint and status; one finished
    generation per generation answered 200, cancelled ones counted);
  - Ctrl-C stops the server with exit 0 and no traceback in its log.
Prints one line per check and exits 1 if any fails. Not collected by pytest (no test_ prefix).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fakes import save_pair  # noqa: E402
from tests.http_helpers import ServeProcess, metric  # noqa: E402

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "def fib(n):"}]
DEEP = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


def mixed(i: int, rng: random.Random) -> dict[str, Any]:
    """A well-formed request of one of several kinds (the expected status is 200)."""
    n = rng.randint(4, 32)
    kinds = [
        ("chat", CHAT, {"messages": MSG, "max_tokens": n, "temperature": 0}),
        ("chat-stream", CHAT, {"messages": MSG, "max_tokens": n, "stream": True, "ignore_eos": True}),
        ("chat-sampled", CHAT, {"messages": MSG, "max_tokens": n, "temperature": 0.8, "seed": i, "top_k": 20}),
        ("completion", COMPLETIONS, {"prompt": "def add(a, b):", "max_tokens": n, "temperature": 0}),
        ("completion-ids", COMPLETIONS, {"prompt": [5, 6, 7, 8], "max_tokens": n, "temperature": 0}),
        ("ar", CHAT, {"messages": MSG, "max_tokens": n, "temperature": 0, "dflash": {"decoder": "ar"}}),
        ("block-2", CHAT, {"messages": MSG, "max_tokens": n, "temperature": 0, "dflash": {"block_size": 2}}),
        ("stop", COMPLETIONS, {"prompt": "x", "max_tokens": n, "stop": ["\n", "ab"], "temperature": 0}),
        ("disconnect", CHAT, {"messages": MSG, "max_tokens": 64, "stream": True, "ignore_eos": True}),
    ]
    name, path, body = kinds[i % len(kinds)]
    return {"name": name, "path": path, "body": body, "want": 200}


BAD: list[dict[str, Any]] = [
    {"name": "block_size 100000", "path": CHAT, "body": {"messages": MSG, "dflash": {"block_size": 100000}}},
    {"name": "seed overflow", "path": CHAT, "body": {"messages": MSG, "seed": 18446744073709551616}},
    {"name": "100k-deep JSON", "path": CHAT, "raw": DEEP},
    {"name": "lone surrogate", "path": CHAT, "raw": b'{"messages": [{"role": "user", "content": "a\\ud800"}]}'},
    {"name": "invalid UTF-8", "path": CHAT, "raw": b'{"messages": [{"role": "user", "content": "caf\xe9"}]}'},
    {"name": "NaN", "path": CHAT, "raw": b'{"messages": [{"role": "user", "content": "a"}], "top_p": NaN}'},
    {"name": "invalid JSON", "path": CHAT, "raw": b"{not json"},
    {"name": "empty messages", "path": CHAT, "body": {"messages": []}},
    {"name": "bad role", "path": CHAT, "body": {"messages": [{"role": "wizard", "content": "x"}]}},
    {"name": "too many tokens", "path": CHAT, "body": {"messages": MSG, "max_tokens": 100000}},
    {"name": "string temperature", "path": CHAT, "body": {"messages": MSG, "temperature": "hot"}},
    {"name": "batched prompt", "path": COMPLETIONS, "body": {"prompt": ["a", "b"]}},
    {"name": "negative token id", "path": COMPLETIONS, "body": {"prompt": [1, -2]}},
    {"name": "prompt beyond the context", "path": COMPLETIONS, "body": {"prompt": [5] * 600, "max_tokens": 4}},
]
for b in BAD:
    b["want"] = 400
BAD.append({"name": "unknown model", "path": CHAT, "body": {"model": "gpt-9", "messages": MSG}, "want": 404})


def send(url: str, req: dict[str, Any]) -> dict[str, Any]:
    """Run one request; returns what the client saw."""
    data = req.get("raw") or json.dumps(req["body"]).encode()
    http = urllib.request.Request(url + req["path"], data=data, headers={"Content-Type": "application/json"})
    out = {"name": req["name"], "path": req["path"], "want": req["want"], "tokens": 0, "finish": None}
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(http, timeout=120) as resp:
            out["status"] = resp.status
            if req["body"].get("stream") if "body" in req else False:
                for i, raw in enumerate(resp):
                    if req["name"] == "disconnect" and i >= 2:
                        out["disconnected"] = True
                        break  # the client goes away mid-stream
                    line = raw.decode().strip()
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            out["status"] = 500  # an in-band failure
                        for choice in chunk.get("choices", []):
                            out["finish"] = choice.get("finish_reason") or out["finish"]
            else:
                body = json.loads(resp.read())
                out["tokens"] = body["usage"]["completion_tokens"]
                out["finish"] = body["choices"][0]["finish_reason"]
    except urllib.error.HTTPError as e:
        out["status"] = e.code
        out["error"] = json.loads(e.read() or b"{}").get("error", {})
    except Exception as e:  # noqa: BLE001 - reported as a failed check
        out["status"] = -1
        out["error"] = repr(e)
    out["seconds"] = time.monotonic() - t0
    return out


def endpoint(path: str) -> str:
    return "chat" if path == CHAT else "completions"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=50, help="well-formed concurrent requests")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            failures.append(what)

    with tempfile.TemporaryDirectory(prefix="dflash-stress-") as tmp:
        t, d = save_pair(Path(tmp) / "pair", block_size=4)
        common = ["--dtype", "float32", "--device", "cpu", "--log-level", "warning"]
        srv = ServeProcess(
            ["--target", str(t), "--drafter", str(d), "--max-tokens-limit", "64", "--max-queue", "128", *common],
            Path(tmp) / "home",
        )
        url = srv.url
        print(f"server: {url} (tiny pair, block 4)", flush=True)
        requests = [mixed(i, rng) for i in range(args.requests)] + [dict(b) for b in BAD]
        rng.shuffle(requests)
        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            results = list(pool.map(lambda r: send(url, r), requests))
        wall = time.monotonic() - t0
        by_status = collections.Counter(r["status"] for r in results)
        print(f"{len(results)} requests in {wall:.1f}s: statuses {dict(sorted(by_status.items()))}", flush=True)

        check(all(0 < r["status"] < 500 for r in results), "no 5xx and no failed connection")
        wrong = [(r["name"], r["status"], r.get("error")) for r in results if r["status"] != r["want"]]
        check(not wrong, "every request got its expected status" + (f": {wrong[:3]}" if wrong else ""))
        codes = collections.Counter((r["name"], r.get("error", {}).get("code")) for r in results if r["want"] != 200)
        print("  bad requests answered: " + ", ".join(f"{n} -> {c}" for (n, c) in sorted(codes)), flush=True)

        # no stuck slot: the gauges come back to 0 and a new request is served at once
        deadline, text = time.monotonic() + 30, ""
        while time.monotonic() < deadline:
            with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
                text = resp.read().decode()
            if metric(text, "dflash_requests_running") == 0 and metric(text, "dflash_requests_waiting") == 0:
                break
            time.sleep(0.2)
        check(
            metric(text, "dflash_requests_running") == 0 and metric(text, "dflash_requests_waiting") == 0,
            "no stuck slot: running and waiting gauges back to 0",
        )
        last = send(url, {"name": "last", "path": CHAT, "body": {"messages": MSG, "max_tokens": 4}, "want": 200})
        check(last["status"] == 200 and last["seconds"] < 10, f"a last request is served ({last['seconds']:.2f}s)")
        results.append(last)
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()

        # /metrics agrees with the clients
        seen = collections.Counter((endpoint(r["path"]), r["status"]) for r in results)
        mismatch = [
            (ep, st, n, metric(text, "dflash_requests_total", f'endpoint="{ep}",status="{st}"'))
            for (ep, st), n in seen.items()
            if metric(text, "dflash_requests_total", f'endpoint="{ep}",status="{st}"') != n
        ]
        check(
            not mismatch,
            "dflash_requests_total matches the clients per endpoint and status"
            + (f": {mismatch[:3]}" if mismatch else ""),
        )
        generated = sum(1 for r in results if r["status"] == 200)
        reasons = {
            x: metric(text, "dflash_generations_total", f'reason="{x}"') for x in ("stop", "length", "cancelled")
        }
        check(sum(reasons.values()) == generated, f"one finished generation per 200 answer: {reasons} vs {generated}")
        disconnected = sum(1 for r in results if r.get("disconnected"))
        check(
            reasons["cancelled"] <= disconnected,
            f"cancelled generations ({reasons['cancelled']:g}) <= clients that left ({disconnected})",
        )
        seen_tokens = sum(r["tokens"] for r in results)
        check(
            metric(text, "dflash_generation_tokens_total") >= seen_tokens,
            f"generated tokens counted ({metric(text, 'dflash_generation_tokens_total'):g} >= {seen_tokens} seen)",
        )
        steps = metric(text, "dflash_verify_steps_total")
        check(
            metric(text, "dflash_accepted_tokens_total") <= metric(text, "dflash_draft_tokens_total")
            and steps <= metric(text, "dflash_generation_tokens_total"),
            "accepted <= drafted and verify steps <= generated tokens",
        )

        srv.proc.send_signal(signal.SIGINT)
        threading.Timer(0.05, lambda: srv.proc.poll() is None and srv.proc.send_signal(signal.SIGINT)).start()
        code = srv.stop()
        time.sleep(0.2)
        log = "".join(srv.lines)
        check(code == 0 and "Traceback" not in log, f"Ctrl-C (twice) stops the server: exit {code}, no traceback")
    print(f"{'PASSED' if not failures else 'FAILED'}: {len(failures)} failed check(s)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
