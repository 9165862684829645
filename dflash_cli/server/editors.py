"""What the editor plugins' wire formats share (``llama`` for llama.cpp's ``/infill`` and
``/completion``, ``ollama`` for Ollama's ``/api/*``): the validated ``EditorJob`` they both become,
the request helpers (stop strings, sampling, token budget, model name, FIM prompt) and ``Watch``,
the rules llama-server applies while tokens arrive (``t_max_predict_ms``, ``n_indent``).

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
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime import ConfigError, DecodeOptions, InputError, SamplingParams, fim
from runtime.engine import CancelToken
from runtime.engine.events import DecodeEvent, Finished, GenerationStats

from . import protocol as P

LLAMA_RANDOM_SEEDS = (-1, 4294967295)  # llama.cpp's "pick a random seed" values


def tokens_cached(stats: GenerationStats) -> int:
    """Prompt tokens the engine reused from an earlier request (its prompt cache), 0 without one.

    The one place every editor response reads it from (``tokens_cached``, ``timings.cache_n``,
    ``prompt_n`` = prompt tokens - cached): wire the engine's statistic here.
    """
    return int(getattr(stats, "tokens_cached", 0) or 0)


# -- request helpers ------------------------------------------------------------------------------
Text = P.Text
Number = Annotated[float, Field(allow_inf_nan=False)]


class Lenient(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields are ignored, as by llama-server


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


def validate(schema: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise P.bad("the request body must be a JSON object")
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        raise P._validation_error(e) from None


def stops(stop: list[str] | str | None) -> tuple[str, ...]:
    items = [stop] if isinstance(stop, str) else list(stop or [])
    items = [s for s in items if s]  # an empty stop string matches nothing (llama.vim sends [])
    if len(items) > P.MAX_STOP_STRINGS:
        raise P.bad(f"'stop' has {len(items)} strings; at most {P.MAX_STOP_STRINGS} are allowed", "stop")
    if any(len(s) > P.MAX_STOP_CHARS for s in items):
        raise P.bad(f"each 'stop' string must be at most {P.MAX_STOP_CHARS} characters", "stop")
    return tuple(items)


def sampling(
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


def budget(n: int | None, limit: int) -> tuple[int, bool]:
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


def with_stop_ids(params: SamplingParams, ids: Sequence[int]) -> SamplingParams:
    """``params`` that also stop at ``ids``."""
    return replace(params, stop_token_ids=tuple(sorted(set(params.stop_token_ids) | set(ids))))
