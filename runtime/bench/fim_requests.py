"""One FIM request of ``dflash bench --dataset fim``, timed as an editor waits for it.

``run_local`` completes a case on the local pipeline (one ``Run``: tokens, tau, time to the first token
and to the first complete line); ``InfillClient`` asks a llama.cpp ``/infill`` server (``dflash serve``
answers it too) the same, keeping the server's own ``timings``.

The time to the first complete line runs from the request's start to the arrival of the event (or
stream chunk) after which the middle holds a newline following some non-whitespace; a middle that
ends (an end-of-middle token) with text but no newline is complete when it ends; one cut by the
token limit before any line ended has none. Times are taken on arrival (``time.perf_counter``),
so both engines are measured the way an editor waits for them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from runtime.config import DecodeOptions, SamplingParams
from runtime.engine.events import BlockVerified, Finished, PrefillDone
from runtime.errors import ConfigError


# -- one request -------------------------------------------------------------------------------------
class LineClock:
    """When the streamed middle first holds a complete line (see the module docstring)."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.text = ""
        self.at: float | None = None

    def feed(self, text: str, now: float) -> None:
        """Text that arrived at ``now``."""
        self.text += text
        if self.at is not None or not text:
            return
        stripped = self.text.lstrip()
        if "\n" in stripped and stripped.split("\n", 1)[0].strip():
            self.at = now - self.t0

    def end(self, now: float, stopped: bool) -> None:
        """The request ended at ``now``; ``stopped``: at an end-of-middle token (not the limit)."""
        if self.at is None and stopped and self.text.strip():
            self.at = now - self.t0


@dataclass
class Run:
    """One request, measured on arrival.

    Attributes:
        text: the middle.
        token_ids: its ids (empty for a server that does not return them).
        prompt_tokens: prompt length in tokens.
        tokens_cached: leading prompt tokens taken from the cache.
        generated: tokens generated (the end-of-middle token included when one ended it).
        ttft_s: request start to the first token's arrival.
        first_line_s: request start to the first complete line (None: no line completed).
        total_s: request start to its end.
        decode_tps: tokens after the first per second after the first (the server's own
            ``predicted_per_second`` for a server).
        tau: tokens committed per verify step (None: not reported).
        finish: "stop" (end of middle) or "length".
        timings: a server's own ``timings`` object (None locally).
    """

    text: str
    token_ids: list[int]
    prompt_tokens: int
    tokens_cached: int
    generated: int
    ttft_s: float | None
    first_line_s: float | None
    total_s: float
    decode_tps: float
    tau: float | None
    finish: str
    timings: dict[str, Any] | None = None

    @property
    def cached_share(self) -> float:
        """Share of the prompt taken from the cache."""
        return self.tokens_cached / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_json(self, with_tokens: bool = True) -> dict[str, Any]:
        """Plain-JSON form."""
        out: dict[str, Any] = {
            "text": self.text,
            "prompt_tokens": self.prompt_tokens,
            "tokens_cached": self.tokens_cached,
            "cached_share": self.cached_share,
            "generated_tokens": self.generated,
            "ttft_seconds": self.ttft_s,
            "first_line_seconds": self.first_line_s,
            "total_seconds": self.total_s,
            "decode_tokens_per_second": self.decode_tps,
            "tau": self.tau,
            "finish": self.finish,
        }
        if with_tokens:
            out["token_ids"] = list(self.token_ids)
        if self.timings is not None:
            out["timings"] = self.timings
        return out


def run_local(pipe: Any, ids: Sequence[int], params: SamplingParams, opts: DecodeOptions) -> Run:
    """One request through a loaded pipeline, timed as its events arrive."""
    t0 = time.perf_counter()
    clock = LineClock(t0)
    tokens: list[int] = []
    ttft: float | None = None
    cached = prompt_tokens = 0
    stats = None
    reason = "length"
    for ev in pipe.stream_ids(ids, params, opts):
        now = time.perf_counter()
        if isinstance(ev, PrefillDone):
            ttft = now - t0
            cached, prompt_tokens = ev.tokens_cached, ev.prompt_tokens
        if isinstance(ev, (PrefillDone, BlockVerified)):
            tokens += [t.token_id for t in ev.tokens]
            clock.feed(ev.text, now)
        elif isinstance(ev, Finished):
            stats, reason = ev.stats, ev.reason
            clock.end(now, ev.reason == "stop")
    end = time.perf_counter()
    if stats is None:  # a decoder always ends with Finished; keep the type checker honest
        raise RuntimeError("the decoder ended without a Finished event")
    return Run(
        text=clock.text,
        token_ids=tokens,
        prompt_tokens=prompt_tokens or len(ids),
        tokens_cached=cached,
        generated=stats.generated_tokens,
        ttft_s=ttft,
        first_line_s=clock.at,
        total_s=end - t0,
        decode_tps=stats.decode_tokens_per_second,
        tau=stats.tau if stats.decoder == "dflash" else 1.0,
        finish="stop" if reason == "stop" else "length",
    )


