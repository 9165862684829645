"""Tree verification (DDTree): pure tree functions on hand-written tensors, the target adapter's
tree forward and cache compaction, and tree decoding == plain greedy on tiny random models."""

from __future__ import annotations

import math
import random

import pytest
import torch

from runtime.config import SamplingParams
from runtime.engine import chain_decoder, plain_decoder, tree_decoder
from runtime.engine.events import BlockVerified, TokenEvent, TokenStatus, event_to_json
from runtime.engine.models.target import TargetModel
from runtime.engine.tree import ancestor_mask, chain_tree, losing_branches, walk
from tests.fakes import TreeOracleDecoder, best_first_tree, collect_ids, greedy_reference, make_drafter, make_target


def lp(rows: list[list[float]]) -> torch.Tensor:
    """Log of hand-written per-slot probabilities."""
    return torch.tensor(rows).log()


# -- pure functions ---------------------------------------------------------------------------
def test_build_tree_is_best_first_over_summed_log_probs():
    # slot 1: token 2 (0.6), token 0 (0.3); slot 2: token 1 (0.9), token 3 (0.05)
    logprobs = lp([[0.3, 0.05, 0.6, 0.05], [0.02, 0.9, 0.03, 0.05]])
    tree = best_first_tree(logprobs, anchor=7, budget=4)
    # root 7; best nodes: 2 (0.6), 2->1 (0.54), 0 (0.3), 0->1 (0.27)
    assert tree.tokens == (7, 2, 1, 0, 1)
    assert tree.parents == (-1, 0, 1, 0, 3)
    assert tree.depths == (0, 1, 2, 1, 2)
    assert tree.ranks == (-1, 0, 0, 1, 0)
    assert tree.max_depth == 2
    # a budget of 1 is the top-1 child; 2 is the greedy chain
    assert best_first_tree(logprobs, 7, 1).tokens == (7, 2)
    assert best_first_tree(logprobs, 7, 2).tokens == (7, 2, 1)
    assert best_first_tree(logprobs, 7, 0).tokens == (7,)
    # the budget is capped by the nodes that exist: 4 + 4*4 = 20
    assert len(best_first_tree(logprobs, 7, 100)) == 21


def test_build_tree_scores_never_increase_and_parents_precede_children():
    torch.manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(5, 11) * 2, dim=-1)
    tree = best_first_tree(logprobs, anchor=3, budget=40)
    assert len(tree) == 41
    scores = [0.0]
    for i in range(1, len(tree)):
        p = tree.parents[i]
        assert 0 <= p < i and tree.depths[i] == tree.depths[p] + 1
        scores.append(scores[p] + float(logprobs[tree.depths[i] - 1, tree.tokens[i]]))
    assert all(a >= b - 1e-6 for a, b in zip(scores[1:], scores[2:], strict=False))
    # siblings hold distinct tokens
    seen = {(tree.parents[i], tree.tokens[i]) for i in range(1, len(tree))}
    assert len(seen) == len(tree) - 1


def test_build_tree_maps_a_reduced_draft_vocabulary_to_full_ids():
    logprobs = lp([[0.7, 0.3], [0.4, 0.6]])
    ids = torch.tensor([100, 205])
    tree = best_first_tree(logprobs, anchor=1, budget=3, vocab_ids=ids)
    assert tree.tokens == (1, 100, 205, 205)
    assert tree.parents == (-1, 0, 1, 0)


def test_ancestor_mask():
    mask = ancestor_mask((-1, 0, 1, 0, 3))
    expect = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [1, 0, 0, 1, 0],
            [1, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expect)
    assert torch.equal(ancestor_mask(chain_tree(5, [1, 2, 3]).parents), torch.ones(4, 4, dtype=torch.bool).tril())
    with pytest.raises(ValueError):
        ancestor_mask((-1, 2, 0))


def test_walk_follows_the_targets_choices():
    tree = best_first_tree(lp([[0.3, 0.05, 0.6, 0.05], [0.02, 0.9, 0.03, 0.05]]), 7, 4)  # 7 -> {2 -> 1, 0 -> 1}
    #           nodes:   7  2  1  0  1
    assert walk(tree, [0, 9, 9, 1, 4]) == [0, 3, 4]  # target picks 0, then 1: second branch, full depth
    assert walk(tree, [2, 1, 5, 9, 9]) == [0, 1, 2]  # first branch, full depth; bonus choices[2] = 5
    assert walk(tree, [2, 3, 9, 9, 9]) == [0, 1]  # 3 is not a child of node 1: stop there
    assert walk(tree, [3, 9, 9, 9, 9]) == [0]  # nothing accepted
    assert walk(chain_tree(5, [1, 2, 3]), [1, 2, 4, 9]) == [0, 1, 2]


