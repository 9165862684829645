"""Ollama's wire format, as editor plugins speak it (Continue, twinny): ``POST /api/generate``
bodies into an ``EditorJob``, and its streamed lines, final object and model ``details`` (Ollama's
API reference, its repository's api page).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from runtime import DecodeOptions, fim
from runtime.engine.events import GenerationStats

from . import protocol as P
from .editors import (
    EditorJob,
    Lenient,
    Number,
    Text,
    budget,
    fim_prompt,
    resolve_model,
    sampling,
    stops,
    tokens_cached,
    validate,
)

OLLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}  # Ollama's defaults
OLLAMA_API_VERSION = "0.6.0"  # the Ollama API level these endpoints follow (GET /api/version)


class OllamaOptions(Lenient):
    """``options`` of an Ollama request (the model-file parameters)."""

    num_predict: int | None = None
    stop: list[Text] | Text | None = None
    temperature: Number | None = None
    top_k: int | None = None
    top_p: Number | None = None
    seed: int | None = None
    num_ctx: int | None = None


class OllamaGenerate(Lenient):
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
    r = validate(OllamaGenerate, body)
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
    max_new, warm = budget(o.num_predict, limits.max_tokens)
    stop = stops(o.stop)
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
    params = sampling(o, OLLAMA_DEFAULTS, max_new, stop, None, extra_stops)
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
