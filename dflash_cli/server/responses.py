"""The OpenAI-compatible responses of ``dflash serve``: the JSON body of a completion, streamed
chunks (each with the runtime event it came from in ``dflash``) and the final usage chunk.
Requests are validated in ``protocol``."""

from __future__ import annotations

import time
import uuid
from typing import Any

from runtime.engine.events import BlockVerified, DecodeEvent, GenerationStats, event_to_json

from .protocol import ParsedRequest

FINISH = {"stop": "stop", "length": "length", "cancelled": "abort"}


def new_id(kind: str) -> str:
    """``chatcmpl-...`` or ``cmpl-...``."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(stats: GenerationStats) -> dict[str, Any]:
    """OpenAI usage numbers (``prompt_tokens_details.cached_tokens``: what the prompt cache held)."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.tokens_cached},
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
