"""The OpenAI-compatible wire format of ``dflash serve``: request validation, response and chunk
builders, OpenAI-style errors.

Extensions (ignored by OpenAI clients):
  request  ``top_k``, ``ignore_eos``, ``stop_token_ids`` (as in vLLM/SGLang) and
           ``dflash: {"decoder": "dflash"|"ar", "block_size": n, "verify_length": k, "tree_budget": B}``.
  response ``dflash: {"stats": GenerationStats, "queue": {...}}``; every streamed chunk carries the
           runtime event it came from in ``dflash`` (``event_to_json`` of ``dflash run --json``,
           plus ``draft_text``), so clients can colour tokens by origin.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from runtime import ConfigError, DecodeOptions, SamplingParams
from runtime.engine.events import BlockVerified, DecodeEvent, GenerationStats, event_to_json

MAX_STOP_STRINGS = 16
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
FINISH = {"stop": "stop", "length": "length", "cancelled": "abort"}


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        """The JSON error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 invalid_request_error."""
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class Limits:
    """Per-request limits.

    Attributes:
        max_tokens: most new tokens one request may ask for (also the default).
        max_body_bytes: largest request body.
    """

    max_tokens: int = 4096
    max_body_bytes: int = 4 * 1024 * 1024


@dataclass(frozen=True)
class ParsedRequest:
    """A validated completion or chat request."""

    kind: str  # "chat" | "completion"
    model: str
    params: SamplingParams
    opts: DecodeOptions
    stream: bool
    include_usage: bool
    messages: tuple[dict[str, str], ...] = ()
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(body: dict[str, Any], key: str, lo: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_int(v) or (lo is not None and v < lo):
        raise bad(f"'{key}' must be an integer" + (f" >= {lo}" if lo is not None else "") + f", got {v!r}", key)
    return int(v)


def _num(body: dict[str, Any], key: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_num(v):
        raise bad(f"'{key}' must be a number, got {v!r}", key)
    return float(v)


def _bool(body: dict[str, Any], key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be true or false, got {v!r}", key)
    return v


def _text_content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}: only text content parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{where}: 'content' must be a string or a list of text parts", "messages")


def _messages(raw: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages", "empty_messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of system, user, assistant (got {role!r})", "messages")
        if m.get("tool_calls"):
            raise bad("tool calls are not supported by dflash serve", "messages")
        out.append({"role": ROLES[role], "content": _text_content(m.get("content"), f"messages[{i}]")})
    return tuple(out)


def _prompt(raw: Any) -> tuple[str | None, tuple[int, ...] | None]:
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]  # a batch of one
    if isinstance(raw, str):
        if not raw.strip():
            raise bad("'prompt' is empty", "prompt", "empty_prompt")
        return raw, None
    if isinstance(raw, list) and raw and all(_is_int(x) and x >= 0 for x in raw):
        return None, tuple(int(x) for x in raw)
    if isinstance(raw, list) and raw and all(isinstance(x, (str, list)) for x in raw):
        raise bad("batched prompts are not supported: send one prompt per request", "prompt")
    raise bad("'prompt' must be a non-empty string or a list of token ids", "prompt", "empty_prompt")


def _unsupported(body: dict[str, Any]) -> None:
    if body.get("logprobs") or body.get("top_logprobs"):
        raise bad("logprobs are not supported by dflash serve", "logprobs")
    if body.get("echo"):
        raise bad("'echo' is not supported by dflash serve", "echo")
    if body.get("suffix"):
        raise bad("'suffix' (fill-in-the-middle) is not supported by dflash serve", "suffix")
    if body.get("tools") or body.get("functions"):
        raise bad("tools and functions are not supported by dflash serve", "tools")
    for key in ("presence_penalty", "frequency_penalty"):
        v = body.get(key)
        if v not in (None, 0, 0.0):
            raise bad(f"'{key}' is not supported by dflash serve (only 0)", key)
    if body.get("logit_bias"):
        raise bad("'logit_bias' is not supported by dflash serve", "logit_bias")
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise bad("only n=1 is supported (the runtime generates one sequence at a time)", "n")
    best_of = body.get("best_of")
    if best_of not in (None, 1):
        raise bad("only best_of=1 is supported", "best_of")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in (None, "text")):
        raise bad("only response_format {'type': 'text'} is supported", "response_format")


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}", "stop")
    return tuple(stop)


def _decode_options(raw: Any, default: DecodeOptions) -> DecodeOptions:
    if raw is None:
        return default
    if not isinstance(raw, dict):
        raise bad("'dflash' must be an object like {'decoder': 'ar'}", "dflash")
    kw: dict[str, Any] = {}
    for key in ("decoder", "block_size", "verify_length", "tree_budget"):
        if raw.get(key) is not None:
            v = raw[key]
            if key != "decoder" and not _is_int(v):
                raise bad(f"'dflash.{key}' must be an integer, got {v!r}", f"dflash.{key}")
            kw[key] = v
    try:
        return replace(default, **kw)
    except ConfigError as e:
        raise bad(str(e), "dflash") from None


def parse_request(
    body: Any, kind: str, served: tuple[str, ...], limits: Limits, default_opts: DecodeOptions
) -> ParsedRequest:
    """Validate a ``/v1/chat/completions`` (kind "chat") or ``/v1/completions`` body.

    Raises:
        APIError: 400 for malformed or unsupported fields, 404 for an unknown model.
    """
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if model is None or model == "":
        model = served[0]
    if not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    if model not in served:
        raise APIError(
            404,
            f"The model `{model}` does not exist. This server serves: {', '.join(served)}.",
            param="model",
            code="model_not_found",
        )
    _unsupported(body)
    messages: tuple[dict[str, str], ...] = ()
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    if kind == "chat":
        messages = _messages(body.get("messages"))
    else:
        prompt, prompt_ids = _prompt(body.get("prompt"))
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    if max_tokens is None:
        max_tokens = limits.max_tokens
    if max_tokens > limits.max_tokens:
        raise bad(
            f"max_tokens is {max_tokens} but this server allows at most {limits.max_tokens} new tokens per request",
            "max_tokens",
            "max_tokens_exceeded",
        )
    temperature = _num(body, "temperature")
    if temperature is not None and not 0.0 <= temperature <= 2.0:
        raise bad(f"'temperature' must be in [0, 2], got {temperature}", "temperature")
    top_k = _int(body, "top_k")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(i) and i >= 0 for i in stop_ids):
        raise bad("'stop_token_ids' must be a list of token ids", "stop_token_ids")
    seed = _int(body, "seed")
    stream = _bool(body, "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    try:
        params = SamplingParams(
            temperature=1.0 if temperature is None else temperature,
            top_k=None if top_k is None or top_k < 0 else top_k,
            top_p=_num(body, "top_p"),
            seed=0 if seed is None else seed,
            max_new_tokens=max_tokens,
            stop_token_ids=tuple(stop_ids),
            stop_strings=_stop(body),
            ignore_eos=_bool(body, "ignore_eos"),
        )
    except ConfigError as e:
        raise bad(str(e)) from None
    return ParsedRequest(
        kind=kind,
        model=model,
        params=params,
        opts=_decode_options(body.get("dflash"), default_opts),
        stream=stream,
        include_usage=_bool(opts, "include_usage"),
        messages=messages,
        prompt=prompt,
        prompt_ids=prompt_ids,
    )


# -- responses ---------------------------------------------------------------------------------
def new_id(kind: str) -> str:
    """``chatcmpl-...`` or ``cmpl-...``."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(stats: GenerationStats) -> dict[str, int]:
    """OpenAI usage numbers."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
    }


def event_ext(event: DecodeEvent) -> dict[str, Any]:
    """The runtime event as it rides in a chunk's ``dflash`` field."""
    d = event_to_json(event)
    if isinstance(event, BlockVerified):
        d["draft_text"] = list(event.draft_text)
    return d


def response(
    req: ParsedRequest, rid: str, created: int, text: str, reason: str, stats: GenerationStats, queue: dict[str, Any]
) -> dict[str, Any]:
    """A complete (non-streamed) response."""
    finish = FINISH.get(reason, "stop")
    if req.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": req.model,
        "choices": [choice],
        "usage": usage(stats),
        "dflash": {"stats": stats.to_json(), "queue": queue},
    }


def chunk(
    req: ParsedRequest,
    rid: str,
    created: int,
    text: str | None,
    finish: str | None = None,
    ext: dict[str, Any] | None = None,
    role: bool = False,
) -> dict[str, Any]:
    """One streamed chunk (``text`` None: no content field)."""
    if req.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    out: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice]}
    if ext is not None:
        out["dflash"] = ext
    return out


def usage_chunk(req: ParsedRequest, rid: str, created: int, stats: GenerationStats) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage`` is set: no choices, usage."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [], "usage": usage(stats)}


def now() -> int:
    """``created`` timestamp."""
    return int(time.time())
