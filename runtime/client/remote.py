"""A ``Backend`` that talks to an OpenAI-compatible HTTP server: ``dflash serve``, vLLM or SGLang.

Requests go to ``/v1/chat/completions`` or ``/v1/completions`` with ``stream: true``; the
server-sent chunks become the runtime's typed events (``PrefillDone`` -> ``BlockVerified``* ->
``Finished``), so the CLI, the TUI and bench render a remote generation like a local one.

What each server exposes:
  dflash serve  every chunk carries the runtime event in its ``dflash`` extension field: per-token
                origin (ACCEPTED/TARGET), drafts, and the exact ``GenerationStats`` at the end.
  vLLM          text chunks (status TARGET); speculative statistics from ``metrics.speculative_decoding``
                when the server runs with ``--per-request-spec-decode-metrics summary``, else from
                the change of its ``vllm:spec_decode_*`` counters on ``/metrics`` around the request
                (exact only while nobody else uses the server).
  SGLang        text chunks (status TARGET); statistics from ``sglext.spec_tokens_details``
                (requested with ``return_spec_tokens_details``) or ``meta_info``.
  other         text chunks and usage only.

The flavour comes from ``owned_by`` in ``/v1/models``. Token ids are unknown for text-only chunks
(``token_id`` -1, one ``TokenEvent`` per chunk). Nothing here reads the environment: the caller
passes the API key.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

from runtime.config import DecodeOptions, SamplingParams
from runtime.engine import CancelToken
from runtime.engine.events import (
    BlockVerified,
    DecodeEvent,
    Finished,
    FinishReason,
    GenerationStats,
    PrefillDone,
    TokenEvent,
    TokenStatus,
)
from runtime.errors import ConfigError, DFlashError, InputError, ModelNotFoundError

FLAVOURS = ("dflash", "vllm", "sglang", "openai")
VLLM_COUNTERS = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


class RemoteError(DFlashError):
    """The server cannot be reached, or it failed while generating."""

    exit_code = 7


def normalize_url(url: str) -> str:
    """``http://host:port`` from what users type (``host:port``, a trailing ``/``, a trailing ``/v1``)."""
    url = url.strip()
    if not url:
        raise ConfigError("the server URL is empty; pass e.g. --server http://127.0.0.1:8000")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"unsupported server URL {url!r}; use http:// or https://")
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


@dataclass(frozen=True)
class ServerInfo:
    """What ``/v1/models`` said.

    Attributes:
        flavour: "dflash", "vllm", "sglang" or "openai" (anything else).
        models: served model ids, in the server's order.
        details: dflash serve's description of its pipeline (empty for other servers).
    """

    flavour: str
    models: tuple[str, ...]
    details: dict[str, Any]


@dataclass
class _Spec:
    """Speculative-decoding totals a server reported for one request."""

    steps: int
    drafted: int
    accepted: int
    histogram: tuple[int, ...] = ()
    per_position: tuple[float, ...] = ()
    draft_len: int = 0  # drafts per verify step (0: unknown)
    tau: float | None = None


def _per_position_from_histogram(hist: Sequence[int]) -> tuple[float, ...]:
    """Share of steps whose first k drafts were all accepted, for k = 1..len(hist)-1."""
    steps = sum(hist)
    if not steps:
        return ()
    return tuple(sum(hist[k:]) / steps for k in range(1, len(hist)))


def _spec_from_vllm(m: dict[str, Any]) -> _Spec | None:
    try:
        k = int(m.get("num_spec_tokens") or 0)
        hist = tuple(int(x) for x in m.get("acceptance_histogram") or ())
        return _Spec(
            steps=int(m["num_spec_steps"]),
            drafted=int(m["num_draft_tokens"]),
            accepted=int(m["num_accepted_draft_tokens"]),
            histogram=hist,
            per_position=_per_position_from_histogram(hist),
            draft_len=k,
            tau=float(m["mean_acceptance_length"]) if m.get("mean_acceptance_length") is not None else None,
        )
    except (KeyError, TypeError, ValueError):
        return None


def _spec_from_sglang(d: dict[str, Any]) -> _Spec | None:
    steps = int(d.get("spec_verify_ct") or 0)
    if steps <= 0:
        return None
    drafted = int(d.get("spec_num_proposed_drafts") or 0)
    hist = tuple(int(x) for x in d.get("spec_correct_drafts_histogram") or ())
    return _Spec(
        steps=steps,
        drafted=drafted,
        accepted=int(d.get("spec_num_correct_drafts") or 0),
        histogram=hist,
        per_position=_per_position_from_histogram(hist),
        draft_len=drafted // steps if drafted else 0,
        tau=float(d["spec_accept_length"]) if d.get("spec_accept_length") else None,
    )


