"""``dflash bench``: one prompt set through several decoding methods on the same target, in one
process, compared as ratios.

Methods (``METHODS``):

- ``ar``: plain greedy decoding, our loop with a block of one token (the baseline);
- ``hf``: transformers' ``generate`` (what most users run today);
- ``pld``: transformers' prompt-lookup decoding (drafts copied from the prompt's n-grams);
- ``assisted``: transformers' assisted generation with a small same-tokenizer draft model;
- ``dflash``: our DFlash decoder, at the runtime's own verify length or at each swept block size.

Protocol: every method gets untimed warm-up runs first; then, prompt by prompt, every method
runs once, the order rotating from prompt to prompt so that machine drift hits all alike. Runs are
timed with the device synchronised around the clock (``runtime.bench.methods``). Greedy methods
must reproduce ``ar``'s tokens; the first divergence is reported when they do not (in bf16 a
batched verify and a one-token forward may break near-ties differently; docs/method.md).

This module runs a local pair: prompts encoded, the protocol (``runtime.bench.protocol``) run,
rows summarised (``runtime.bench.summary``). What is measured is a ``BenchConfig``
(``runtime.bench.config``); results are frozen dataclasses (``runtime.bench.results``) that the
CLI renders and stores (``runtime.bench.store``). Timed runs and the assistant model live in
``runtime.bench.methods``, pitfall checks in ``runtime.bench.pitfalls``, the recorded environment in
``runtime.bench.env``. Nothing here prints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from runtime.bench.config import BenchConfig, MethodSpec
from runtime.bench.datasets import Prompt, PromptMode, PromptSet
from runtime.bench.env import environment
from runtime.bench.methods import Assistant, PeakMemory, PromptRun, run_decoder, run_generate
from runtime.bench.pitfalls import drafter_dtype, drafter_training, drafter_training_length, find_pitfalls
from runtime.bench.protocol import Progress, timed_protocol
from runtime.bench.results import BenchResult
from runtime.bench.summary import summarise
from runtime.config import DecodeOptions, SamplingParams
from runtime.errors import ConfigError, InputError

if TYPE_CHECKING:
    from runtime.pipeline import Pipeline


# -- prompts ---------------------------------------------------------------------------------
def encode_prompt(pipe: Pipeline, prompt: Prompt, mode: PromptMode | None = None, thinking: bool = False) -> list[int]:
    """Token ids of a bench prompt.

    Chat prompts go through the target's chat template (thinking mode as asked), or are used as
    raw text when the target has none; raw prompts are tokenised as they are.

    Raises:
        InputError: empty prompt, or a target without a tokenizer.
    """
    tok = pipe.tokenizer
    if tok is None:
        raise InputError("this target has no tokenizer, so it cannot run text prompt sets; use a target with one")
    use = mode or prompt.mode
    if use == "auto":
        use = "chat" if pipe.is_chat_model else "raw"
    if use == "chat" and pipe.is_chat_model:
        messages = list(prompt.messages) if prompt.messages else [{"role": "user", "content": prompt.text}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
        return list(tok.encode(text, add_special_tokens=False))
    if not prompt.text.strip():
        raise InputError(f"prompt {prompt.id} is empty")
    return list(tok.encode(prompt.text, add_special_tokens=True))


def template_has_thinking(pipe: Pipeline) -> bool:
    """True when the target's chat template has a thinking switch (``enable_thinking``)."""
    tmpl = getattr(pipe.tokenizer, "chat_template", None) if pipe.tokenizer is not None else None
    return isinstance(tmpl, str) and "enable_thinking" in tmpl


