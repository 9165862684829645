"""Load a target + drafter pair and turn prompts into event streams.

``load_pipeline`` resolves what the user named (a preset, Hub ids, local folders, or nothing: the
embedded default), checks the pair from its configs before loading weights, loads both models on
the chosen device and dtype, and returns a ``Pipeline``. ``Pipeline.stream`` is the one call the
CLI, the TUI, bench and the server make.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runtime.backend import Capabilities
from runtime.config import DecodeOptions, RuntimeConfig, SamplingParams
from runtime.engine import CancelToken, Decoder, select_decoder
from runtime.engine.calibrate import VerifyCosts
from runtime.engine.confidence import HitRates
from runtime.engine.events import DecodeEvent
from runtime.engine.models.device import dtype_name, resolve_device, resolve_dtype
from runtime.engine.models.drafter import DFlashDraftModel
from runtime.engine.models.drafter_config import read_draft_config
from runtime.engine.models.drafter_io import load_draft_model
from runtime.engine.models.lean_target import LeanTarget, lean_supported
from runtime.engine.models.linear import activations_in, all_linears_packed, int8_linears, pack_linears
from runtime.engine.models.target import TargetModel
from runtime.engine.prompt_cache import PromptCache
from runtime.errors import ConfigError, InputError, ModelLoadError, UnsupportedModelError
from runtime.models import embedded, presets
from runtime.models.compat import ensure_compatible
from runtime.models.configs import read_target_config
from runtime.models.hub import resolve_model
from runtime.models.placement import Placement, move_rest, place, sized_for
from runtime.textio import check_text

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ModelRef:
    """What the user named. All None means the embedded default pair.

    Attributes:
        preset: a preset name (``runtime.models.presets``).
        target: Hub id or local folder of the target (overrides the preset's).
        drafter: Hub id or local folder of the drafter (overrides the preset's); "none" for no drafter.
    """

    preset: str | None = None
    target: str | None = None
    drafter: str | None = None


@dataclass(frozen=True)
class LoadOptions:
    """Where models come from.

    Attributes:
        models_dir: dflash's own model folder (the embedded target is converted there).
        hf_cache_dir: Hugging Face cache (None: huggingface_hub's default).
        offline: never use the network.
        revision: Hub revision for both models.
        token: Hub token (gated repos).
        quantize: on-the-fly weight-only quantization scheme for the target (None: off).
    """

    models_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "dflash" / "models")
    hf_cache_dir: Path | None = None
    offline: bool = False
    revision: str | None = None
    token: str | None = None
    quantize: str | None = None


@dataclass(frozen=True)
class ResolvedPair:
    """Folders of a pair plus the names to show."""

    target_dir: Path
    drafter_dir: Path | None
    target_name: str
    drafter_name: str | None
    thinking: bool = False


def _preset_for_target(target: str) -> presets.Preset | None:
    for p in presets.PRESETS.values():
        if p.target.lower() == target.lower():
            return p
    return None


def resolve_pair(ref: ModelRef, opts: LoadOptions, progress: Progress | None = None) -> ResolvedPair:
    """Turn a ``ModelRef`` into local folders, downloading Hub models when allowed.

    Raises:
        ModelNotFoundError: an unknown preset, folder or repo, or a missing embedded model.
        ConfigError: a drafter without a target.
    """
    if ref.drafter and ref.drafter != "none" and not ref.target and not ref.preset:
        raise ConfigError("--drafter needs --target (or --model PRESET): a drafter only works with its target")
    preset = presets.get_preset(ref.preset) if ref.preset else None
    if preset is None and ref.target:
        preset = _preset_for_target(ref.target)
    if preset is None and not ref.target:
        preset = presets.get_preset(presets.EMBEDDED)
    target = ref.target or (preset.target if preset else None)
    drafter = ref.drafter or (preset.drafter if preset else None)
    if drafter is None and ref.target:
        from runtime.models.quantized import recorded_drafter

        drafter = recorded_drafter(ref.target)  # a `dflash quantize` folder remembers its drafter
    assert target is not None

    def hub(name: str, kind: str) -> Path:
        return resolve_model(
            name, kind, cache_dir=opts.hf_cache_dir, revision=opts.revision, offline=opts.offline, token=opts.token
        )

    if target == "embedded":
        target_dir = embedded.require_embedded_target(opts.models_dir, progress)
        target_name = embedded.TARGET_NAME
    else:
        target_dir = hub(target, "target")
        target_name = target
    drafter_dir: Path | None = None
    drafter_name: str | None = None
    if drafter == "embedded":
        drafter_dir, drafter_name = embedded.embedded_drafter_dir(), "dflash/" + embedded.DRAFTER_DIR.name
    elif drafter and drafter != "none":
        drafter_dir, drafter_name = hub(drafter, "drafter"), drafter
    thinking = bool(preset.thinking) if preset else False
    return ResolvedPair(target_dir, drafter_dir, target_name, drafter_name, thinking)


def load_target_model(
    target_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    attn: str = "sdpa",
    quantize: str | None = None,
    placement: Placement | None = None,
    progress: Progress | None = None,
) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` with clear errors (no remote code, local files only),
    placed by ``runtime.models.placement`` (straight onto the device, spread over GPUs, or on the
    CPU and quantized Linear by Linear onto the GPU) and quantized as the folder records or as
    ``quantize`` asks."""
    from transformers import AutoModelForCausalLM

    from runtime.models.quantized import apply_saved_quantization, load_q4_folder, prepare_saved_load, stored_by_dflash

    saved = prepare_saved_load(target_dir, device, dtype)  # a `dflash quantize` folder: can it run here?
    if stored_by_dflash(saved):
        return load_q4_folder(target_dir, device, dtype, attn)  # dflash's own q4 layers: not transformers'
    if placement is None:
        placement = place(device, bool(quantize) or (saved is not None and not saved.stored_quantized))
    if progress and placement.note:
        progress(placement.note)
    kw: dict[str, Any] = {"dtype": dtype, "local_files_only": True, "trust_remote_code": False}
    if attn:
        kw["attn_implementation"] = attn
    if placement.device_map is not None:
        kw["device_map"] = placement.device_map  # accelerate: each shard straight onto its device
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(str(target_dir), **kw)
    except torch.OutOfMemoryError:
        raise
    except ValueError as e:
        msg = str(e).splitlines()[0]
        if "Unrecognized" in msg or "not supported" in msg or "does not support" in msg:
            raise UnsupportedModelError(f"cannot load target {target_dir} as a causal LM: {msg}") from e
        raise ModelLoadError(f"cannot load target {target_dir}: {msg}") from e
    except Exception as e:  # safetensors/OS errors for truncated or corrupt files
        raise ModelLoadError(
            f"cannot load target weights from {target_dir}: {str(e).splitlines()[0] if str(e) else type(e).__name__}; "
            "the files may be truncated or corrupt: re-download them"
        ) from e
    apply_saved_quantization(model, target_dir, device)  # schemes stored as float weights
    if quantize:
        from runtime.models.quant_schemes import quantize_model_inplace

        if progress:
            progress(f"quantizing {target_dir.name} ({quantize})")
        quantize_model_inplace(model, quantize, device)
    if placement.device_map is None and device.type != "cpu":
        move_rest(model, device)  # what quantizing left on the CPU (embedding, norms, head)
    return model.eval()


def load_tokenizer(target_dir: Path) -> Any | None:
    """The target's tokenizer, or None when the folder has none (e.g. test fixtures)."""
    if not any((target_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True, trust_remote_code=False)
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer in {target_dir}: {str(e).splitlines()[0]}") from e


def make_target(model: Any, engine: str = "auto", progress: Progress | None = None) -> TargetModel:
    """Wrap a loaded causal LM: the lean forward where it runs (``runtime.engine.models.lean_target``),
    else transformers' own.

    Raises:
        ConfigError: ``engine="lean"`` for a model the lean forward cannot run.
    """
    if engine == "hf":
        return TargetModel(model)
    why = lean_supported(model)
    if why is None:
        cuda = next(model.parameters()).device.type == "cuda"
        if engine == "bucketed" or (engine == "auto" and cuda):
            from runtime.engine.models.bucketed_target import BucketedTarget

            return BucketedTarget(model)  # the capturable step (docs/decoding.md, "On a GPU")
        return LeanTarget(model)
    if engine in ("lean", "bucketed"):
        raise ConfigError(f"--engine {engine} cannot run this target: {why}; use --engine hf")
    if progress:
        progress(f"transformers forward for this target ({why})")
    return TargetModel(model)


class Pipeline:
    """A loaded pair: encode prompts, build decoders, stream events.

    Attributes:
        target: wrapped target.
        drafter: the drafter or None (plain decoding only).
        tokenizer: the target's tokenizer or None.
        pair: folders and names.
        device, dtype: where the models run.
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDraftModel | None,
        tokenizer: Any | None,
        pair: ResolvedPair,
        device: torch.device,
        dtype: torch.dtype,
        load_seconds: float = 0.0,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.pair = pair
        self.device = device
        self.dtype = dtype
        self.load_seconds = load_seconds
        self.costs: VerifyCosts | None = None  # measured verify/draft costs (runtime.engine.calibrate)
        self.quantization: str | None = None  # weight-only scheme of the target (runtime.models.quant_schemes)
        # the confidence cut's calibration of this pair's drafter, shared by every request
        self.hit_rates = HitRates()
        # the caches of this pair's last requests, reused for the prefix a new prompt shares with them
        self.prompt_cache: PromptCache | None = PromptCache()

    # -- prompts -----------------------------------------------------------------------------
    @property
    def is_chat_model(self) -> bool:
        """True when the target's tokenizer has a chat template."""
        return bool(self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str, chat: bool | None = None, system: str | None = None) -> list[int]:
        """Token ids for a prompt.

        Args:
            text: the user's text.
            chat: apply the chat template (None: when the target has one).
            system: optional system prompt (chat mode only).

        Raises:
            InputError: empty text, or no tokenizer.
        """
        if not text.strip():
            raise InputError("the prompt is empty; pass text as an argument or on stdin")
        check_text(text, "the prompt")  # a lone surrogate (JSON "\\ud800") would crash the tokenizer
        if self.tokenizer is None:
            raise InputError("this target has no tokenizer; pass token ids with --prompt-ids 1,2,3")
        use_chat = self.is_chat_model if chat is None else chat
        if use_chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            return self.encode_messages(messages)
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def encode_messages(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Apply the chat template (thinking off) to a conversation and tokenise it."""
        if not self.is_chat_model:
            raise InputError(f"target {self.pair.target_name} has no chat template; use raw mode (--raw)")
        assert self.tokenizer is not None
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids (special tokens skipped)."""
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """EOS ids from the generation config and the tokenizer."""
        ids: set[int] = set()
        gen = getattr(self.target.model, "generation_config", None)
        for src in (getattr(gen, "eos_token_id", None), getattr(self.target.config, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(i) for i in src)
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    # -- decoding ----------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        """The drafter's trained block size (1 without a drafter)."""
        return self.drafter.dflash.block_size if self.drafter is not None else 1

    def make_decoder(self, opts: DecodeOptions | None = None) -> Decoder:
        """The decoder these options ask for (``runtime.engine.select.select_decoder``).

        Raises:
            ConfigError: a block size > 1 asked for but no drafter is loaded.
        """
        return select_decoder(
            self.target,
            self.drafter,
            self.tokenizer,
            opts or DecodeOptions(),
            costs=self.costs,
            hit_rates=self.hit_rates,
            prompt_cache=self.prompt_cache,
            stop_token_ids=self.stop_token_ids,
            target_name=self.pair.target_name,
        )

    @property
    def capabilities(self) -> Capabilities:
        """What this pipeline's events and inputs carry (the ``Backend`` protocol)."""
        return Capabilities(
            per_token_origin=True, tokenizer=self.tokenizer is not None, chat_template=self.is_chat_model
        )

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
        """Generate from text (encoded with ``encode``) or token ids with a fresh decoder; see
        ``Decoder.stream`` (the ``Backend`` protocol)."""
        ids = self.encode(prompt, chat=chat, system=system) if isinstance(prompt, str) else prompt
        return self.stream_ids(ids, params, opts, cancel)

    def stream_ids(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        opts: DecodeOptions | None = None,
        cancel: CancelToken | None = None,
    ) -> Iterator[DecodeEvent]:
        """Generate from token ids as they are; the ``Backend`` protocol."""
        return self.make_decoder(opts).stream(prompt_ids, params, cancel)

    def stream_messages(
        self,
        messages: Sequence[Mapping[str, str]],
        params: SamplingParams,
        opts: DecodeOptions | None = None,
        cancel: CancelToken | None = None,
    ) -> Iterator[DecodeEvent]:
        """Apply the chat template to a conversation and stream; the ``Backend`` protocol."""
        return self.stream_ids(self.encode_messages(messages), params, opts, cancel)

    def describe(self) -> dict[str, Any]:
        """Names, device and dtype for display and bench records."""
        return {
            "target": self.pair.target_name,
            "drafter": self.pair.drafter_name,
            "target_dir": str(self.pair.target_dir),
            "drafter_dir": str(self.pair.drafter_dir) if self.pair.drafter_dir else None,
            "device": str(self.device),
            "dtype": dtype_name(self.dtype),
            "activations": dtype_name(self.target.dtype),
            "block_size": self.block_size,
            "quantization": self.quantization,
        }


def place_target(
    pair: ResolvedPair, device: torch.device, dtype: torch.dtype, quantize: str | None, saved: Any
) -> Placement:
    """Where the pair's target loads (``runtime.models.placement``): its layers and KV cache at
    ``DEFAULT_CONTEXT`` tokens, and the drafter with its cache on the first GPU, against each GPU's
    free memory (sized only where a split is possible: several GPUs, ``cuda`` without an index)."""
    quantize_at_load = bool(quantize) or (saved is not None and saved.scheme is not None and not saved.stored_quantized)
    if quantize_at_load or device.type != "cuda" or device.index is not None or torch.cuda.device_count() < 2:
        return place(device, quantize_at_load)
    from runtime.models.footprint import DEFAULT_CONTEXT, drafter_kv_bytes
    from runtime.models.quant_schemes import folder_weight_bytes

    weights = sized_for(read_target_config(pair.target_dir), dtype, DEFAULT_CONTEXT)
    extra = 0
    if pair.drafter_dir is not None:
        item = torch.empty((), dtype=dtype).element_size()
        extra = folder_weight_bytes(pair.drafter_dir) + drafter_kv_bytes(
            read_draft_config(pair.drafter_dir), DEFAULT_CONTEXT, item
        )
    return place(device, False, weights, extra)


def load_pipeline(
    ref: ModelRef | None = None,
    runtime: RuntimeConfig | None = None,
    opts: LoadOptions | None = None,
    progress: Progress | None = None,
) -> Pipeline:
    """Resolve, check and load a pair.

    Args:
        ref: what to load (None: the embedded default pair).
        runtime: device, dtype, threads.
        opts: where models come from.
        progress: callback for one-line status messages (loading can take a while).

    Returns:
        A ready ``Pipeline``.

    Raises:
        ModelNotFoundError, ModelLoadError, IncompatibleDraftError, ConfigError.
    """
    import time

    t0 = time.perf_counter()
    ref, runtime, opts = ref or ModelRef(), runtime or RuntimeConfig(), opts or LoadOptions()
    if runtime.threads:
        torch.set_num_threads(runtime.threads)
    device = resolve_device(runtime.device)
    dtype = resolve_dtype(runtime.dtype, device)
    pair = resolve_pair(ref, opts, progress)
    from runtime.models.quantized import (
        apply_saved_quantization,
        check_quantize_request,
        prepare_saved_load,
        read_saved_quantization,
    )

    saved = read_saved_quantization(pair.target_dir)
    if runtime.dtype == "auto" and (opts.quantize or (saved is not None and saved.scheme is not None)):
        dtype = resolve_dtype("auto", device, quantized=True)  # a dflash-quantized target: the activations' dtype
    draft_cfg = read_draft_config(pair.drafter_dir) if pair.drafter_dir else None
    if draft_cfg is not None:
        ensure_compatible(read_target_config(pair.target_dir), draft_cfg, pair.target_name, pair.drafter_name or "")

    if opts.quantize:
        check_quantize_request(opts.quantize, pair.target_dir, device, dtype)
    if pair.drafter_dir is not None:
        prepare_saved_load(pair.drafter_dir, device, dtype)
    if progress:
        progress(f"loading {pair.target_name} on {device} ({dtype_name(dtype)})")
    placement = place_target(pair, device, dtype, opts.quantize, saved)
    model = load_target_model(
        pair.target_dir, device, dtype, runtime.attn_implementation, opts.quantize, placement, progress
    )
    target = make_target(model, runtime.engine, progress)
    compile_mode = {"on": "default", "default": "default", "reduce-overhead": "reduce-overhead"}.get(runtime.compile)
    if isinstance(target, LeanTarget) and compile_mode is not None:
        target.compile(compile_mode)  # opt-in: measured slower than eager on CPUs, not measured on a GPU
    drafter = None
    if pair.drafter_dir is not None:
        if progress:
            progress(f"loading drafter {pair.drafter_name}")
        drafter = load_draft_model(pair.drafter_dir, device, dtype)
        apply_saved_quantization(drafter, pair.drafter_dir, device)
        if target.int8:
            int8_linears(drafter)  # beside an int8 target the drafter's GEMMs run in int8 too
        elif runtime.engine != "hf":
            pack_linears(drafter)  # inference only: packed oneDNN GEMMs on CPUs (no-op elsewhere)
            if target.dtype != dtype and all_linears_packed(drafter):
                activations_in(drafter, target.dtype)  # bf16 weights, float32 activations (LeanTarget)
        if compile_mode is not None and getattr(target, "buckets", None) is not None:
            from runtime.engine.models.bucketed_drafter import BucketedDrafter

            BucketedDrafter.of(drafter).compile(compile_mode)  # the drafter's half of the bucketed step
        ids = drafter.draft_vocab_ids
        if ids is not None and ids.numel() and int(ids.max()) >= target.vocab_size:
            raise ModelLoadError(f"drafter draft vocabulary has ids beyond the target vocab ({target.vocab_size})")
    tokenizer = load_tokenizer(pair.target_dir)
    pipe = Pipeline(target, drafter, tokenizer, pair, device, dtype, time.perf_counter() - t0)
    pipe.quantization = opts.quantize or (saved.method if saved else None)
    return pipe