def test_losing_branches_and_event_fields():
    # drafted nodes (indices into draft): 0:'a' (root child), 1:'b' under 0, 2:'c' (root child), 3:'d' under 2
    parents = (-1, 0, -1, 2)
    assert losing_branches(parents, []) == [[0, 1], [2, 3]]
    assert losing_branches(parents, [2]) == [[3]]
    assert losing_branches(parents, [2, 3]) == []
    tok = TokenEvent(9, "c", TokenStatus.ACCEPTED)
    ev = BlockVerified(
        draft=(1, 2, 3, 4),
        draft_text=("a", "b", "c", "d"),
        accepted=1,
        tokens=(tok, TokenEvent(8, "x", TokenStatus.TARGET)),
        seconds=0.0,
        parents=parents,
        path=(2,),
    )
    assert ev.is_tree and ev.rejected == (4,) and ev.rejected_text == ("d",)
    assert ev.losing_branches_text == ("d",)
    lost = BlockVerified((1, 2, 3, 4), ("a", "b", "c", "d"), 0, (tok,), 0.0, parents=parents, path=())
    assert lost.rejected_text == ("a", "b") and lost.losing_branches_text == ("ab", "cd")
    j = event_to_json(ev)
    assert j["parents"] == [-1, 0, -1, 2] and j["path"] == [2] and j["draft_text"] == ["a", "b", "c", "d"]
    chain = BlockVerified((1, 2, 3), ("a", "b", "c"), 1, (tok,), 0.0)
    assert not chain.is_tree and chain.rejected == (2, 3) and chain.losing_branches_text == ("bc",)
    assert "parents" not in event_to_json(chain)


# -- target adapter -------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_forward_equals_verifying_each_path_alone(arch, attn):
    model = make_target(arch, vocab_size=64, seed=1)
    model.config._attn_implementation = attn
    target = TargetModel(model)
    target.set_taps([1, 2])
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9]])
    tree = best_first_tree(torch.log_softmax(torch.randn(3, 64, generator=torch.Generator().manual_seed(2)), -1), 7, 9)
    cache = target.new_cache()
    target.forward(prompt, cache, logits_to_keep=1)
    start = prompt.shape[1]
    ids = torch.tensor([tree.tokens])
    pos = torch.tensor(tree.depths) + start
    logits, feats = target.forward(ids, cache, positions=pos, tree_mask=ancestor_mask(tree.parents))
    assert target.cache_len(cache) == start + len(tree)
    for leaf in range(len(tree)):
        path = [leaf]
        while tree.parents[path[-1]] >= 0:
            path.append(tree.parents[path[-1]])
        path.reverse()
        ref_cache = target.new_cache()
        seq = torch.cat([prompt, torch.tensor([[tree.tokens[i] for i in path]])], dim=1)
        ref_logits, ref_feats = target.forward(seq, ref_cache)
        torch.testing.assert_close(logits[leaf], ref_logits[-1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(feats[0, leaf], ref_feats[0, -1], atol=1e-4, rtol=1e-4)
    # keep the path to the last node: the cache equals one built from that path alone
    path = [len(tree) - 1]
    while tree.parents[path[-1]] >= 0:
        path.append(tree.parents[path[-1]])
    path.reverse()
    target.keep(cache, start, path)
    assert target.cache_len(cache) == start + len(path)
    nxt = torch.tensor([[11]])
    got, _ = target.forward(nxt, cache)
    ref_cache = target.new_cache()
    seq = torch.cat([prompt, torch.tensor([[tree.tokens[i] for i in path]]), nxt], dim=1)
    want, _ = target.forward(seq, ref_cache)
    torch.testing.assert_close(got[-1], want[-1], atol=1e-4, rtol=1e-4)


def test_keep_orders_entries_and_default_forward_is_unchanged():
    model = make_target("qwen3", vocab_size=64)
    target = TargetModel(model)
    cache = target.new_cache()
    target.forward(torch.arange(1, 9)[None], cache)
    before = [layer.keys.clone() for layer in cache.layers]
    target.keep(cache, 3, [4, 0, 2])
    for old, layer in zip(before, cache.layers, strict=True):
        assert torch.equal(layer.keys, torch.cat([old[..., :3, :], old[..., [7, 3, 5], :]], dim=-2))
    assert target.cache_len(cache) == 6


# -- decoding -------------------------------------------------------------------------------
def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(n)]


@pytest.mark.parametrize(
    "arch,block,budget",
    [
        ("qwen3", 2, 3),
        ("qwen3", 4, 8),
        ("qwen3", 16, 16),
        ("qwen2", 4, 4),
        ("qwen2", 8, 32),
        ("llama", 8, 8),
        ("llama", 16, 64),
    ],
)
def test_tree_greedy_equals_plain_greedy(arch, block, budget):
    model = make_target(arch, vocab_size=96)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=block, taps=[0, 2, 3])
    params = SamplingParams(max_new_tokens=24)
    for p in prompts(12, 96, seed=block + budget):
        plain = collect_ids(list(plain_decoder(target).stream(p, params)))
        events = list(tree_decoder(target, drafter, tree_budget=budget).stream(p, params))
        assert collect_ids(events) == plain, (arch, block, budget, p)
        for e in events:
            if isinstance(e, BlockVerified) and e.draft:
                assert len(e.draft) <= budget and len(e.parents) == len(e.draft)
                assert [e.draft[i] for i in e.path] == [t.token_id for t in e.tokens[: e.accepted]]


