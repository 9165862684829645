"""Load a target + drafter pair and turn prompts into event streams.

``load_pipeline`` resolves what the user named (a preset, Hub ids, local folders, or nothing: the
embedded default), checks the pair from its configs before loading weights, loads both models on
the chosen device and dtype, and returns a ``Pipeline``. ``Pipeline.stream`` is the one call the
CLI, the TUI, bench and the server make.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
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
from runtime.engine.models.heap import keep_heap
from runtime.engine.models.lean_target import LeanTarget
from runtime.engine.models.linear import activations_in, all_linears_packed, int8_linears, pack_linears
from runtime.engine.models.target import TargetModel
from runtime.engine.prompt_cache import PromptCache
from runtime.errors import InputError, ModelLoadError
from runtime.loading import (
    LoadOptions,
    ModelRef,
    Progress,
    ResolvedPair,
    load_target_model,
    load_tokenizer,
    make_target,
    place_target,
    resolve_pair,
)
from runtime.models.compat import ensure_compatible
from runtime.models.configs import read_target_config
from runtime.textio import check_text

__all__ = [
    "LoadOptions",
    "ModelRef",
    "Pipeline",
    "Progress",
    "ResolvedPair",
    "load_pipeline",
    "load_target_model",
    "load_tokenizer",
    "make_target",
    "place_target",
    "read_target_config",
    "resolve_pair",
]


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
    if device.type == "cpu":
        keep_heap()  # a long prompt's activations reused from the heap, not page-faulted in per layer
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
