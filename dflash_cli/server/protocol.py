"""The OpenAI-compatible wire format of ``dflash serve``: request validation and OpenAI-style
errors (responses and chunks are built in ``responses``).

Extensions (ignored by OpenAI clients):
  request  ``suffix`` on ``/v1/completions`` (fill in the middle: the prompt is the text before the
           hole, laid out with the target's FIM tokens by ``runtime.fim``);
           ``top_k``, ``ignore_eos``, ``stop_token_ids`` (as in vLLM/SGLang) and
           ``dflash: {"decoder": "dflash"|"ar", "block_size": n, "verify_length": k, "tree_budget": B,
           "lookup": L}``.
  response ``dflash: {"stats": GenerationStats, "queue": {...}}``; every streamed chunk carries the
           runtime event it came from in ``dflash`` (``event_to_json`` of ``dflash run --json``,
           plus ``draft_text``), so clients can colour tokens by origin.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from runtime import ConfigError, DecodeOptions, SamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # each stop string is matched against the text after every step
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


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
        max_block_size: largest ``dflash.block_size`` (the drafter's trained block; None: no cap).
    """

    max_tokens: int = 4096
    max_body_bytes: int = 4 * 1024 * 1024
    max_block_size: int | None = None


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
    suffix: str | None = None  # /v1/completions fill-in-the-middle: ``prompt`` is the prefix


# -- request schema (pydantic, strict: "1" is not a number, true is not an integer) -------------
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
EMPTY_CODES = {"messages": "empty_messages", "prompt": "empty_prompt"}
_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _unicode(text: str) -> str:
    """Reject lone surrogates (``"\\ud800"``): text must encode as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError(
            "invalid_text", "text is not valid Unicode (a lone surrogate at character {pos})", {"pos": e.start}
        ) from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]
StopText = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0)]


class _Schema(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields are ignored, as by OpenAI


class TextPart(_Schema):
    """A content part: only text."""

    type: Literal["text"]
    text: Text


class Message(_Schema):
    """One chat message."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None
    tool_calls: Any = None

    @field_validator("tool_calls")
    @classmethod
    def _no_tools(cls, v: Any) -> Any:
        if v:
            raise PydanticCustomError("unsupported", "tool calls are not supported by dflash serve")
        return v

    def text(self) -> str:
        """The content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


MAX_TREE_BUDGET = 128  # largest per-request dflash.tree_budget (docs/serve.md)
MAX_LOOKUP = 64  # largest per-request dflash.lookup (copied tokens also join the verify forward)


class DFlashOptions(BaseModel):
    """The request's ``dflash`` extension."""

    model_config = ConfigDict(strict=True, extra="forbid")
    decoder: Literal["dflash", "ar"] | None = None
    block_size: Annotated[int, Field(ge=1)] | None = None
    verify_length: Annotated[int, Field(ge=0)] | None = None
    # a tree of B nodes is verified in one forward: capped so that one request cannot make a huge step
    tree_budget: Annotated[int, Field(ge=0, le=MAX_TREE_BUDGET)] | None = None
    lookup: Annotated[int, Field(ge=0, le=MAX_LOOKUP)] | None = None


class StreamOptions(_Schema):
    """``stream_options``."""

    include_usage: bool | None = None


class _Request(_Schema):
    model: Text | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(allow_inf_nan=False)] | None = None
    top_k: int | None = None
    seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    dflash: DFlashOptions | None = None
    # OpenAI fields dflash serve does not support: accepted only at their neutral values
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
    suffix: Any = None
    tools: Any = None
    functions: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    n: Any = None
    best_of: Any = None
    response_format: Any = None

    @model_validator(mode="after")
    def _unsupported(self) -> _Request:
        checks = [
            ("logprobs", bool(self.logprobs or self.top_logprobs), "logprobs are not supported by dflash serve"),
            ("echo", bool(self.echo), "'echo' is not supported by dflash serve"),
            (
                "suffix",
                bool(self.suffix) and not isinstance(self, CompletionRequest),
                "'suffix' (fill-in-the-middle) is a /v1/completions field",
            ),
            ("tools", bool(self.tools or self.functions), "tools and functions are not supported by dflash serve"),
            ("logit_bias", bool(self.logit_bias), "'logit_bias' is not supported by dflash serve"),
            ("n", self.n not in (None, 1), "only n=1 is supported (the runtime generates one sequence at a time)"),
            ("best_of", self.best_of not in (None, 1), "only best_of=1 is supported"),
        ]
        for key in ("presence_penalty", "frequency_penalty"):
            checks.append((key, getattr(self, key) not in (None, 0, 0.0), f"'{key}' is not supported (only 0)"))
        fmt = self.response_format
        bad_fmt = fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in (None, "text"))
        checks.append(("response_format", bad_fmt, "only response_format {'type': 'text'} is supported"))
        for key, failed, message in checks:
            if failed:
                raise APIError(400, message, param=key)
        return self


class ChatRequest(_Request):
    """A ``/v1/chat/completions`` body."""

    messages: Annotated[list[Message], Field(min_length=1)]


