"""llama.cpp's server wire format, as editor plugins speak it (llama.vim, llama.vscode, Tabby,
twinny): ``POST /infill`` and ``POST /completion`` bodies into an ``EditorJob``, and results,
streamed pieces, ``timings`` and errors as llama-server writes them (its tools/server/README.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Annotated, Any

from pydantic import Field

from runtime import DecodeOptions
from runtime.engine.events import Finished, GenerationStats

from . import protocol as P
from .editors import (
    EditorJob,
    Lenient,
    Number,
    Text,
    Watch,
    budget,
    fim_prompt,
    resolve_model,
    sampling,
    stops,
    tokens_cached,
    validate,
)

LLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95}  # llama-server's defaults
MAX_N_CMPL = 8


class ExtraChunk(Lenient):
    """One ``input_extra`` item: another file of the project."""

    filename: Text = "tmp"
    text: Text = ""


class LlamaRequest(Lenient):
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
    r = validate(InfillRequest if kind == "infill" else LlamaCompletionRequest, body)
    model = resolve_model(r.model, served)
    n = r.n_predict if r.n_predict is not None else r.max_tokens
    max_new, warm = budget(n, limits.max_tokens)
    n_cmpl = 1 if r.n_cmpl is None else r.n_cmpl
    if not 1 <= n_cmpl <= MAX_N_CMPL:
        raise P.bad(f"'n_cmpl' must be in 1..{MAX_N_CMPL}, got {n_cmpl}", "n_cmpl")
    if n_cmpl > 1 and r.stream:
        raise P.bad("'n_cmpl' > 1 is answered as one JSON array: send stream false", "n_cmpl")
    samplers = [r.samplers] if isinstance(r.samplers, str) else r.samplers
    if samplers is not None and len(samplers) == 1 and ";" in samplers[0]:
        samplers = samplers[0].split(";")
    stop = stops(r.stop)
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
    params = sampling(r, LLAMA_DEFAULTS, max_new, stop, samplers, extra_stops)
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