def test_drafter_with_a_reduced_vocabulary():
    model = make_target("qwen3", vocab_size=96, seed=3)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=4)
    drafter.draft_vocab_ids = torch.arange(0, 96, 2)
    params = SamplingParams(max_new_tokens=20)
    p = [4, 5, 6]
    events = list(tree_decoder(target, drafter, tree_budget=6).stream(p, params))
    assert collect_ids(events) == greedy_reference(model, p, 20)
    assert all(t % 2 == 0 for e in events if isinstance(e, BlockVerified) for t in e.draft)


def test_oracle_tree_accepts_full_depth():
    model = make_target("qwen3", vocab_size=96, seed=1)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=8)
    events = list(
        TreeOracleDecoder(target, drafter, tree_budget=8).stream([1, 2, 3], SamplingParams(max_new_tokens=33))
    )
    stats = events[-1].stats
    assert collect_ids(events) == greedy_reference(model, [1, 2, 3], 33)
    assert stats.tau == 8.0 and stats.tree_budget == 8
    assert stats.acceptance_histogram[7] == stats.verify_steps
    assert all(e.accepted == 7 for e in events if e.type == "block")


def test_adversarial_tree_gives_tau_one():
    model = make_target("llama", vocab_size=96, seed=2)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=4)
    p = [5, 6, 7]
    dec = TreeOracleDecoder(target, drafter, tree_budget=16, adversarial=True)
    events = list(dec.stream(p, SamplingParams(max_new_tokens=20)))
    stats = events[-1].stats
    assert stats.tau == 1.0 and stats.accepted_tokens == 0 and stats.drafted_tokens > 0
    assert collect_ids(events) == greedy_reference(model, p, 20)


def test_tree_finds_demoted_tokens_the_chain_misses():
    """The true token at rank 2 half the time: the chain stops there, a tree with budget keeps going."""
    model = make_target("qwen3", vocab_size=96, seed=5)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=6)
    p = [9, 8, 7]
    ref = greedy_reference(model, p, 40)
    taus = {}
    for budget in (5, 64):
        dec = TreeOracleDecoder(target, drafter, tree_budget=budget, corrupt=0.5, demote=1, seed=3)
        events = list(dec.stream(p, SamplingParams(max_new_tokens=40)))
        assert collect_ids(events) == ref
        taus[budget] = events[-1].stats.tau
        steps = [e for e in events if e.type == "block"]
        hist = events[-1].stats.acceptance_histogram
        assert sum(hist) == len(steps) and all(hist[e.accepted] for e in steps)
    assert taus[64] > taus[5] + 1.0, taus


@pytest.mark.parametrize("n", [1, 2, 5, 8, 9, 25])
def test_max_tokens_exact(n):
    model = make_target("qwen3", vocab_size=96)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=8)
    for dec in (TreeOracleDecoder(target, drafter, tree_budget=12), tree_decoder(target, drafter, tree_budget=12)):
        events = list(dec.stream([1, 2], SamplingParams(max_new_tokens=n)))
        assert len(collect_ids(events)) == n
        assert events[-1].reason == "length" and events[-1].stats.generated_tokens == n


def test_stop_token_and_context_limit():
    model = make_target("qwen3", vocab_size=96, seed=4)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=4)
    p = [3, 4, 5]
    ref = greedy_reference(model, p, 40)
    stop = ref[10]
    ev = list(
        TreeOracleDecoder(target, drafter, tree_budget=6, stop_token_ids=[stop]).stream(
            p, SamplingParams(max_new_tokens=40)
        )
    )
    assert collect_ids(ev) == ref[: ref.index(stop) + 1] and ev[-1].reason == "stop"
    small = make_target("qwen3", vocab_size=96, max_position_embeddings=24)
    t2 = TargetModel(small)
    d2 = make_drafter(small.config, block_size=4)
    ev = list(tree_decoder(t2, d2, tree_budget=8).stream(list(range(1, 20)), SamplingParams(max_new_tokens=50)))
    assert len(collect_ids(ev)) == 24 - 19 and ev[-1].reason == "length"


def test_sampling_is_seeded_and_chain_decoder_unchanged():
    model = make_target("qwen3", vocab_size=96, seed=8)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=4)
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=123)
    a = collect_ids(list(tree_decoder(target, drafter, tree_budget=8).stream([1, 2, 3], params)))
    b = collect_ids(list(tree_decoder(target, drafter, tree_budget=8).stream([1, 2, 3], params)))
    assert a == b and len(a) == 20
    greedy = SamplingParams(max_new_tokens=20)
    assert collect_ids(list(chain_decoder(target, drafter).stream([1, 2, 3], greedy))) == greedy_reference(
        model, [1, 2, 3], 20
    )
    assert not math.isnan(sum(a))