class CompletionRequest(_Request):
    """A ``/v1/completions`` body (``prompt``: text, token ids, or a batch of one)."""

    prompt: Text | Annotated[list[TokenId], Field(min_length=1)] | list[Text] | list[list[TokenId]]
    suffix: Text | None = None  # fill in the middle: the prompt is the text before the hole

    @model_validator(mode="after")
    def _fim(self) -> CompletionRequest:
        if isinstance(self.prompt, str) and not self.prompt.strip() and not self.suffix:
            raise bad("'prompt': must not be empty", "prompt", "empty_prompt")
        if self.suffix and not isinstance(self.prompt, str):
            raise bad("'suffix' needs a text prompt (the text before the hole), not token ids", "suffix")
        return self

    @field_validator("prompt")
    @classmethod
    def _one(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise PydanticCustomError("batch", "batched prompts are not supported: send one prompt per request")
            v = v[0]
        if isinstance(v, list) and not v:
            raise PydanticCustomError("empty", "must be a non-empty string or a list of token ids")
        return v


def _validation_error(e: ValidationError) -> APIError:
    """The most specific problem of a pydantic error as an OpenAI-style 400."""

    def path(err: Any) -> list[str]:  # field names and indices; union member tags dropped
        return [str(x) for x in err["loc"] if isinstance(x, int) or _FIELD.fullmatch(str(x))]

    errors = e.errors(include_url=False)
    err = max(errors, key=lambda x: (len(path(x)), not x["type"].endswith("_type")))
    loc = path(err)
    if not loc:
        return bad("the request body must be a JSON object")
    top = loc[0]
    param = ".".join(loc[:2]) if top == "dflash" and len(loc) > 1 else top
    where = "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in loc).lstrip(".")
    code = EMPTY_CODES.get(top) if err["type"] in ("missing", "too_short", "empty") and len(loc) == 1 else None
    given = err.get("input")
    custom = err["type"] in ("unsupported", "batch", "empty", "invalid_text", "missing")
    shown = "" if custom or given is None else f" (got {given!r:.60})"
    return bad(f"'{where}': {err['msg']}{shown}", param, code)


def parse_request(
    body: Any, kind: str, served: tuple[str, ...], limits: Limits, default_opts: DecodeOptions
) -> ParsedRequest:
    """Validate a ``/v1/chat/completions`` (kind "chat") or ``/v1/completions`` body.

    Structure and types are checked by the pydantic schema (``ChatRequest``/``CompletionRequest``);
    limits of this server (``max_tokens``, ``max_block_size``) and the runtime's own checks follow.

    Raises:
        APIError: 400 for malformed or unsupported fields, 404 for an unknown model.
    """
    schema = ChatRequest if kind == "chat" else CompletionRequest
    if isinstance(body, dict) and kind == "chat" and body.get("messages") in (None, []):
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages", "empty_messages")
    try:
        r = schema.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    model = r.model or served[0]
    if model not in served:
        raise APIError(
            404,
            f"The model `{model}` does not exist. This server serves: {', '.join(served)}.",
            param="model",
            code="model_not_found",
        )
    messages: tuple[dict[str, str], ...] = ()
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    suffix: str | None = None
    if isinstance(r, ChatRequest):
        messages = tuple({"role": ROLES[m.role], "content": m.text()} for m in r.messages)
    else:
        assert isinstance(r, CompletionRequest)
        if isinstance(r.prompt, str):
            prompt = r.prompt
            suffix = r.suffix or None
        else:
            prompt_ids = tuple(int(x) for x in r.prompt)  # type: ignore[arg-type]
    max_tokens = r.max_completion_tokens or r.max_tokens or limits.max_tokens
    if max_tokens > limits.max_tokens:
        raise bad(
            f"max_tokens is {max_tokens} but this server allows at most {limits.max_tokens} new tokens per request",
            "max_tokens",
            "max_tokens_exceeded",
        )
    stop = (r.stop,) if isinstance(r.stop, str) else tuple(r.stop or ())
    try:
        params = SamplingParams(
            temperature=1.0 if r.temperature is None else r.temperature,
            top_k=None if r.top_k is None or r.top_k < 0 else r.top_k,
            top_p=r.top_p,
            seed=0 if r.seed is None else r.seed,
            max_new_tokens=max_tokens,
            stop_token_ids=tuple(r.stop_token_ids or ()),
            stop_strings=stop,
            ignore_eos=bool(r.ignore_eos),
        )
    except ConfigError as e:
        raise bad(str(e)) from None
    return ParsedRequest(
        kind=kind,
        model=model,
        params=params,
        opts=_decode_options(r.dflash, default_opts, limits),
        stream=bool(r.stream),
        include_usage=bool(r.stream_options and r.stream_options.include_usage),
        messages=messages,
        prompt=prompt,
        prompt_ids=prompt_ids,
        suffix=suffix,
    )


def _decode_options(raw: DFlashOptions | None, default: DecodeOptions, limits: Limits) -> DecodeOptions:
    if raw is None:
        return default
    kw = {k: v for k, v in raw.model_dump().items() if v is not None}
    cap = limits.max_block_size
    if cap is not None and kw.get("block_size", 0) > cap:
        raise bad(
            f"'dflash.block_size' is {kw['block_size']} but this server's drafter was trained for blocks of at "
            f"most {cap} tokens; send a block_size of 1..{cap}",
            "dflash.block_size",
            "block_size_exceeded",
        )
    try:
        return replace(default, **kw)
    except ConfigError as e:
        raise bad(str(e), "dflash") from None
