"""The wire formats editor plugins speak, beside the OpenAI one of ``protocol``: llama.cpp's
``POST /infill`` and ``POST /completion`` (llama.vim, llama.vscode, Tabby, twinny) and Ollama's
``/api/generate``, ``/api/show``, ``/api/tags``, ``/api/version`` (Continue, twinny).

Field names and meanings follow llama.cpp's server README (tools/server/README.md) and Ollama's
API reference (its repository's api page). What maps onto dflash's decoding is applied (``n_predict``/``num_predict``,
``stop``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``samplers``, ``t_max_predict_ms``,
``n_indent``, ``response_fields``, ``n_cmpl``); what has no counterpart here is accepted and has
no effect (``t_max_prompt_ms``, ``min_p``, ``num_ctx``, ...). ``cache_prompt`` (default true) and
``id_slot`` pick the engine's prompt cache slot; a newer ``/infill`` (or any request naming the same
``id_slot``) cancels the one still running or waiting, as an editor's next keystroke makes the last
completion moot.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime import ConfigError, DecodeOptions, InputError, SamplingParams, fim
from runtime.engine import CancelToken
from runtime.engine.events import DecodeEvent, Finished, GenerationStats

from . import protocol as P

LLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95}  # llama-server's defaults
OLLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}  # Ollama's defaults
OLLAMA_API_VERSION = "0.6.0"  # the Ollama API level these endpoints follow (GET /api/version)
MAX_N_CMPL = 8
LLAMA_RANDOM_SEEDS = (-1, 4294967295)  # llama.cpp's "pick a random seed" values


def tokens_cached(stats: GenerationStats) -> int:
    """Prompt tokens the engine reused from an earlier request (its prompt cache), 0 without one.

    The one place every editor response reads it from (``tokens_cached``, ``timings.cache_n``,
    ``prompt_n`` = prompt tokens - cached): wire the engine's statistic here.
    """
    return int(getattr(stats, "tokens_cached", 0) or 0)


# -- requests --------------------------------------------------------------------------------------
Text = P.Text
Number = Annotated[float, Field(allow_inf_nan=False)]


class _Lenient(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields are ignored, as by llama-server


class ExtraChunk(_Lenient):
    """One ``input_extra`` item: another file of the project."""

    filename: Text = "tmp"
    text: Text = ""


class LlamaRequest(_Lenient):
    """Options ``/completion`` and ``/infill`` share."""

    model: Text | None = None
    n_predict: int | None = None
    max_tokens: int | None = None  # accepted by llama-server as an alias
    temperature: Number | None = None
    top_k: int | None = None
    top_p: Number | None = None
    seed: int | None = None
    stop: list[Text] | Text | None = None
    samplers: list[Text] | Text | None = None
    stream: bool | None = None
    cache_prompt: bool | None = None
    id_slot: int | None = None
    t_max_prompt_ms: int | None = None
    t_max_predict_ms: int | None = None
    n_indent: int | None = None
    response_fields: list[Text] | None = None
    n_cmpl: int | None = None
    ignore_eos: bool | None = None
    return_tokens: bool | None = None


class InfillRequest(LlamaRequest):
    """A ``/infill`` body."""

    input_prefix: Text = ""
    input_suffix: Text = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list)
    prompt: Text = ""


class LlamaCompletionRequest(LlamaRequest):
    """A ``/completion`` body: text (special tokens parsed) or token ids."""

    prompt: Text | list[Annotated[int, Field(ge=0)]]


class OllamaOptions(_Lenient):
    """``options`` of an Ollama request (the model-file parameters)."""

    num_predict: int | None = None
    stop: list[Text] | Text | None = None
    temperature: Number | None = None
    top_k: int | None = None
    top_p: Number | None = None
    seed: int | None = None
    num_ctx: int | None = None


class OllamaGenerate(_Lenient):
    """An ``/api/generate`` body."""

    model: Text | None = None
    prompt: Text = ""
    suffix: Text | None = None
    system: Text | None = None
    template: Text | None = None
    raw: bool | None = None
    stream: bool | None = None
    options: OllamaOptions | None = None
    images: list[Any] | None = None
    format: Any = None
    context: list[Any] | None = None
    keep_alive: Any = None


@dataclass(frozen=True)
class EditorJob:
    """A validated editor request, ready for the engine.

    Attributes:
        kind: "infill", "completion" or "ollama".
        prompt_ids: the prompt as ids (FIM prompts, token-id prompts), or None.
        prompt, chat, system: a text prompt for ``Backend.stream`` when ``prompt_ids`` is None.
        warm_only: ``n_predict`` 0: read the prompt, answer no text.
        t_max_predict_ms: stop once this long after the first token and a newline (0: off).
        n_indent: stop at a line indented less than this, cutting it (0: off).
        response_fields: keep only these (``a/b`` flattened) keys of a llama.cpp result.
        n_cmpl: completions of the same prompt (seeds seed, seed+1, ...).
        supersede: a key: a newer request with the same key cancels this one if it still runs or
            waits (an editor sends one request per keystroke); None: never superseded.
    """

    kind: str
    model: str
    params: SamplingParams
    opts: DecodeOptions
    stream: bool
    prompt_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    chat: bool | None = False
    system: str | None = None
    warm_only: bool = False
    t_max_predict_ms: int = 0
    n_indent: int = 0
    response_fields: tuple[str, ...] | None = None
    n_cmpl: int = 1
    supersede: str | None = None
    return_tokens: bool = False
    settings: dict[str, Any] = field(default_factory=dict)


def _validate(schema: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise P.bad("the request body must be a JSON object")
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        raise P._validation_error(e) from None


def _stops(stop: list[str] | str | None) -> tuple[str, ...]:
    items = [stop] if isinstance(stop, str) else list(stop or [])
    items = [s for s in items if s]  # an empty stop string matches nothing (llama.vim sends [])
    if len(items) > P.MAX_STOP_STRINGS:
        raise P.bad(f"'stop' has {len(items)} strings; at most {P.MAX_STOP_STRINGS} are allowed", "stop")
    if any(len(s) > P.MAX_STOP_CHARS for s in items):
        raise P.bad(f"each 'stop' string must be at most {P.MAX_STOP_CHARS} characters", "stop")
    return tuple(items)


def _sampling(
    r: Any,
    defaults: dict[str, float],
    max_new: int,
    stop: tuple[str, ...],
    samplers: Sequence[str] | None = None,
    extra_stop_ids: Sequence[int] = (),
) -> SamplingParams:
    temp = defaults["temperature"] if r.temperature is None else float(r.temperature)
    top_k: int | None = int(defaults["top_k"]) if r.top_k is None else r.top_k
    top_p: float | None = defaults["top_p"] if r.top_p is None else float(r.top_p)
    if samplers is not None:  # llama.cpp: a sampler left out of the list is not used
        names = set(samplers)
        top_k = top_k if "top_k" in names else None
        top_p = top_p if "top_p" in names else None
        if "temperature" not in names and temp > 0:
            temp = 1.0  # no temperature scaling: the final sampler draws from the distribution as it is
    seed = r.seed if r.seed is not None and r.seed >= 0 and r.seed not in LLAMA_RANDOM_SEEDS else None
    try:
        return SamplingParams(
            temperature=max(temp, 0.0),  # llama.cpp: a temperature <= 0 is greedy
            top_k=top_k if top_k and top_k > 0 else None,
            top_p=top_p if top_p is not None and 0.0 < top_p < 1.0 else None,
            seed=seed if seed is not None else secrets.randbits(32),
            max_new_tokens=max(max_new, 1),
            stop_strings=stop,
            stop_token_ids=tuple(sorted(set(extra_stop_ids))),
            ignore_eos=bool(getattr(r, "ignore_eos", False)),
        )
    except ConfigError as e:
        raise P.bad(str(e)) from None


def _budget(n: int | None, limit: int) -> tuple[int, bool]:
    """(max new tokens, warm only) of an n_predict / num_predict value (< 0: as many as allowed)."""
    if n is None or n < 0:
        return limit, False
    if n == 0:
        return 1, True
    return min(n, limit), False


def resolve_model(name: str | None, served: tuple[str, ...], ollama: bool = False) -> str:
    if not name:
        return served[0]
    for s in served:
        if name == s or (ollama and name == f"{s}:latest"):
            return s
    raise P.APIError(
        404,
        f"model '{name}' not found; this server serves: {', '.join(served)}",
        param="model",
        code="model_not_found",
    )


def fim_prompt(
    tokenizer: Any,
    target: str,
    prefix: str,
    suffix: str,
    param: str,
    extra: Sequence[tuple[str, str]] = (),
) -> fim.FimPrompt:
    """``runtime.fim.build`` with its errors as a 400 naming ``param``."""
    try:
        return fim.build(tokenizer, prefix, suffix, extra, target_name=target)
    except InputError as e:
        raise P.bad(str(e), param, "fim_unsupported") from None


def parse_llama(
    body: Any,
    kind: str,
    served: tuple[str, ...],
    limits: P.Limits,
    opts: DecodeOptions,
    tokenizer: Any,
    target: str,
) -> EditorJob:
    """Validate a llama.cpp ``/infill`` (kind "infill") or ``/completion`` body.

    Raises:
        APIError: 400 for bad fields or a target without FIM tokens (``/infill``), 404 for an unknown model.
    """
    r = _validate(InfillRequest if kind == "infill" else LlamaCompletionRequest, body)
    model = resolve_model(r.model, served)
    n = r.n_predict if r.n_predict is not None else r.max_tokens
    max_new, warm = _budget(n, limits.max_tokens)
    n_cmpl = 1 if r.n_cmpl is None else r.n_cmpl
    if not 1 <= n_cmpl <= MAX_N_CMPL:
        raise P.bad(f"'n_cmpl' must be in 1..{MAX_N_CMPL}, got {n_cmpl}", "n_cmpl")
    if n_cmpl > 1 and r.stream:
        raise P.bad("'n_cmpl' > 1 is answered as one JSON array: send stream false", "n_cmpl")
    samplers = [r.samplers] if isinstance(r.samplers, str) else r.samplers
    if samplers is not None and len(samplers) == 1 and ";" in samplers[0]:
        samplers = samplers[0].split(";")
    stop = _stops(r.stop)
    prompt_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    extra_stops: tuple[int, ...] = ()
    if isinstance(r, InfillRequest):
        extra = [(c.filename, c.text) for c in r.input_extra]
        built = fim_prompt(tokenizer, target, r.input_prefix + r.prompt, r.input_suffix, "input_suffix", extra)
        prompt_ids, extra_stops = tuple(built.ids), built.stop_ids
    elif isinstance(r.prompt, str):
        prompt = r.prompt
    else:
        if not r.prompt:
            raise P.bad("'prompt' must be a non-empty string or list of token ids", "prompt", "empty_prompt")
        prompt_ids = tuple(r.prompt)
    params = _sampling(r, LLAMA_DEFAULTS, max_new, stop, samplers, extra_stops)
    if r.id_slot is not None and r.id_slot < 0:
        r.id_slot = None  # llama.cpp: -1 = any slot
    opts = replace(opts, cache_prompt=r.cache_prompt is not False, slot=r.id_slot)
    return EditorJob(
        kind=kind,
        model=model,
        params=params,
        opts=opts,
        stream=bool(r.stream),
        prompt_ids=prompt_ids,
        prompt=prompt,
        chat=False,
        warm_only=warm,
        t_max_predict_ms=max(r.t_max_predict_ms or 0, 0),
        n_indent=max(r.n_indent or 0, 0),
        response_fields=tuple(r.response_fields) if r.response_fields else None,
        supersede=f"slot:{r.id_slot}" if r.id_slot is not None else ("fim" if kind == "infill" else None),
        n_cmpl=n_cmpl,
        return_tokens=bool(r.return_tokens),
        settings={
            "n_predict": -1 if n is None else n,
            "temperature": params.temperature,
            "top_k": params.top_k or 0,
            "top_p": params.top_p or 1.0,
            "seed": params.seed,
            "stop": list(stop),
            "samplers": list(samplers) if samplers is not None else ["top_k", "top_p", "temperature"],
            "t_max_predict_ms": max(r.t_max_predict_ms or 0, 0),
            "n_indent": max(r.n_indent or 0, 0),
        },
    )


def parse_ollama(
    body: Any,
    served: tuple[str, ...],
    limits: P.Limits,
    opts: DecodeOptions,
    tokenizer: Any,
    target: str,
) -> EditorJob | None:
    """Validate an Ollama ``/api/generate`` body; None for a request that only loads the model
    (no prompt, no suffix).

    ``raw``: the prompt as it is (special tokens parsed), ``system`` ignored. ``suffix`` (not raw):
    a FIM prompt from the target's tokens. Otherwise the chat template applies where the model has
    one, except to a prompt that already holds the model's FIM tokens (twinny lays them out itself).

    Raises:
        APIError: 400 for bad or unsupported fields, 404 for an unknown model.
    """
    r = _validate(OllamaGenerate, body)
    model = resolve_model(r.model, served, ollama=True)
    if r.images:
        raise P.bad("images are not supported by dflash serve", "images")
    if r.format:
        raise P.bad("'format' (structured output) is not supported by dflash serve", "format")
    if r.template:
        raise P.bad("'template' is not supported; send raw: true with the prompt laid out", "template")
    if r.context:
        raise P.bad("'context' is not supported: send the whole prompt", "context")
    o = r.options or OllamaOptions()
    if not r.prompt and not (r.suffix and not r.raw):
        return None
    max_new, warm = _budget(o.num_predict, limits.max_tokens)
    stop = _stops(o.stop)
    prompt_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    chat: bool | None = False
    extra_stops: tuple[int, ...] = ()
    if r.suffix and not r.raw:
        built = fim_prompt(tokenizer, target, r.prompt, r.suffix, "suffix")
        prompt_ids, extra_stops = tuple(built.ids), built.stop_ids
    else:
        prompt = r.prompt
        fmt = fim.detect(tokenizer)
        laid_out = fmt is not None and fmt.names["prefix"] in r.prompt
        chat = False if (r.raw or laid_out) else None
    params = _sampling(o, OLLAMA_DEFAULTS, max_new, stop, None, extra_stops)
    return EditorJob(
        kind="ollama",
        model=model,
        params=params,
        opts=opts,
        stream=True if r.stream is None else r.stream,
        prompt_ids=prompt_ids,
        prompt=prompt,
        chat=chat,
        system=None if (r.raw or chat is False) else r.system,
        warm_only=warm,
    )


# -- generation rules applied while tokens arrive ----------------------------------------------------
class Watch:
    """``t_max_predict_ms`` and ``n_indent`` as llama-server applies them, checked after every step
    on the worker thread: when one trips, the generation is cancelled (it stops after the step) and
    ``limited`` is set; ``cut`` is where ``n_indent`` cut the text (None: no cut)."""

    def __init__(self, t_max_predict_ms: int = 0, n_indent: int = 0) -> None:
        self.t_max = t_max_predict_ms / 1000.0
        self.n_indent = n_indent
        self.text = ""
        self.first_at: float | None = None
        self.limited = False
        self.cut: int | None = None
        self._scan = 0  # first newline not yet judged by n_indent

    def _indent_cut(self) -> int | None:
        text = self.text
        nl = text.find("\n", self._scan)
        while nl != -1:
            start = j = nl + 1
            while j < len(text) and text[j] in " \t":
                j += 1
            if j == len(text):
                self._scan = nl  # the line's indentation is not complete yet
                return None
            if j - start < self.n_indent:
                return j  # llama-server keeps the short line's indentation and cuts the rest
            nl = text.find("\n", start)
        self._scan = len(text)
        return None

    def events(self, events: Iterator[DecodeEvent], cancel: CancelToken) -> Iterator[DecodeEvent]:
        """``events``, cancelling the generation where a rule trips."""
        for event in events:
            if not isinstance(event, Finished) and not self.limited:
                if self.first_at is None:
                    self.first_at = time.perf_counter()
                self.text += event.text
                if self.n_indent > 0:
                    cut = self._indent_cut()
                    if cut is not None:
                        self.cut, self.limited = cut, True
                        cancel.cancel()
                if (
                    not self.limited
                    and self.t_max > 0
                    and "\n" in self.text
                    and time.perf_counter() - self.first_at > self.t_max
                ):
                    self.limited = True
                    cancel.cancel()
            yield event


def stop_type(job: EditorJob, watch: Watch, done: Finished, last_id: int | None, eos_ids: Sequence[int]) -> str:
    """llama-server's ``stop_type``: "eos", "word", "limit" or "none" (cancelled by the client)."""
    if job.warm_only or watch.limited or done.reason == "length":
        return "limit"
    if done.reason == "cancelled":
        return "none"
    stops = set(job.params.stop_token_ids) | set(eos_ids)
    if job.params.stop_strings and last_id not in stops:
        return "word"
    return "eos"


