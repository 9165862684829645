"""Frozen, validated configuration dataclasses.

Nothing here reads the environment: the CLI reads flags and variables and passes values down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.errors import ConfigError

# The distribution this project is published under (pyproject.toml [project] name; "dflash" on PyPI
# is z-lab's package). The command it installs is `dflash`.
DISTRIBUTION = "dflash-code"

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda", "mps")
MAX_TREE_BUDGET = 1024  # drafted nodes per tree verify
MAX_LOOKUP = 256  # context tokens copied per step
DEFAULT_LOOKUP = 16
# temperatures below this decode greedily (vLLM does the same below its 1e-5, llama.cpp at 0 and below):
# dividing logits by 1e-40 would overflow to inf, and so small a temperature is the argmax anyway
GREEDY_BELOW = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        temperature: 0 (or anything below ``GREEDY_BELOW``, 1e-5) means greedy; above, samples from
            the (filtered) target distribution.
        top_k: keep the k most likely tokens (None or 0: off).
        top_p: nucleus filter in (0, 1] (None or 1.0: off).
        seed: seed of the explicit ``torch.Generator`` used for sampling.
        max_new_tokens: exact upper bound on generated tokens (the stop token included).
        stop_token_ids: extra ids that end the generation (the model's EOS ids are added by the
            pipeline unless ``ignore_eos``).
        stop_strings: text that ends the generation; the output is cut before it.
        ignore_eos: do not stop on the model's EOS ids (bench uses fixed-length runs).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ConfigError(f"seed must be between {SEED_RANGE[0]} and {SEED_RANGE[1]}, got {self.seed}")
        if any(not s for s in self.stop_strings):
            raise ConfigError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        """True when decoding is deterministic argmax (a temperature below ``GREEDY_BELOW``)."""
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class DFlashConfig:
    """What the drafter was trained with (from its config.json).

    Attributes:
        block_size: slots per drafter block (anchor + block_size - 1 proposals).
        mask_token_id: id of the mask token M filling the proposal slots.
        target_layer_ids: target decoder layers whose outputs feed the drafter.
        draft_vocab_size: size of the reduced draft vocabulary, or None for the full one.
        copy_ngram: (shortest, longest) context n-gram whose continuation the drafter is shown as
            copy inputs (``runtime.engine.ngram.block_copies``), or None for a drafter without them.
        copy_corpus: (shortest, longest) n-gram of the drafter's corpus table
            (``runtime.engine.models.corpus``), shown where the context has no match of two tokens; None
            without one. Needs ``copy_ngram``.
    """

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    draft_vocab_size: int | None = None
    copy_ngram: tuple[int, int] | None = None
    copy_corpus: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.copy_corpus is not None:
            if self.copy_ngram is None:
                raise ConfigError("copy_corpus needs copy_ngram (the corpus is shown through the copy inputs)")
            if not 1 <= self.copy_corpus[0] <= self.copy_corpus[1] <= 16:
                raise ConfigError(f"copy_corpus needs 1 <= shortest <= longest <= 16, got {list(self.copy_corpus)}")
        if self.copy_ngram is not None and not 1 <= self.copy_ngram[0] <= self.copy_ngram[1] <= 16:
            raise ConfigError(f"copy_ngram needs 1 <= shortest <= longest <= 16, got {list(self.copy_ngram)}")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.mask_token_id < 0:
            raise ConfigError(f"mask_token_id must be >= 0, got {self.mask_token_id}")
        if not self.target_layer_ids:
            raise ConfigError("target_layer_ids must name at least one target layer")
        if any(i < 0 for i in self.target_layer_ids):
            raise ConfigError(f"target_layer_ids must be >= 0, got {list(self.target_layer_ids)}")


ENGINES = ("auto", "lean", "bucketed", "hf")
COMPILE_SETTINGS = ("auto", "off", "on", "default", "reduce-overhead")


@dataclass(frozen=True)
class RuntimeConfig:
    """Where and how models run.

    Attributes:
        device: "auto", "cpu", "cuda", "cuda:N" or "mps".
        dtype: "auto", "float32", "bfloat16" or "float16".
        threads: CPU threads for torch (None: leave torch's default).
        attn_implementation: passed to transformers ("sdpa" by default, "eager" for references).
        engine: the target's forward: "lean" (static KV cache, packed weights; Llama/Qwen2/Qwen3),
            "bucketed" (the lean forward as a capturable step: fixed verify buckets, caches lent
            from a per-model pool, no host reads; ``runtime.engine.models.bucketed_target``),
            "hf" (transformers' own forward) or "auto" (where the model supports it: bucketed on
            CUDA, lean elsewhere).
        compile: run the target forward through ``torch.compile``: "on" or "default" (inductor),
            "reduce-overhead" (inductor with CUDA graphs; the bucketed step's verify and drafter
            forwards), or "off"/"auto" (the default: eager, because on CPUs compiled steps
            measured slower than eager and no GPU measurement exists yet; docs/speed.md).
    """

    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    attn_implementation: str = "sdpa"
    engine: str = "auto"
    compile: str = "auto"

    def __post_init__(self) -> None:
        base, colon, index = self.device.partition(":")
        if base not in DEVICES or (colon and (base == "auto" or not index.isdigit() or not index.isascii())):
            raise ConfigError(f"unknown device {self.device!r}; use one of {', '.join(DEVICES)} (or cuda:N)")
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; use one of {', '.join(DTYPES)}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {self.threads}")
        if self.engine not in ENGINES:
            raise ConfigError(f"unknown engine {self.engine!r}; use one of {', '.join(ENGINES)}")
        if self.compile not in COMPILE_SETTINGS:
            raise ConfigError(f"unknown compile setting {self.compile!r}; use {', '.join(COMPILE_SETTINGS)}")


@dataclass(frozen=True)
class DecodeOptions:
    """Decoder choice, independent of sampling.

    Attributes:
        decoder: "dflash" (speculative) or "ar" (plain autoregressive, the baseline).
        block_size: drafter block size override (None: the drafter's own).
        verify_length: drafts verified per step (None: chosen for the device, see
            ``runtime.engine.plan``). Setting ``block_size`` without it verifies the whole block.
        tree_budget: tree verification (DDTree) with this many drafted nodes per verify; 0 = the
            chain; None: chosen for the device (``runtime.engine.plan``) when the verify
            costs of trees are known, else the chain.
        lookup: with tree verification, most tokens per step copied from the context where its last
            tokens occurred before (``runtime.engine.lookup``); 0 = off; None: the default
            (``DEFAULT_LOOKUP``).
        confidence_cut: with the device's adaptive plan, size each step's draft tree by the
            drafter's own confidence, keeping only the nodes worth their verify cost
            (``runtime.engine.confidence``); None: on (the CLI's default also reads
            DFLASH_CONFIDENCE_CUT).
        cache_prompt: reuse the prompt cache's caches for the prefix this prompt shares with an
            earlier request (``runtime.engine.prompt_cache``); False reads the whole prompt.
        slot: the prompt cache's slot (None: the one sharing the longest prefix).
    """

    decoder: str = "dflash"
    block_size: int | None = None
    verify_length: int | None = None
    tree_budget: int | None = None
    lookup: int | None = None
    confidence_cut: bool | None = None
    cache_prompt: bool = True
    slot: int | None = None

    def __post_init__(self) -> None:
        if self.decoder not in ("dflash", "ar"):
            raise ConfigError(f"unknown decoder {self.decoder!r}; use 'dflash' or 'ar'")
        if self.block_size is not None and self.block_size < 1:
            raise ConfigError(f"block size must be >= 1, got {self.block_size}")
        if self.verify_length is not None and self.verify_length < 0:
            raise ConfigError(f"verify length must be >= 0, got {self.verify_length}")
        if self.tree_budget is not None and not (0 <= self.tree_budget <= MAX_TREE_BUDGET):
            raise ConfigError(f"tree budget must be in [0, {MAX_TREE_BUDGET}] (0 = chain), got {self.tree_budget}")
        if self.slot is not None and self.slot < 0:
            raise ConfigError(f"slot must be >= 0, got {self.slot}")
        if self.lookup is not None and not (0 <= self.lookup <= MAX_LOOKUP):
            raise ConfigError(f"lookup length must be in [0, {MAX_LOOKUP}] (0 = off), got {self.lookup}")
