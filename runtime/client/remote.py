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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client.parser import text_string_to_metric_families

from runtime.backend import Capabilities
from runtime.config import DecodeOptions, SamplingParams
from runtime.engine import CancelToken
from runtime.engine.acceptance import AcceptanceCounts
from runtime.engine.events import (
    BlockVerified,
    DecodeEvent,
    Finished,
    FinishReason,
    GenerationStats,
    PrefillDone,
    TokenEvent,
    TokenStatus,
    event_from_json,
)
from runtime.errors import ConfigError, DFlashError, InputError, ModelNotFoundError

if TYPE_CHECKING:
    # httpx (and httpx-sse, which imports it) is imported where a request is made: `import httpx`
    # also imports its command line, i.e. click and rich (87 of its 119 ms, measured with -X
    # importtime), and importing the runtime must load no UI package (tests/test_boundary.py).
    import httpx

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


@dataclass(frozen=True)
class _Spec:
    """Speculative-decoding counts a server reported for one request."""

    counts: AcceptanceCounts
    draft_len: int = 0  # drafts per verify step (0: unknown)


def _spec_from_vllm(m: dict[str, Any]) -> _Spec | None:
    try:
        counts = AcceptanceCounts.from_totals(
            int(m["num_spec_steps"]),
            int(m["num_draft_tokens"]),
            int(m["num_accepted_draft_tokens"]),
            m.get("acceptance_histogram") or (),
        )
        return _Spec(counts, draft_len=int(m.get("num_spec_tokens") or 0))
    except (KeyError, TypeError, ValueError):
        return None


def _spec_from_llamacpp(t: dict[str, Any], generated: int) -> _Spec | None:
    """llama.cpp's ``timings`` (``draft_n``, ``draft_n_accepted``): it reports no step count, but each
    verify step commits its accepted drafts plus one token, so steps = generated - accepted."""
    try:
        drafted, accepted = int(t.get("draft_n") or 0), int(t.get("draft_n_accepted") or 0)
    except (TypeError, ValueError):
        return None
    if drafted <= 0:
        return None
    steps = max(generated - 1 - accepted, 1)  # the first token comes from the prompt pass
    return _Spec(AcceptanceCounts.from_totals(steps, drafted, accepted))