# -- responses ---------------------------------------------------------------------------------------
def timings(stats: GenerationStats, warm_only: bool = False) -> dict[str, Any]:
    """llama-server's ``timings`` object."""
    cached = tokens_cached(stats)
    prompt_n = max(stats.prompt_tokens - cached, 0)
    prompt_ms = stats.ttft_seconds * 1000.0
    predicted_n = 0 if warm_only else stats.generated_tokens
    predicted_ms = 0.0 if warm_only else max(stats.total_seconds - stats.ttft_seconds, 0.0) * 1000.0
    return {
        "cache_n": cached,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1000.0 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": 1000.0 * predicted_n / predicted_ms if predicted_ms > 0 else 0.0,
        "draft_n": stats.drafted_tokens,
        "draft_n_accepted": stats.accepted_tokens,
    }


def llama_result(
    job: EditorJob,
    index: int,
    text: str,
    token_ids: Sequence[int],
    stats: GenerationStats,
    stop: str,
    streamed: bool = False,
) -> dict[str, Any]:
    """A llama-server completion result (the final object of a stream has empty ``content``)."""
    content = "" if job.warm_only else text
    return {
        "index": index,
        "content": "" if streamed else content,
        "tokens": list(token_ids) if job.return_tokens and not job.warm_only else [],
        "id_slot": 0,
        "stop": True,
        "model": job.model,
        "tokens_predicted": 0 if job.warm_only else stats.generated_tokens,
        "tokens_evaluated": stats.prompt_tokens,
        "generation_settings": dict(job.settings),
        "has_new_line": "\n" in content,
        "truncated": False,
        "stop_type": stop,
        "stopping_word": "",
        "tokens_cached": tokens_cached(stats),
        "timings": timings(stats, job.warm_only),
        "dflash": {"stats": stats.to_json()},
    }


