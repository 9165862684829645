"""Context n-gram lookup: the index, merging a copied chain into a draft tree, the adaptive copy
length, and tree decoding with lookup == plain greedy (and faster where the output repeats)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from runtime.config import DecodeOptions, SamplingParams
from runtime.engine import plain_decoder, tree_decoder
from runtime.engine.events import BlockVerified, event_from_json, event_to_json
from runtime.engine.lookup import LookupLength, merge_chain
from runtime.engine.models.target import TargetModel
from runtime.engine.ngram import NgramIndex
from runtime.engine.tree import DraftTree, ancestor_mask, chain_is_path, chain_tree
from runtime.errors import ConfigError
from tests.fakes import best_first_tree, collect_ids, greedy_reference, make_drafter, make_target


# -- the index -------------------------------------------------------------------------------
def test_index_takes_the_longest_suffix_and_its_latest_occurrence():
    idx = NgramIndex(min_n=2, max_n=3)
    #          0  1  2  3  4  5  6  7  8  9
    idx.extend([1, 2, 3, 9, 2, 3, 7, 1, 2, 3])
    # suffix (1, 2, 3) occurred at 0..2 (then 9); (2, 3) last at 4..5 (then 7): the longer wins
    assert idx.match(3) == (3, [9, 2, 3])
    idx.extend([5])
    assert idx.match(4) == (0, [])  # (3, 5) never occurred before
    idx.extend([2, 3])
    # now (5, 2, 3) is new, (2, 3) occurred last at 8..9, followed by 5
    assert idx.match(2) == (2, [5, 2])


def test_index_never_matches_the_suffix_itself_and_needs_min_n():
    idx = NgramIndex(min_n=2, max_n=4)
    idx.extend([4, 5, 6])
    assert idx.match(5) == (0, [])
    idx = NgramIndex(min_n=1, max_n=2)
    idx.extend([4, 5, 6, 5])
    assert idx.match(2) == (1, [6, 5])  # (6, 5) is new; 5 alone was followed by 6
    assert idx.match(0) == (0, [])


def test_a_match_near_the_end_repeats_as_a_period():
    idx = NgramIndex(min_n=2, max_n=2)
    idx.extend([8, 1, 2, 3, 1, 2])
    assert idx.match(7) == (2, [3, 1, 2, 3, 1, 2, 3])
    idx = NgramIndex(min_n=2, max_n=3)
    idx.extend([0, 7, 7, 7])
    assert idx.match(5) == (2, [7] * 5)  # (7, 7, 7) is new; (7, 7) ended one token back


def test_index_agrees_with_a_brute_force_search():
    rng = random.Random(3)
    for _ in range(50):
        seq = [rng.randrange(4) for _ in range(rng.randint(1, 40))]
        idx = NgramIndex(min_n=1, max_n=3)
        cut = rng.randint(0, len(seq))
        idx.extend(seq[:cut])
        idx.extend(seq[cut:])
        n, got = idx.match(6)
        expect_n, expect = 0, []
        for size in range(min(3, len(seq)), 0, -1):
            ends = [j for j in range(size - 1, len(seq) - 1) if seq[j - size + 1 : j + 1] == seq[len(seq) - size :]]
            if ends:
                at = ends[-1] + 1
                expect = [seq[at + k] if at + k < len(seq) else None for k in range(6)]
                for k, v in enumerate(expect):
                    if v is None:
                        expect[k] = expect[k - (len(seq) - at)]
                expect_n = size
                break
        assert (n, got) == (expect_n, expect), seq


# -- merging into a tree ---------------------------------------------------------------------
def test_merge_shares_the_drafters_nodes_and_appends_the_rest():
    logprobs = torch.tensor([[0.3, 0.05, 0.6, 0.05], [0.02, 0.9, 0.03, 0.05]]).log()
    tree = best_first_tree(logprobs, anchor=7, budget=4)  # 7 -> 2 -> 1, 7 -> 0 -> 1
    merged, nodes = merge_chain(tree, [2, 1, 3, 3], max_new=8)
    assert merged.tokens[: len(tree)] == tree.tokens and merged.parents[: len(tree)] == tree.parents
    assert nodes == [1, 2, 5, 6]  # 2 and 1 shared, then two new nodes
    assert merged.tokens[5:] == (3, 3) and merged.parents[5:] == (2, 5) and merged.depths[5:] == (3, 4)
    assert merged.ranks[5:] == (-2, -2) and merged.candidates == tree.candidates
    ancestor_mask(merged.parents)  # parents precede children
    # a new branch from the root, capped
    merged, nodes = merge_chain(tree, [3, 2, 1], max_new=2)
    assert nodes == [5, 6] and merged.parents[5:] == (0, 5) and len(merged) == 7
    # nothing new: the same tree back
    same, nodes = merge_chain(tree, [0, 1], max_new=8)
    assert same is tree and nodes == [3, 4]


def test_chain_is_path():
    assert chain_is_path(chain_tree(1, [2, 3, 4]))
    assert chain_is_path(DraftTree((1,), (-1,), (0,), (-1,)))
    tree = best_first_tree(torch.log_softmax(torch.randn(3, 6), -1), 1, budget=6)
    assert not chain_is_path(tree)
    assert chain_is_path(merge_chain(chain_tree(1, [2, 3]), [2, 3, 9], 4)[0])


def test_copy_length_grows_on_success_and_shrinks_on_failure():
    n = LookupLength(longest=16, shortest=2)
    assert n.length == 8
    n.observe(8, 8)
    assert n.length == 16
    n.observe(16, 16)
    assert n.length == 16
    n.observe(16, 5)
    assert n.length == 7
    n.observe(7, 0)
    assert n.length == 3
    n.observe(3, 0)
    assert n.length == 2
    n.observe(0, 0)  # no guess this step: unchanged
    assert n.length == 2
    with pytest.raises(ValueError):
        LookupLength(longest=1, shortest=2)


# -- decoding ----------------------------------------------------------------------------------
def looping_target(arch: str, seed: int):
    """A tiny target whose attention outputs are zero: each token's next depends on it alone, so
    greedy decoding falls into a cycle that the context lookup can copy."""
    model = make_target(arch, vocab_size=96, seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return model


@pytest.mark.parametrize("arch,seed,budget", [("qwen3", 0, 4), ("llama", 1, 8), ("qwen2", 2, 2), ("qwen2", 0, 6)])
def test_lookup_output_equals_plain_greedy_and_raises_tau_on_repeats(arch, seed, budget):
    model = looping_target(arch, seed)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=4)
    p = [5, 6, 7, 8]
    ref = greedy_reference(model, p, 60)
    params = SamplingParams(max_new_tokens=60)
    off = list(tree_decoder(target, drafter, tree_budget=budget, lookup=0).stream(p, params))
    on = list(tree_decoder(target, drafter, tree_budget=budget, lookup=16).stream(p, params))
    assert collect_ids(off) == ref and collect_ids(on) == ref
    assert on[-1].stats.tau > off[-1].stats.tau + 0.7, (on[-1].stats.tau, off[-1].stats.tau)
    # copied nodes go deeper than the drafter's block; events still name every node and the path
    deep = [e for e in on if isinstance(e, BlockVerified) and e.accepted > 3]
    assert deep
    # each block says how many nodes at the end of its draft were copied; the accepted ones add up
    blocks = [e for e in on if isinstance(e, BlockVerified)]
    copied = sum(sum(1 for i in e.path if i >= len(e.draft) - e.copied) for e in blocks if e.copied)
    assert copied == on[-1].stats.copied_tokens > 0
    assert all(e.copied == 0 for e in off if isinstance(e, BlockVerified))
    for e in blocks:
        assert event_from_json(json.loads(json.dumps(event_to_json(e)))) == e
    for e in on:
        if isinstance(e, BlockVerified) and e.draft:
            assert len(e.parents) == len(e.draft) and all(-1 <= q < i for i, q in enumerate(e.parents))
            assert [e.draft[i] for i in e.path] == [t.token_id for t in e.tokens[: e.accepted]]


def random_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 14))] for _ in range(n)]


@pytest.mark.parametrize("arch,budget,lookup", [("qwen3", 4, 16), ("llama", 8, 3), ("qwen2", 1, 32)])
def test_lookup_on_ordinary_models_equals_plain_greedy(arch, budget, lookup):
    model = make_target(arch, vocab_size=24, seed=budget)  # a small vocabulary repeats n-grams often
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=4)
    params = SamplingParams(max_new_tokens=40)
    for p in random_prompts(8, 24, seed=lookup):
        p = p + p  # the prompt repeats itself: lookups fire from the first step
        plain = collect_ids(list(plain_decoder(target).stream(p, params)))
        assert (
            collect_ids(list(tree_decoder(target, drafter, tree_budget=budget, lookup=lookup).stream(p, params)))
            == plain
        )


@pytest.mark.parametrize("n", [1, 2, 5, 9, 17, 40])
def test_lookup_keeps_max_tokens_and_the_context_limit(n):
    model = looping_target("qwen3", 0)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=4)
    events = list(
        tree_decoder(target, drafter, tree_budget=4, lookup=16).stream([5, 6, 7, 8], SamplingParams(max_new_tokens=n))
    )
    assert len(collect_ids(events)) == n and events[-1].reason == "length"
    small = make_target("qwen3", vocab_size=96, max_position_embeddings=40)
    with torch.no_grad():
        for layer in small.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    t2 = TargetModel(small)
    ev = list(
        tree_decoder(t2, make_drafter(small.config, block_size=4), tree_budget=4, lookup=32).stream(
            [5, 6, 7, 8] * 3, SamplingParams(max_new_tokens=50)
        )
    )
    assert collect_ids(ev) == greedy_reference(small, [5, 6, 7, 8] * 3, 40 - 12) and ev[-1].reason == "length"


def test_lookup_with_sampling_is_seeded():
    model = looping_target("llama", 1)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=4)
    params = SamplingParams(max_new_tokens=30, temperature=0.7, seed=5)
    a = collect_ids(list(tree_decoder(target, drafter, tree_budget=4, lookup=16).stream([1, 2, 3], params)))
    b = collect_ids(list(tree_decoder(target, drafter, tree_budget=4, lookup=16).stream([1, 2, 3], params)))
    assert a == b and len(a) == 30


def test_bad_lookup_lengths_are_config_errors():
    model = make_target("qwen3", vocab_size=96)
    with pytest.raises(ConfigError, match="lookup"):
        tree_decoder(TargetModel(model), make_drafter(model.config, block_size=4), tree_budget=4, lookup=-1)
    with pytest.raises(ConfigError, match="lookup"):
        DecodeOptions(lookup=-3)
    with pytest.raises(ConfigError, match="lookup"):
        DecodeOptions(lookup=100_000)


def test_a_middle_that_reaches_the_suffix_is_looked_up_there():
    """Fill-in-the-middle: the prompt holds the text after the cursor, and the index covers the whole
    prompt, so a middle that runs into what follows it gets the suffix's next tokens as its guess."""
    from runtime.engine.lookup import ContextLookup
    from runtime.engine.step import RequestContext

    pre, suf, mid = 900, 901, 902  # stand-ins for <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>
    prompt = [pre, 10, 11, 12, suf, 40, 41, 42, 43, 44, mid]
    ctx = RequestContext(prompt + [20, 40, 41], torch.device("cpu"), None, index=NgramIndex(2, 4))
    tree = ContextLookup(longest=4).graft(ctx, DraftTree((41,), (-1,), (0,), (-1,)), room=8)
    assert tree.tokens[1:] == (42, 43, 44, mid)
