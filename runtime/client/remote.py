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

The transport is ``runtime.client.http``; what each flavour sends and how its statistics are read,
``runtime.client.flavours``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from runtime.backend import Capabilities
from runtime.client.flavours import (
    VLLM_COUNTERS,
    VLLM_PER_POS,
    ServerInfo,
    Spec,
    llamacpp_stats,
    parse_prometheus,
    remote_stats,
    server_info,
    spec_from_counter_delta,
    spec_from_sglang,
    spec_from_vllm,
)
from runtime.client.http import HttpTransport, RemoteError, error_message, sse_data
from runtime.config import DecodeOptions, SamplingParams
from runtime.engine import CancelToken
from runtime.engine.events import (
    BlockVerified,
    DecodeEvent,
    Finished,
    FinishReason,
    PrefillDone,
    TokenEvent,
    TokenStatus,
    event_from_json,
)
from runtime.errors import ConfigError, DFlashError, InputError

if TYPE_CHECKING:
    import httpx


class RemoteBackend(HttpTransport):
    """A ``Backend`` over an OpenAI-compatible server.

    Args:
        url: server root (``http://host:port``; a trailing ``/v1`` is accepted).
        api_key: sent as ``Authorization: Bearer`` (None: no header).
        model: model id to request (None: the first one ``/v1/models`` lists).
        timeout: seconds to wait for a connection or for the next chunk (a queued request waits).
    """

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None, timeout: float = 600.0) -> None:
        super().__init__(url, api_key, timeout)
        self._model = model
        self._info: ServerInfo | None = None
        self._vllm_per_request = False  # vLLM sent per-request metrics once: skip /metrics scraping

    def _served_models(self) -> tuple[str, ...]:
        return self.info().models

    # -- server description ----------------------------------------------------------------
    def info(self) -> ServerInfo:
        """Served models and the server's flavour (fetched once from ``/v1/models``)."""
        if self._info is None:
            doc = self._get_json("/v1/models")
            try:
                self._info = server_info(doc, self.url)
            except ValueError as e:
                raise RemoteError(str(e)) from None
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
        if flavour != "dflash" and _shapes_decoding(opts):
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
        if _shapes_decoding(opts):
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
        spec: Spec | None = None
        first_at: float | None = None
        last = t0
        chunks = 0
        try:
            for data in sse_data(resp):
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
                    raise RemoteError(f"the server failed while generating: {error_message(data.encode())}")
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
                        spec = spec_from_sglang(meta) or spec
                if isinstance(chunk.get("usage"), dict):
                    usage = chunk["usage"]
                if isinstance(chunk.get("timings"), dict):
                    timings = chunk["timings"]
                metrics = chunk.get("metrics")
                if isinstance(metrics, dict) and isinstance(metrics.get("speculative_decoding"), dict):
                    spec = spec_from_vllm(metrics["speculative_decoding"]) or spec
                    self._vllm_per_request = spec is not None or self._vllm_per_request
                sgl = chunk.get("sglext")
                if isinstance(sgl, dict) and sgl.get("spec_tokens_details"):
                    details = sgl["spec_tokens_details"]
                    details = details[0] if isinstance(details, list) and details else details
                    if isinstance(details, dict):
                        spec = spec_from_sglang(details) or spec
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
            spec = spec_from_counter_delta(before, after) if after is not None else None
        total = time.perf_counter() - t0
        ttft = (first_at - t0) if first_at is not None else total
        generated = int(usage.get("completion_tokens") or chunks)
        reason: FinishReason = "cancelled" if finish == "cancelled" else ("length" if finish == "length" else "stop")
        if timings is not None and "predicted_ms" in timings:
            yield Finished(reason=reason, stats=llamacpp_stats(usage, generated, timings))
            return
        yield Finished(reason=reason, stats=remote_stats(usage, generated, ttft, total, spec))


def _chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    c = choices[0]
    if chat:
        delta = c.get("delta") or c.get("message") or {}
        return str(delta.get("content") or "") if isinstance(delta, dict) else ""
    return str(c.get("text") or "")


def _shapes_decoding(opts: DecodeOptions) -> bool:
    """Whether ``opts`` ask for a decoder, block, verify length, tree or lookup of their own: what a
    dflash server takes per request and other servers only at start. (The confidence cut and the
    prompt cache are the serving process's business.)"""
    d = DecodeOptions()
    asked = (opts.decoder, opts.block_size, opts.verify_length, opts.tree_budget, opts.lookup)
    return asked != (d.decoder, d.block_size, d.verify_length, d.tree_budget, d.lookup)