def llama_chunk(job: EditorJob, text: str, token_ids: Sequence[int], predicted: int, evaluated: int) -> dict[str, Any]:
    """One streamed llama-server piece."""
    return {
        "index": 0,
        "content": text,
        "tokens": list(token_ids),
        "stop": False,
        "id_slot": 0,
        "tokens_predicted": predicted,
        "tokens_evaluated": evaluated,
    }


def select_fields(result: dict[str, Any], fields: Sequence[str] | None) -> dict[str, Any]:
    """llama-server's ``response_fields``: only the named keys, ``a/b`` read from nested objects and
    kept under the name ``"a/b"``; a missing one is left out."""
    if not fields:
        return result
    out: dict[str, Any] = {}
    for path in fields:
        current: Any = result
        for key in path.split("/"):
            if isinstance(current, dict) and key in current:
                current = current[key]
            else:
                break
        else:
            out[path] = current
    return out


def llama_error(e: P.APIError) -> dict[str, Any]:
    """llama-server's error object."""
    return {"error": {"code": e.status, "message": e.message, "type": e.type}}


def iso_now() -> str:
    """Ollama's ``created_at``."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def ollama_chunk(model: str, text: str) -> dict[str, Any]:
    """One streamed ``/api/generate`` line."""
    return {"model": model, "created_at": iso_now(), "response": text, "done": False}


def ollama_final(model: str, text: str, reason: str, stats: GenerationStats | None, seconds: float) -> dict[str, Any]:
    """The last ``/api/generate`` object (``done`` true), durations in nanoseconds."""
    out: dict[str, Any] = {"model": model, "created_at": iso_now(), "response": text, "done": True}
    out["done_reason"] = reason
    out["total_duration"] = int(seconds * 1e9)
    out["load_duration"] = 0
    if stats is not None:
        out["prompt_eval_count"] = stats.prompt_tokens
        out["prompt_eval_duration"] = int(stats.ttft_seconds * 1e9)
        out["eval_count"] = stats.generated_tokens
        out["eval_duration"] = int(max(stats.total_seconds - stats.ttft_seconds, 0.0) * 1e9)
        out["dflash"] = {"stats": stats.to_json(), "tokens_cached": tokens_cached(stats)}
    return out


def ollama_details(arch: str | None, dtype: str | None) -> dict[str, Any]:
    """The ``details`` object of ``/api/show`` and ``/api/tags``."""
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": arch or "",
        "families": [arch] if arch else [],
        "parameter_size": "",
        "quantization_level": (dtype or "").upper(),
    }


def with_stop_ids(params: SamplingParams, ids: Sequence[int]) -> SamplingParams:
    """``params`` that also stop at ``ids``."""
    return replace(params, stop_token_ids=tuple(sorted(set(params.stop_token_ids) | set(ids))))
