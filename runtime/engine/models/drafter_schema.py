"""The one schema of a drafter folder's JSON files, checked where they are read.

A drafter's ``config.json`` (the published z-lab layout: Qwen3-style architecture keys plus the
DFlash keys, nested in ``dflash_config`` or at the top level) and its ``model.safetensors.index.json``
are parsed through strict pydantic models: ``true`` is not a block size, ``"abc"`` is not a coverage
table, and a value given both at the top level and in ``dflash_config`` must agree. A file that
does not fit stops the load with ``ModelLoadError`` (exit code 4) naming the file and the field,
instead of an ``IndexError`` or ``TypeError`` at the first decode step.

Range checks that are a matter of configuration (``block_size: 0``, a negative mask id) stay in
``runtime.config.DFlashConfig`` (``ConfigError``, exit code 2).
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from runtime.errors import ModelLoadError

PositiveInt = Annotated[StrictInt, Field(ge=1)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
Probability = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
PositiveFloat = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
Pair = Annotated[list[StrictInt], Field(min_length=2, max_length=2)]

# keys that may sit at the top level or in ``dflash_config``; both given, they must agree
SHARED_KEYS = ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "draft_vocab_size")


class _Schema(BaseModel):
    # strict: no "4" for 4, no true for 1; other keys (transformers' own) are kept as they are
    model_config = ConfigDict(strict=True, extra="allow", frozen=True)


class DFlashSection(_Schema):
    """``dflash_config``: what the drafter was trained with and what it measured."""

    block_size: StrictInt | None = None
    mask_token_id: StrictInt | None = None
    target_layer_ids: list[StrictInt] | None = None
    num_target_layers: PositiveInt | None = None
    draft_vocab_size: NonNegativeInt | None = None
    copy_ngram: Pair | None = None
    copy_corpus: Pair | None = None
    # P(draft k accepted | drafts 1..k-1 accepted), per position: the verify length's prior
    acceptance_conditional: list[Probability] | None = None
    # c[depth][rank]: how often the target's choice was the drafter's rank-r candidate at each depth
    rank_coverage: list[list[Probability]] | None = None
    training: dict[str, Any] | None = None


class DrafterConfigFile(_Schema):
    """A drafter's ``config.json``."""

    hidden_size: PositiveInt
    num_hidden_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt | None = None
    head_dim: PositiveInt | None = None
    intermediate_size: PositiveInt
    rms_norm_eps: PositiveFloat = 1e-6
    vocab_size: PositiveInt
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = None
    sliding_window: NonNegativeInt | None = None
    attention_bias: StrictBool = False
    hidden_act: StrictStr = "silu"
    rope_theta: PositiveFloat | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    max_position_embeddings: PositiveInt | None = None
    partial_rotary_factor: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    dflash_config: DFlashSection | None = None
    # the DFlash keys at the top level (the layout of some published drafters)
    block_size: StrictInt | None = None
    mask_token_id: StrictInt | None = None
    target_layer_ids: list[StrictInt] | None = None
    num_target_layers: PositiveInt | None = None
    draft_vocab_size: NonNegativeInt | None = None

    def shared(self, key: str) -> Any:
        """A key of ``SHARED_KEYS`` from wherever it is given.

        Raises:
            ModelLoadError: it is given at the top level and in ``dflash_config`` with other values.
        """
        top = getattr(self, key)
        nested = getattr(self.dflash_config, key) if self.dflash_config is not None else None
        if top is not None and nested is not None and top != nested:
            raise ModelLoadError(
                f"field {key} is {top!r} but dflash_config.{key} is {nested!r}; they must agree (remove one of them)"
            )
        return nested if nested is not None else top


def _shard_name(name: str) -> str:
    p = PurePosixPath(name)
    if not name or p.is_absolute() or ".." in p.parts or "\\" in name:
        raise ValueError("a shard must be a file name inside the model folder")
    return name


class WeightIndex(_Schema):
    """``model.safetensors.index.json``: which shard holds each tensor."""

    weight_map: Annotated[dict[StrictStr, Annotated[StrictStr, AfterValidator(_shard_name)]], Field(min_length=1)]


def _where(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(the whole file)"


def describe(e: ValidationError) -> str:
    """The first problem of a validation error as ``field X: what is wrong (got Y)``."""
    err = e.errors(include_url=False)[0]
    got = repr(err.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    msg = str(err["msg"])
    if err["type"] == "missing":
        return f"field {_where(err['loc'])} is missing"
    return f"field {_where(err['loc'])}: {msg[0].lower() + msg[1:]} (got {got})"


def parse_config(raw: Any) -> DrafterConfigFile:
    """Validate a parsed drafter ``config.json``.

    Raises:
        ModelLoadError: naming the field (without the file: the caller adds it).
    """
    if not isinstance(raw, dict):
        raise ModelLoadError(f"a drafter config must be a JSON object, not {type(raw).__name__}")
    try:
        return DrafterConfigFile.model_validate(raw)
    except ValidationError as e:
        raise ModelLoadError(describe(e)) from None


def read_json_object(path: Path) -> dict[str, Any]:
    """Read a JSON file that must hold one object (UTF-8, as JSON requires).

    Raises:
        ModelLoadError: unreadable, not UTF-8, not JSON or not an object, naming ``path``.
    """
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{path} is not UTF-8 text (byte {e.start}); re-download the model") from None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError; so are huge numbers
        raise ModelLoadError(f"{path} is not valid JSON ({e}); re-download the model") from None
    if not isinstance(obj, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, not {type(obj).__name__}")
    return obj


def read_weight_index(path: Path) -> list[str]:
    """The shard file names a ``model.safetensors.index.json`` names, sorted.

    Raises:
        ModelLoadError: naming the file and the field.
    """
    raw = read_json_object(path)
    try:
        index = WeightIndex.model_validate(raw)
    except ValidationError as e:
        raise ModelLoadError(f"{path}: {describe(e)}") from None
    return sorted(set(index.weight_map.values()))