def _spec_from_sglang(d: dict[str, Any]) -> _Spec | None:
    steps = int(d.get("spec_verify_ct") or 0)
    if steps <= 0:
        return None
    drafted = int(d.get("spec_num_proposed_drafts") or 0)
    counts = AcceptanceCounts.from_totals(
        steps, drafted, int(d.get("spec_num_correct_drafts") or 0), d.get("spec_correct_drafts_histogram") or ()
    )
    return _Spec(counts, draft_len=drafted // steps if drafted else 0)


def parse_prometheus(text: str, names: Sequence[str]) -> dict[str, float]:
    """Sum the samples of the named metrics over all label sets (``prometheus_client``'s parser;
    the ``position`` label is kept as ``name[pos]``, used by vLLM's per-position counter).
    Text the parser rejects ends the reading (what was read before it is kept)."""
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name not in names:
                    continue
                pos = sample.labels.get("position")
                key = sample.name if pos is None else f"{sample.name}[{pos}]"
                out[key] = out.get(key, 0.0) + float(sample.value)
    except ValueError:
        pass
    return out


def _spec_from_counter_delta(before: dict[str, float], after: dict[str, float]) -> _Spec | None:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = int(d.get(VLLM_COUNTERS[0], 0))
    if steps <= 0:
        return None
    per_pos = []
    i = 0
    while f"{VLLM_PER_POS}[{i}]" in d:
        per_pos.append(int(d[f"{VLLM_PER_POS}[{i}]"]))
        i += 1
    drafted = int(d.get(VLLM_COUNTERS[1], 0))
    counts = AcceptanceCounts.from_totals(steps, drafted, int(d.get(VLLM_COUNTERS[2], 0)), slot_accepted=per_pos)
    return _Spec(counts, draft_len=drafted // steps)


def _error_message(body: bytes) -> str:
    """The ``message`` of an OpenAI-style error body (else the body's first 300 characters)."""
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
        self._http: httpx.Client | None = None

    # -- HTTP ------------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        h = {"Accept": "application/json, text/event-stream", "User-Agent": "dflash"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    @property
    def _client(self) -> httpx.Client:
        import httpx

        # One connection pool per backend (httpx clients are thread-safe); proxies and CA
        # certificates from the environment apply as they did with urllib.
        if self._http is None:
            self._http = httpx.Client(base_url=self.url, headers=self._headers(), timeout=self.timeout)
        return self._http

    def close(self) -> None:
        """Close the connection pool (a later request opens a new one)."""
        if self._http is not None:
            self._http.close()
            self._http = None

    def _open(self, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        """Send a request and return the response with its body not read yet (the caller closes it).

        Raises:
            RemoteError: the server cannot be reached; the error ``_http_error`` maps a status to.
        """
        import httpx

        try:
            req = self._client.build_request("POST" if body is not None else "GET", path, json=body)
            resp = self._client.send(req, stream=True)
        except httpx.TransportError as e:
            raise RemoteError(
                f"cannot reach the server at {self.url}: {e or type(e).__name__}; is it running?"
            ) from None
        if resp.status_code >= 400:
            try:
                message = _error_message(resp.read())
            except httpx.TransportError:
                message = resp.reason_phrase
            finally:
                resp.close()
            raise self._http_error(resp.status_code, message, path)
        return resp

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
        import httpx

        resp = self._open(path)
        try:
            return json.loads(resp.read())
        except httpx.TransportError as e:
            raise RemoteError(f"the connection to {self.url} failed: {e or type(e).__name__}") from None
        except ValueError:
            raise RemoteError(f"{self.url}{path} did not answer JSON: is it an OpenAI-compatible server?") from None
        finally:
            resp.close()

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
    def capabilities(self) -> Capabilities:
        """Only dflash serve sends token origins; its model card says whether the pair has a
        tokenizer and a chat template (other servers: both assumed)."""
        info = self.info()
        return Capabilities(
            per_token_origin=info.flavour == "dflash",
            tokenizer=bool(info.details.get("tokenizer", True)),
            chat_template=bool(info.details.get("chat_template", True)),
        )

    def check_decode_options(self, opts: DecodeOptions) -> None:
        """Refuse decode options the server cannot take per request (before any request).

        Raises:
            ConfigError: options other than the defaults on a server that is not dflash serve.
        """
        flavour = self.flavour
        if flavour != "dflash" and opts != DecodeOptions():
            raise ConfigError(
                f"--decoder/--block-size/--verify-length are set when a {flavour} server starts, "
                "not per request; only dflash serve takes them per request"
            )

    def describe(self) -> dict[str, Any]:
        """Server, flavour and model; dflash serve adds its pipeline's description."""
        info = self.info()
        d: dict[str, Any] = {"target": self.model, "drafter": None, "block_size": None, **info.details}
        d.update({"engine": info.flavour, "server": self.url, "model": self.model})
        d["per_token_status"] = info.flavour == "dflash"
        return d

    # -- Backend protocol ------------------------------------------------------------------
    def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        opts: DecodeOptions | None = None,
        cancel: CancelToken | None = None,
        *,
        chat: bool | None = None,
        system: str | None = None,
    ) -> Iterator[DecodeEvent]:
        """Complete text (chat endpoint unless ``chat`` is False; dflash serve: its model decides)
        or token ids (``stream_ids``)."""
        if not isinstance(prompt, str):
            return self.stream_ids(prompt, params, opts, cancel)
        if not prompt.strip():
            raise InputError("the prompt is empty; pass text as an argument or on stdin")
        if chat is None:
            chat = self.capabilities.chat_template
        if chat:
            messages = [{"role": "system", "content": system}] if system else []
            return self.stream_messages([*messages, {"role": "user", "content": prompt}], params, opts, cancel)
        return self._stream("/v1/completions", {"prompt": prompt, **self._body(params, opts, chat=False)}, cancel)

    def stream_messages(
        self,
        messages: Sequence[Mapping[str, str]],
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
        self.check_decode_options(opts)
        if opts != DecodeOptions():
            body["dflash"] = {
                "decoder": opts.decoder,
                "block_size": opts.block_size,
                "verify_length": opts.verify_length,
            }
            if opts.tree_budget is not None:
                body["dflash"]["tree_budget"] = opts.tree_budget
            if opts.lookup is not None:
                body["dflash"]["lookup"] = opts.lookup
        if flavour in ("vllm", "sglang") and chat:
            body["chat_template_kwargs"] = {"enable_thinking": False}  # DFlash drafters were trained without
        if flavour == "sglang":
            body["return_spec_tokens_details"] = True
        return body

    def _scrape(self) -> dict[str, float] | None:
        import httpx

        try:
            resp = self._open("/metrics")
            try:
                text = resp.read().decode("utf-8", "replace")
            finally:
                resp.close()
            return parse_prometheus(text, (*VLLM_COUNTERS, VLLM_PER_POS))
        except (DFlashError, httpx.TransportError):
            return None

    def _stream(self, path: str, body: dict[str, Any], cancel: CancelToken | None) -> Iterator[DecodeEvent]:
        before = self._scrape() if self.flavour == "vllm" and not self._vllm_per_request else None
        t0 = time.perf_counter()
        resp = self._open(path, body)
        return self._events(resp, t0, before, cancel, chat=path.endswith("chat/completions"))

    def _events(
        self, resp: httpx.Response, t0: float, before: dict[str, float] | None, cancel: CancelToken | None, chat: bool
    ) -> Iterator[DecodeEvent]:
        import httpx

        prefilled = False
        done: Finished | None = None
        finish: str | None = None
        usage: dict[str, Any] = {}
        timings: dict[str, Any] | None = None  # llama.cpp's own server-side timings
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
                    event = event_from_json(ext)
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
                if isinstance(chunk.get("timings"), dict):
                    timings = chunk["timings"]
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
        except httpx.TransportError as e:
            raise RemoteError(f"the connection to {self.url} failed mid-stream: {e or type(e).__name__}") from None
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
        if timings is not None and "predicted_ms" in timings:
            yield Finished(reason=reason, stats=_llamacpp_stats(usage, generated, timings))
            return
        yield Finished(reason=reason, stats=_remote_stats(usage, generated, ttft, total, spec))


def _llamacpp_stats(usage: dict[str, Any], generated: int, t: dict[str, Any]) -> GenerationStats:
    """Statistics from llama.cpp's own ``timings``: prompt and decode times measured in the server
    (``prompt_ms``, ``predicted_ms``; decode tok/s = ``predicted_per_second``), drafts and accepted
    drafts of its speculative modes. ``decoder`` is "llama.cpp" so that bench uses these times."""
    prompt_s = float(t.get("prompt_ms") or 0.0) / 1000
    decode_s = float(t.get("predicted_ms") or 0.0) / 1000
    n = int(t.get("predicted_n") or generated)
    spec = _spec_from_llamacpp(t, n)
    return GenerationStats(
        prompt_tokens=int(t.get("prompt_n") or usage.get("prompt_tokens") or 0),
        generated_tokens=n,
        ttft_seconds=prompt_s,
        total_seconds=prompt_s + decode_s,
        tokens_per_second=n / max(prompt_s + decode_s, 1e-9),
        decode_tokens_per_second=float(t.get("predicted_per_second") or n / max(decode_s, 1e-9)),
        acceptance=spec.counts if spec is not None else AcceptanceCounts(),
        block_size=1,
        verify_length=0,
        decoder="llama.cpp",
    )


def _remote_stats(
    usage: dict[str, Any], generated: int, ttft: float, total: float, spec: _Spec | None
) -> GenerationStats:
    decode_time = max(total - ttft, 1e-9)
    return GenerationStats(
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        generated_tokens=generated,
        ttft_seconds=ttft,
        total_seconds=total,
        tokens_per_second=generated / max(total, 1e-9),
        decode_tokens_per_second=max(generated - 1, 0) / decode_time,
        acceptance=spec.counts if spec is not None else AcceptanceCounts(),
        block_size=(spec.draft_len + 1 if spec.draft_len else 0) if spec is not None else 1,
        verify_length=spec.draft_len if spec is not None else 0,
        decoder="dflash" if spec is not None else "remote",
    )


def _chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    c = choices[0]
    if chat:
        delta = c.get("delta") or c.get("message") or {}
        return str(delta.get("content") or "") if isinstance(delta, dict) else ""
    return str(c.get("text") or "")


def _sse_data(resp: httpx.Response) -> Iterator[str]:
    """The ``data`` payloads of a server-sent-event stream (``httpx-sse``).

    A plain JSON body (a server that ignored ``stream: true``) is yielded whole.
    """
    from httpx_sse import EventSource

    if "text/event-stream" not in resp.headers.get("content-type", ""):
        yield resp.read().decode("utf-8", "replace")
        yield "[DONE]"
        return
    for sse in EventSource(resp).iter_sse():
        yield sse.data