class InfillClient:
    """llama.cpp's ``POST /infill`` (llama-server, or ``dflash serve``), streamed.

    Args:
        url: the server (``http://host:port``; a bare ``host:port`` works).
        label: the engine name of its rows ("llama.cpp", "server").
        api_key: sent as ``Authorization: Bearer`` (llama-server ``--api-key``, ``dflash serve``'s key).
        timeout: seconds per request.
    """

    def __init__(self, url: str, label: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        from runtime.client.http import normalize_url

        self.url = normalize_url(url)
        self.label = label
        self.api_key = api_key
        self.timeout = timeout

    def run(self, prefix: str, suffix: str, n_predict: int, cache_prompt: bool) -> Run:
        """One greedy request; times from the client, counts and ``timings`` from the server.

        Raises:
            ConfigError: the server refused the API key (401, 403).
            RemoteError: the server cannot be reached, answers an error, or streams no final chunk.
        """
        import httpx

        from runtime.client.http import RemoteError

        body = {
            "input_prefix": prefix,
            "input_suffix": suffix,
            "input_extra": [],
            "n_predict": n_predict,
            "temperature": 0,
            "cache_prompt": cache_prompt,
            "stream": True,
        }
        where = f"{self.url}/infill"
        t0 = time.perf_counter()
        clock = LineClock(t0)
        ttft: float | None = None
        final: dict[str, Any] | None = None
        pieces = 0
        try:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            with httpx.stream("POST", where, json=body, headers=headers, timeout=self.timeout) as resp:
                if resp.status_code in (401, 403):
                    raise ConfigError(
                        f"{where} refused the API key ({resp.status_code}); set DFLASH_API_KEY (or OPENAI_API_KEY)"
                    )
                if resp.status_code >= 400:
                    detail = resp.read().decode("utf-8", "replace").strip().splitlines()
                    raise RemoteError(
                        f"{where} answered {resp.status_code}: {(detail or [resp.reason_phrase])[0][:300]}"
                        + ("; is it llama-server (or dflash serve)?" if resp.status_code == 404 else "")
                    )
                for chunk in _sse_objects(resp.iter_lines(), where):
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - t0
                    content = chunk.get("content")
                    if isinstance(content, str) and content:
                        pieces += 1
                        clock.feed(content, now)
                    if chunk.get("stop") is True:
                        final = chunk
                        break
        except httpx.TransportError as e:
            raise RemoteError(f"cannot reach {where}: {e or type(e).__name__}; is the server running?") from None
        end = time.perf_counter()
        if final is None:
            raise RemoteError(f'{where} ended its stream without a final chunk ("stop": true)')
        stopped = str(final.get("stop_type", "")) in ("eos", "word")
        clock.end(end, stopped)
        timings = final.get("timings") if isinstance(final.get("timings"), dict) else None
        t = timings or {}
        cached = int(t.get("cache_n", final.get("tokens_cached", 0)) or 0)
        evaluated = int(final.get("tokens_evaluated") or 0) or int(t.get("prompt_n") or 0) + cached
        stats = (final.get("dflash") or {}).get("stats") if isinstance(final.get("dflash"), dict) else None
        tau = float(stats["tau"]) if isinstance(stats, dict) and stats.get("tau") is not None else None
        return Run(
            text=clock.text,
            token_ids=[],
            prompt_tokens=evaluated,
            tokens_cached=cached,
            generated=int(final.get("tokens_predicted") or t.get("predicted_n") or pieces),
            ttft_s=ttft,
            first_line_s=clock.at,
            total_s=end - t0,
            decode_tps=float(t.get("predicted_per_second") or 0.0),
            tau=tau,
            finish="stop" if stopped else "length",
            timings=timings,
        )


def _sse_objects(lines: Iterator[str], where: str) -> Iterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream (``data: {...}`` lines)."""
    from runtime.client.http import RemoteError

    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if not payload or payload == "[DONE]":
            continue
        try:
            obj = json.loads(payload)
        except json.JSONDecodeError:
            raise RemoteError(f"{where} streamed something that is not JSON: {payload[:120]!r}") from None
        if isinstance(obj, dict):
            if "error" in obj and "content" not in obj:
                raise RemoteError(f"{where} failed: {obj['error']}")
            yield obj


# -- the bench ---------------------------------------------------------------------------------------