def parse_prometheus(text: str, names: Sequence[str]) -> dict[str, float]:
    """Sum the samples of the named metrics over all label sets (``name{label="x"}`` keeps the
    ``position`` label, used by vLLM's per-position counter)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, rest = line.partition(" ")
        name, _, labels = name_labels.partition("{")
        if name not in names:
            continue
        key = name
        if "position=" in labels:
            pos = labels.split('position="', 1)[1].split('"', 1)[0]
            key = f"{name}[{pos}]"
        try:
            out[key] = out.get(key, 0.0) + float(rest.split()[0])
        except (ValueError, IndexError):
            continue
    return out


def _spec_from_counter_delta(before: dict[str, float], after: dict[str, float]) -> _Spec | None:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = int(d.get(VLLM_COUNTERS[0], 0))
    if steps <= 0:
        return None
    per_pos = []
    i = 0
    while f"{VLLM_PER_POS}[{i}]" in d:
        per_pos.append(d[f"{VLLM_PER_POS}[{i}]"] / steps)
        i += 1
    drafted = int(d.get(VLLM_COUNTERS[1], 0))
    return _Spec(
        steps=steps,
        drafted=drafted,
        accepted=int(d.get(VLLM_COUNTERS[2], 0)),
        per_position=tuple(per_pos),
        draft_len=drafted // steps,
    )


def _stats_from_json(d: dict[str, Any]) -> GenerationStats:
    known = {f.name for f in fields(GenerationStats)}
    kw = {k: v for k, v in d.items() if k in known}
    kw["per_position_acceptance"] = tuple(kw.get("per_position_acceptance") or ())
    kw["acceptance_histogram"] = tuple(kw.get("acceptance_histogram") or ())
    return GenerationStats(**kw)


def _token(d: dict[str, Any]) -> TokenEvent:
    return TokenEvent(int(d.get("id", -1)), str(d.get("text", "")), TokenStatus(d.get("status", "target")))


def _error_message(body: bytes) -> str:
    try:
        err = json.loads(body.decode("utf-8", "replace"))
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:300]
    if isinstance(err, dict):
        e = err.get("error", err)
        if isinstance(e, dict):
            return str(e.get("message") or e)
        return str(e if err.get("message") is None else err["message"])
    return str(err)


class RemoteBackend:
    """A ``Backend`` over an OpenAI-compatible server.

    Args:
        url: server root (``http://host:port``; a trailing ``/v1`` is accepted).
        api_key: sent as ``Authorization: Bearer`` (None: no header).
        model: model id to request (None: the first one ``/v1/models`` lists).
        timeout: seconds to wait for a connection or for the next chunk (a queued request waits).
    """

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None, timeout: float = 600.0) -> None:
        self.url = normalize_url(url)
        self.api_key = api_key or None
        self._model = model
        self.timeout = timeout
        self._info: ServerInfo | None = None
        self._vllm_per_request = False  # vLLM sent per-request metrics once: skip /metrics scraping

    # -- HTTP ------------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        h = {"Accept": "application/json, text/event-stream", "User-Agent": "dflash"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _open(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None
        headers = self._headers()
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method="POST" if data else "GET")
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raise self._http_error(e.code, _error_message(e.read()), path) from None
        except urllib.error.URLError as e:
            raise RemoteError(
                f"cannot reach the server at {self.url}: {getattr(e, 'reason', e)}; is it running?"
            ) from None
        except (TimeoutError, OSError) as e:
            raise RemoteError(f"cannot reach the server at {self.url}: {e}") from None

    def _http_error(self, status: int, message: str, path: str) -> DFlashError:
        where = f"{self.url}{path}"
        if status in (401, 403):
            return ConfigError(
                f"the server at {self.url} refused the API key ({status}: {message}); "
                "set DFLASH_API_KEY (or OPENAI_API_KEY)"
            )
        if status == 404 and "model" in message.lower():
            return ModelNotFoundError(f"{message} (server {self.url}; its models: {', '.join(self.info().models)})")
        if status == 404:
            return RemoteError(f"{where} does not exist (404): is {self.url} an OpenAI-compatible server?")
        if status in (400, 413, 422):
            return InputError(f"the server rejected the request: {message}")
        return RemoteError(f"the server at {self.url} answered {status}: {message}")

    def _get_json(self, path: str) -> Any:
        with self._open(path) as resp:
            try:
                return json.loads(resp.read())
            except ValueError:
                raise RemoteError(f"{self.url}{path} did not answer JSON: is it an OpenAI-compatible server?") from None

    # -- server description ----------------------------------------------------------------
    def info(self) -> ServerInfo:
        """Served models and the server's flavour (fetched once from ``/v1/models``)."""
        if self._info is None:
            doc = self._get_json("/v1/models")
            data = doc.get("data") if isinstance(doc, dict) else None
            if not isinstance(data, list):
                raise RemoteError(f"{self.url}/v1/models has no model list: is it an OpenAI-compatible server?")
            models = tuple(str(m.get("id")) for m in data if isinstance(m, dict) and m.get("id"))
            owner = str(data[0].get("owned_by", "")).lower() if data and isinstance(data[0], dict) else ""
            flavour = owner if owner in FLAVOURS else "openai"
            details = data[0].get("dflash", {}) if flavour == "dflash" and isinstance(data[0], dict) else {}
            self._info = ServerInfo(flavour, models, dict(details or {}))
        return self._info

    @property
    def model(self) -> str:
        """The model id requests name."""
        if self._model:
            return self._model
        models = self.info().models
        if not models:
            raise RemoteError(f"the server at {self.url} serves no model")
        return models[0]

    @property
    def flavour(self) -> str:
        """ "dflash", "vllm", "sglang" or "openai"."""
        return self.info().flavour

    @property
    def per_token_status(self) -> bool:
        """True when tokens carry their origin (only dflash serve sends it)."""
        return self.flavour == "dflash"

    def describe(self) -> dict[str, Any]:
        """Server, flavour and model; dflash serve adds its pipeline's description."""
        info = self.info()
        d: dict[str, Any] = {"target": self.model, "drafter": None, "block_size": None, **info.details}
        d.update({"engine": info.flavour, "server": self.url, "model": self.model})
        d["per_token_status"] = self.per_token_status
        return d

    # -- Backend protocol ------------------------------------------------------------------
    def stream_prompt(
        self,
        text: str,
        params: SamplingParams,
        opts: DecodeOptions | None = None,
        cancel: CancelToken | None = None,
        chat: bool | None = None,
        system: str | None = None,
    ) -> Iterator[DecodeEvent]:
        """Complete ``text``: chat endpoint unless ``chat`` is False (dflash serve: its model decides)."""
        if not text.strip():
            raise InputError("the prompt is empty; pass text as an argument or on stdin")
        if chat is None:
            chat = bool(self.info().details.get("chat_template", True))
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            return self.stream_messages(messages, params, opts, cancel)
        return self._stream("/v1/completions", {"prompt": text, **self._body(params, opts, chat=False)}, cancel)

    def stream_messages(
        self,
        messages: Sequence[dict[str, str]],
        params: SamplingParams,
        opts: DecodeOptions | None = None,
        cancel: CancelToken | None = None,
    ) -> Iterator[DecodeEvent]:
        """Answer a conversation through the server's chat template."""
        if not messages:
            raise InputError("the conversation is empty")
        body = {"messages": [dict(m) for m in messages], **self._body(params, opts, chat=True)}
        return self._stream("/v1/chat/completions", body, cancel)

    def stream_ids(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        opts: DecodeOptions | None = None,
        cancel: CancelToken | None = None,
    ) -> Iterator[DecodeEvent]:
        """Raw completion of token ids (``prompt`` as a list of ints)."""
        if not prompt_ids:
            raise InputError("the prompt is empty")
        body = {"prompt": [int(i) for i in prompt_ids], **self._body(params, opts, chat=False)}
        return self._stream("/v1/completions", body, cancel)

    # -- request and stream ----------------------------------------------------------------
    def _body(self, params: SamplingParams, opts: DecodeOptions | None, chat: bool) -> dict[str, Any]:
        flavour = self.flavour
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "seed": params.seed,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if params.top_p is not None:
            body["top_p"] = params.top_p
        if params.top_k:
            if flavour == "openai":
                raise ConfigError("top-k is not part of the OpenAI API; this server may not support it")
            body["top_k"] = params.top_k
        if params.stop_strings:
            body["stop"] = list(params.stop_strings)
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        if params.ignore_eos:
            body["ignore_eos"] = True
        opts = opts or DecodeOptions()
        if opts != DecodeOptions():
            if flavour != "dflash":
                raise ConfigError(
                    f"--decoder/--block-size/--verify-length are set when a {flavour} server starts, "
                    "not per request; only dflash serve takes them per request"
                )
            body["dflash"] = {
                "decoder": opts.decoder,
                "block_size": opts.block_size,
                "verify_length": opts.verify_length,
            }
            if opts.tree_budget is not None:
                body["dflash"]["tree_budget"] = opts.tree_budget
        if flavour in ("vllm", "sglang") and chat:
            body["chat_template_kwargs"] = {"enable_thinking": False}  # DFlash drafters were trained without
        if flavour == "sglang":
            body["return_spec_tokens_details"] = True
        return body

    def _scrape(self) -> dict[str, float] | None:
        try:
            with self._open("/metrics") as resp:
                return parse_prometheus(resp.read().decode("utf-8", "replace"), (*VLLM_COUNTERS, VLLM_PER_POS))
        except DFlashError:
            return None

    def _stream(self, path: str, body: dict[str, Any], cancel: CancelToken | None) -> Iterator[DecodeEvent]:
        before = self._scrape() if self.flavour == "vllm" and not self._vllm_per_request else None
        t0 = time.perf_counter()
        resp = self._open(path, body)
        return self._events(resp, t0, before, cancel, chat=path.endswith("chat/completions"))

    def _events(
        self, resp: Any, t0: float, before: dict[str, float] | None, cancel: CancelToken | None, chat: bool
    ) -> Iterator[DecodeEvent]:
        prefilled = False
        done: Finished | None = None
        finish: str | None = None
        usage: dict[str, Any] = {}
        spec: _Spec | None = None
        first_at: float | None = None
        last = t0
        chunks = 0
        try:
            for data in _sse_data(resp):
                if cancel is not None and cancel.cancelled:
                    finish = "cancelled"
                    break
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    raise RemoteError(f"the server sent a chunk that is not JSON: {data[:200]!r}") from None
                if not isinstance(chunk, dict):
                    continue
                if "error" in chunk:
                    raise RemoteError(f"the server failed while generating: {_error_message(data.encode())}")
                ext = chunk.get("dflash")
                if isinstance(ext, dict) and ext.get("type") in ("prefill", "block", "done"):
                    event = _event_from_ext(ext)
                    if isinstance(event, Finished):
                        done = event
                    else:
                        prefilled = prefilled or isinstance(event, PrefillDone)
                        yield event
                else:
                    text = _chunk_text(chunk, chat)
                    if text:
                        now = time.perf_counter()
                        tok = (TokenEvent(-1, text, TokenStatus.TARGET),)
                        chunks += 1
                        if not prefilled:
                            first_at, prefilled = now, True
                            yield PrefillDone(prompt_tokens=0, seconds=now - t0, tokens=tok)
                        else:
                            yield BlockVerified(draft=(), draft_text=(), accepted=0, tokens=tok, seconds=now - last)
                        last = now
                choices = chunk.get("choices") or []
                if choices and isinstance(choices[0], dict):
                    finish = choices[0].get("finish_reason") or finish
                    meta = choices[0].get("meta_info")
                    if isinstance(meta, dict):
                        spec = _spec_from_sglang(meta) or spec
                if isinstance(chunk.get("usage"), dict):
                    usage = chunk["usage"]
                metrics = chunk.get("metrics")
                if isinstance(metrics, dict) and isinstance(metrics.get("speculative_decoding"), dict):
                    spec = _spec_from_vllm(metrics["speculative_decoding"]) or spec
                    self._vllm_per_request = spec is not None or self._vllm_per_request
                sgl = chunk.get("sglext")
                if isinstance(sgl, dict) and sgl.get("spec_tokens_details"):
                    details = sgl["spec_tokens_details"]
                    details = details[0] if isinstance(details, list) and details else details
                    if isinstance(details, dict):
                        spec = _spec_from_sglang(details) or spec
        except (TimeoutError, OSError) as e:
            raise RemoteError(f"the connection to {self.url} failed mid-stream: {e}") from None
        finally:
            resp.close()
        if not prefilled:
            yield PrefillDone(
                prompt_tokens=int(usage.get("prompt_tokens") or 0), seconds=time.perf_counter() - t0, tokens=()
            )
        if done is not None and finish != "cancelled":
            yield done
            return
        if finish is None:
            raise RemoteError(f"the server at {self.url} closed the stream before the generation finished")
        if spec is None and before is not None and finish != "cancelled":
            after = self._scrape()
            spec = _spec_from_counter_delta(before, after) if after is not None else None
        total = time.perf_counter() - t0
        ttft = (first_at - t0) if first_at is not None else total
        generated = int(usage.get("completion_tokens") or chunks)
        reason: FinishReason = "cancelled" if finish == "cancelled" else ("length" if finish == "length" else "stop")
        yield Finished(reason=reason, stats=_remote_stats(usage, generated, ttft, total, spec))


def _remote_stats(
    usage: dict[str, Any], generated: int, ttft: float, total: float, spec: _Spec | None
) -> GenerationStats:
    decode_time = max(total - ttft, 1e-9)
    base: dict[str, Any] = dict(
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        generated_tokens=generated,
        ttft_seconds=ttft,
        total_seconds=total,
        tokens_per_second=generated / max(total, 1e-9),
        decode_tokens_per_second=max(generated - 1, 0) / decode_time,
    )
    if spec is None:
        return GenerationStats(
            **base,
            verify_steps=0,
            drafted_tokens=0,
            accepted_tokens=0,
            tau=1.0,
            acceptance_rate=0.0,
            per_position_acceptance=(),
            acceptance_histogram=(),
            block_size=1,
            verify_length=0,
            decoder="remote",
        )
    tau = spec.tau if spec.tau is not None else (spec.accepted + spec.steps) / spec.steps
    return GenerationStats(
        **base,
        verify_steps=spec.steps,
        drafted_tokens=spec.drafted,
        accepted_tokens=spec.accepted,
        tau=tau,
        acceptance_rate=spec.accepted / spec.drafted if spec.drafted else 0.0,
        per_position_acceptance=spec.per_position,
        acceptance_histogram=spec.histogram,
        block_size=spec.draft_len + 1 if spec.draft_len else 0,
        verify_length=spec.draft_len,
        decoder="dflash",
    )


def _event_from_ext(ext: dict[str, Any]) -> DecodeEvent:
    """dflash serve's extension field (``event_to_json`` plus ``draft_text``) back into an event."""
    kind = ext["type"]
    if kind == "prefill":
        return PrefillDone(
            prompt_tokens=int(ext.get("prompt_tokens", 0)),
            seconds=float(ext.get("ttft", 0.0)),
            tokens=tuple(_token(t) for t in ext.get("tokens", [])),
        )
    if kind == "block":
        tokens = tuple(_token(t) for t in ext.get("tokens", []))
        accepted = int(ext.get("accepted", 0))
        draft_text = ext.get("draft_text")
        if draft_text is None:
            draft_text = [t.text for t in tokens[:accepted]] + list(ext.get("rejected_text", []))
        return BlockVerified(
            draft=tuple(int(i) for i in ext.get("draft", [])),
            draft_text=tuple(str(s) for s in draft_text),
            accepted=accepted,
            tokens=tokens,
            seconds=float(ext.get("seconds", 0.0)),
            parents=tuple(int(i) for i in ext.get("parents", [])),
            path=tuple(int(i) for i in ext.get("path", [])),
        )
    return Finished(reason=ext.get("reason", "stop"), stats=_stats_from_json(ext.get("stats", {})))


def _chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    c = choices[0]
    if chat:
        delta = c.get("delta") or c.get("message") or {}
        return str(delta.get("content") or "") if isinstance(delta, dict) else ""
    return str(c.get("text") or "")


def _sse_data(resp: Any) -> Iterator[str]:
    """The ``data`` payloads of a server-sent-event stream (multi-line data joined with newlines).

    A plain JSON body (a server that ignored ``stream: true``) is yielded whole.
    """
    ctype = resp.headers.get("Content-Type", "") if getattr(resp, "headers", None) else ""
    if "text/event-stream" not in ctype:
        yield resp.read().decode("utf-8", "replace")
        yield "[DONE]"
        return
    buf: list[str] = []
    for raw in resp:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if buf:
                yield "\n".join(buf)
                buf = []
            continue
        if line.startswith(":"):
            continue  # comment / keep-alive
        field_name, _, value = line.partition(":")
        if field_name == "data":
            buf.append(value[1:] if value.startswith(" ") else value)
    if buf:
        yield "\n".join(buf)
