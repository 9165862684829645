"""Which decoder a request gets: the one loop (``runtime.engine.decode``) with a planner and proposers
chosen from the options, the pair and the device.

``select_decoder`` is what a loaded pair uses (``Pipeline.make_decoder``); ``plain_decoder``,
``chain_decoder`` and ``tree_decoder`` build the three fixed shapes directly (tests, scripts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runtime.config import DEFAULT_LOOKUP, DecodeOptions
from runtime.engine.calibrate import VerifyCosts
from runtime.engine.confidence import HitRates
from runtime.engine.costs import DEFAULT_DRAFT_COST, prior_cost
from runtime.engine.decode import SpeculativeDecoder
from runtime.engine.detok import TokenizerLike
from runtime.engine.models.drafter import DFlashDraftModel
from runtime.engine.models.target import TargetModel
from runtime.engine.plan import AdaptivePlanner, FixedPlanner
from runtime.engine.prompt_cache import PromptCache
from runtime.engine.propose import DrafterProposer
from runtime.engine.propose_bucketed import BucketedProposer
from runtime.engine.step import Planner, Proposer
from runtime.errors import ConfigError

TREE_ATTENTION = ("sdpa", "eager")  # attention implementations that take a custom 4D mask


def tree_attention_support(target: TargetModel) -> str | None:
    """None when the target's attention takes the tree mask, else the implementation's name."""
    impl = getattr(getattr(target, "config", None), "_attn_implementation", None)
    return None if impl in (None, *TREE_ATTENTION) else str(impl)


def has_sliding_layers(config: Any) -> bool:
    """True when some target layers use a sliding window (their caches cannot be compacted)."""
    types = getattr(config, "layer_types", None) or ()
    if "sliding_attention" in types:
        return True
    return bool(getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None))


def drafter_proposer(target: TargetModel, drafter: DFlashDraftModel, block: int) -> Proposer:
    """The drafter's proposer for this target: on the capturable step where the target runs it
    (``BucketedTarget``), else the plain one."""
    from runtime.engine.models.bucketed_target import BucketedTarget

    if isinstance(target, BucketedTarget):
        return BucketedProposer(target, drafter, block)
    return DrafterProposer(target, drafter, block)


def plain_decoder(
    target: TargetModel, tokenizer: TokenizerLike | None = None, *, stop_token_ids: Sequence[int] = ()
) -> SpeculativeDecoder:
    """Plain decoding: the loop with steps of depth 0."""
    return SpeculativeDecoder(target, None, FixedPlanner(0), tokenizer, stop_token_ids=stop_token_ids)


def _block(drafter: DFlashDraftModel | None, block_size: int | None) -> int:
    block = block_size if block_size is not None else (drafter.dflash.block_size if drafter is not None else 1)
    if block < 1:
        raise ConfigError(f"block size must be >= 1, got {block}")
    if block > 1 and drafter is None:
        raise ConfigError(f"block size {block} needs a drafter; use --decoder ar or name a drafter")
    return block


def chain_decoder(
    target: TargetModel,
    drafter: DFlashDraftModel | None,
    tokenizer: TokenizerLike | None = None,
    *,
    block_size: int | None = None,
    verify: int | Planner | None = None,
    stop_token_ids: Sequence[int] = (),
    proposer: Proposer | None = None,
) -> SpeculativeDecoder:
    """DFlash chains: ``verify`` argmax drafts per step (default: the whole block), or a planner.

    Args:
        block_size: the drafter's block length (default: its own; 1 = plain decoding).
        verify: drafts per step, or a planner sizing each step.
        proposer: what proposes (default: the drafter's ``DrafterProposer``).
    """
    block = _block(drafter, block_size)
    if block == 1:
        return plain_decoder(target, tokenizer, stop_token_ids=stop_token_ids)
    assert drafter is not None
    planner = verify if verify is not None and not isinstance(verify, int) else FixedPlanner(block - 1, verify)
    proposer = proposer or drafter_proposer(target, drafter, block)
    return SpeculativeDecoder(target, proposer, planner, tokenizer, stop_token_ids=stop_token_ids)


def tree_decoder(
    target: TargetModel,
    drafter: DFlashDraftModel | None,
    tokenizer: TokenizerLike | None = None,
    *,
    block_size: int | None = None,
    tree_budget: int | Planner = 8,
    stop_token_ids: Sequence[int] = (),
    lookup: int = 0,
    lookup_ngram: tuple[int, int] = (2, 4),
    proposer: Proposer | None = None,
) -> SpeculativeDecoder:
    """DFlash with draft trees: ``tree_budget`` drafted nodes per step (a best-first tree verified in
    one forward with an ancestor-only mask), or a planner; ``lookup`` grafts context copies.

    Raises:
        ConfigError: no drafter, a budget < 1, a block size < 2, or an attention implementation
            that takes no custom mask.
    """
    if isinstance(tree_budget, int) and tree_budget < 1:
        raise ConfigError(f"tree budget must be >= 1 (0 means the chain decoder), got {tree_budget}")
    if drafter is None:
        raise ConfigError("tree verification needs a drafter")
    impl = tree_attention_support(target)
    if impl is not None:
        raise ConfigError(
            f"tree verification needs a custom attention mask, which {impl} attention does not take; "
            "load the target with sdpa or eager attention, or use --tree-budget 0"
        )
    block = _block(drafter, block_size)
    if block < 2:
        raise ConfigError("tree verification needs a block size >= 2")
    planner = tree_budget if not isinstance(tree_budget, int) else FixedPlanner(block - 1, budget=tree_budget)
    proposer = proposer or drafter_proposer(target, drafter, block)
    return SpeculativeDecoder(
        target, proposer, planner, tokenizer, stop_token_ids=stop_token_ids, lookup=lookup, lookup_ngram=lookup_ngram
    )


def select_decoder(
    target: TargetModel,
    drafter: DFlashDraftModel | None,
    tokenizer: TokenizerLike | None,
    opts: DecodeOptions,
    *,
    costs: VerifyCosts | None = None,
    hit_rates: HitRates | None = None,
    prompt_cache: PromptCache | None = None,
    stop_token_ids: Sequence[int] = (),
    target_name: str = "the target",
) -> SpeculativeDecoder:
    """The decoder these options ask for on this pair and device.

    - ``--decoder ar`` / block size 1, or no drafter: plain decoding.
    - ``--tree-budget B``: a fixed tree of B nodes (plus the context lookup).
    - ``--verify-length K`` or ``--block-size``: a fixed chain (on CUDA, any chain: the whole block).
    - otherwise the adaptive planner on the device's costs (measured, or its class's prior), with
      the confidence cut unless turned off; it plans trees (and looks up) where their cost is known
      (measured beyond the block, or CUDA) and the target takes a tree mask, else chains.

    Args:
        costs: the measured verify costs of this pair on this device (``runtime.engine.calibrate``).
        hit_rates: the confidence cut's calibration kept by the pair across requests.
        prompt_cache: the pair's prompt cache (used unless ``opts.cache_prompt`` is False or the
            target has sliding-window layers, whose caches cannot be cropped).

    Raises:
        ConfigError: speculation asked for without a drafter, or a tree the target cannot verify.
    """
    decoder = _select(target, drafter, tokenizer, opts, costs, hit_rates, stop_token_ids, target_name)
    if prompt_cache is not None and opts.cache_prompt and not has_sliding_layers(target.config):
        decoder.prompt_cache, decoder.slot = prompt_cache, opts.slot
    return decoder


def _select(
    target: TargetModel,
    drafter: DFlashDraftModel | None,
    tokenizer: TokenizerLike | None,
    opts: DecodeOptions,
    costs: VerifyCosts | None,
    hit_rates: HitRates | None,
    stop_token_ids: Sequence[int],
    target_name: str,
) -> SpeculativeDecoder:
    plain = opts.decoder == "ar" or opts.block_size == 1
    if plain or (drafter is None and opts.block_size is None and opts.verify_length is None):
        return plain_decoder(target, tokenizer, stop_token_ids=stop_token_ids)
    if drafter is None:
        raise ConfigError(f"no drafter is loaded for {target_name}; name one with --drafter or use --decoder ar")
    block = opts.block_size or drafter.dflash.block_size
    lookup = DEFAULT_LOOKUP if opts.lookup is None else opts.lookup
    if opts.tree_budget:
        return tree_decoder(
            target, drafter, tokenizer, block_size=block, tree_budget=opts.tree_budget,
            stop_token_ids=stop_token_ids, lookup=lookup,
        )  # fmt: skip
    max_k, device = block - 1, target.device.type
    if opts.verify_length is not None or opts.block_size is not None:
        verify = max_k if opts.verify_length is None else min(opts.verify_length, max_k)
        return chain_decoder(target, drafter, tokenizer, block_size=block, verify=verify, stop_token_ids=stop_token_ids)
    chains_only = (
        opts.tree_budget == 0 or has_sliding_layers(target.config) or tree_attention_support(target) is not None
    )
    tree_costs = costs is not None and len(costs.verify) > block
    if chains_only and device == "cuda":
        return chain_decoder(target, drafter, tokenizer, block_size=block, stop_token_ids=stop_token_ids)
    trees = not chains_only and (tree_costs or device == "cuda")
    cost = list(costs.verify) if costs is not None and (tree_costs or not trees) else prior_cost(device)
    recorded = drafter.config.raw.get("dflash_config", {})
    stats = recorded.get("acceptance_conditional")
    planner = AdaptivePlanner(
        max_k,
        cost,
        draft_cost=costs.draft if costs is not None else DEFAULT_DRAFT_COST,
        prior=[float(x) for x in stats] if stats else None,
        prior_table=recorded.get("rank_coverage") if trees else None,
        trees=trees,
        cut=opts.confidence_cut is not False,
        hit_rates=hit_rates,
    )
    if trees:
        return tree_decoder(
            target, drafter, tokenizer, block_size=block, tree_budget=planner,
            stop_token_ids=stop_token_ids, lookup=lookup,
        )  # fmt: skip
    return chain_decoder(target, drafter, tokenizer, block_size=block, verify=planner, stop_token_ids=stop_token_ids)