# -- the run ---------------------------------------------------------------------------------
def run_bench(
    pipe: Pipeline,
    prompts: PromptSet,
    config: BenchConfig,
    assistant: Assistant | None = None,
    progress: Progress | None = None,
    quantize: str | None = None,
) -> BenchResult:
    """Run every method on every prompt and summarise.

    Args:
        pipe: the loaded pipeline (target, drafter, tokenizer).
        prompts: the prompt set (already limited).
        config: what to measure.
        assistant: the draft model for ``assisted`` (required when that method is asked for).
        progress: called as ``progress(done, total, what)`` after each run, warm-up included.
        quantize: the quantization the target was loaded with (for records and warnings).

    Returns:
        The ``BenchResult``.

    Raises:
        ConfigError: ``dflash`` without a drafter, ``assisted`` without an assistant.
        InputError: an empty prompt, or a prompt that does not fit the target's context.
    """
    specs = config.specs()
    if any(s.method == "dflash" for s in specs) and pipe.drafter is None:
        raise ConfigError(
            f"no drafter is loaded for {pipe.pair.target_name}, so dflash cannot run; "
            "name one with --drafter, or leave dflash out of --methods"
        )
    if any(s.method == "assisted" for s in specs) and assistant is None:
        raise ConfigError("the assisted method needs a draft model: pass --assistant ID|DIR")
    if not prompts.prompts:
        raise InputError(f"prompt set {prompts.name} is empty")

    encoded = [encode_prompt(pipe, p, config.mode, config.thinking) for p in prompts.prompts]
    limit = pipe.target.max_positions
    for p, ids in zip(prompts.prompts, encoded, strict=True):
        if not ids:
            raise InputError(f"prompt {p.id} encodes to no tokens")
        if limit is not None and len(ids) + config.max_new_tokens > limit:
            raise InputError(
                f"prompt {p.id} has {len(ids)} tokens; with --max-tokens {config.max_new_tokens} it exceeds the "
                f"target's context of {limit} tokens; use fewer --max-tokens or other prompts"
            )
    params = SamplingParams(
        temperature=config.temperature,
        seed=config.seed,
        max_new_tokens=config.max_new_tokens,
        ignore_eos=not config.stop_at_eos,
    )
    mem = PeakMemory(pipe.device)

    def measure(spec: MethodSpec, ids: Sequence[int], p: SamplingParams) -> PromptRun:
        if spec.method in ("ar", "dflash"):
            opts = (
                DecodeOptions(decoder="ar", cache_prompt=False)  # every run reads its prompt: comparable TTFT
                if spec.method == "ar"
                else DecodeOptions(
                    cache_prompt=False,
                    block_size=spec.block_size,
                    verify_length=config.verify_length,
                    tree_budget=spec.tree_budget,
                    lookup=spec.lookup,
                    confidence_cut=config.confidence_cut,
                )
            )
            return run_decoder(pipe, opts, ids, p, mem)
        return run_generate(
            pipe,
            spec.method,
            ids,
            p,
            mem,
            pld_tokens=config.pld_tokens,
            pld_ngram=config.pld_ngram,
            assistant=assistant,
        )

    # 1-2. Warm-up, then every prompt with every method.
    runs = timed_protocol(specs, encoded, [p.id for p in prompts.prompts], config, params, measure, progress)

    # 3. Summaries, agreement with ar, pitfalls.
    prompt_ids = [p.id for p in prompts.prompts]
    base = runs["ar"]

    def decode_one(t: int) -> str:
        return str(pipe.tokenizer.decode([t])) if pipe.tokenizer is not None else str(t)

    drafts = {
        "ar": None,
        "hf": None,
        "pld": "prompt n-grams",
        "assisted": assistant.name if assistant else None,
        "dflash": pipe.pair.drafter_name,
    }
    results = [
        summarise(
            s,
            runs[s.name],
            None if s.name == "ar" else base,
            drafts[s.method],
            config.greedy,
            prompt_ids,
            decode_one,
            (s.block_size or pipe.block_size) if s.method == "dflash" else None,
        )
        for s in specs
    ]
    raw = pipe.drafter.config.raw if pipe.drafter is not None else {}
    target_quant = getattr(pipe.target.config, "quantization_config", None)
    quant_name = quantize or (
        str(target_quant.get("quant_method", "quantized")) if isinstance(target_quant, dict) else None
    )
    if quant_name is None and target_quant is not None:
        quant_name = str(getattr(target_quant, "quant_method", "quantized"))
    info = drafter_training(raw)
    warnings = find_pitfalls(
        results,
        drafter_name=pipe.pair.drafter_name,
        thinking=config.thinking and template_has_thinking(pipe),
        drafter_thinking=bool(info.get("thinking", False)),
        quantized=quant_name,
        drafter_dtype_name=drafter_dtype(raw),
        longest_context=max(len(ids) for ids in encoded) + config.max_new_tokens,
        drafter_train_length=drafter_training_length(raw),
    )
    return BenchResult(
        config=config,
        dataset=prompts.describe(),
        prompt_ids=tuple(prompt_ids),
        prompt_tokens=tuple(len(ids) for ids in encoded),
        environment=environment(pipe, assistant, quant_name),
        methods=tuple(results),
        warnings=tuple(warnings),
    )
