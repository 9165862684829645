"""Tier 2: DFlash greedy == plain greedy on tiny random models; oracle/adversarial drafters;
stop tokens and max tokens."""

from __future__ import annotations

import random

import pytest

from runtime.config import SamplingParams
from runtime.engine import chain_decoder, plain_decoder
from runtime.engine.models.target import TargetModel
from tests.fakes import OracleDecoder, collect_ids, greedy_reference, make_drafter, make_target


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(n)]


@pytest.mark.parametrize(
    "arch,block",
    [("qwen3", 1), ("qwen3", 2), ("qwen3", 4), ("qwen3", 16), ("qwen2", 4), ("llama", 8), ("llama", 16)],
)
def test_dflash_greedy_equals_plain_greedy(arch, block):
    model = make_target(arch, vocab_size=96)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=max(block, 2), taps=[0, 2, 3])
    params = SamplingParams(max_new_tokens=24)
    for p in prompts(20, 96, seed=block):
        # the reference is cache-free greedy decoding (one full forward per token), not the loop itself:
        # plain decoding is the same loop with a block of one, so comparing the two alone proves little
        ref = greedy_reference(model, p, 24)
        plain = collect_ids(list(plain_decoder(target).stream(p, params)))
        spec = collect_ids(list(chain_decoder(target, drafter, block_size=block).stream(p, params)))
        assert plain == ref, (arch, block, p)
        assert spec == ref, (arch, block, p)


@pytest.mark.parametrize("corrupt", [0.0, 0.3, 0.7])
def test_partial_acceptance_keeps_output_exact(corrupt):
    """Drafts that are right for a while then wrong exercise every acceptance length and crop."""
    model = make_target("qwen3", vocab_size=96, seed=3)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=6)
    params = SamplingParams(max_new_tokens=30)
    for i, p in enumerate(prompts(6, 96, seed=7)):
        ref = greedy_reference(model, p, 30)
        dec = OracleDecoder(target, drafter, corrupt=corrupt, seed=i)
        events = list(dec.stream(p, params))
        assert collect_ids(events) == ref
        blocks = [e for e in events if e.type == "block"]
        for e in blocks:  # statuses: accepted drafts first, then one target token
            assert [t.status.value for t in e.tokens][: e.accepted] == ["accepted"] * e.accepted
            assert list(e.draft[: e.accepted]) == [t.token_id for t in e.tokens[: e.accepted]]


def test_oracle_drafter_gives_full_acceptance():
    model = make_target("qwen3", vocab_size=96, seed=1)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=8)
    events = list(OracleDecoder(target, drafter).stream([1, 2, 3], SamplingParams(max_new_tokens=33)))
    stats = events[-1].stats
    assert stats.generated_tokens == 33
    assert stats.tau == 8.0 and stats.acceptance_rate == 1.0  # 1 + 4 steps x 8 tokens
    assert all(e.accepted == len(e.draft) == 7 for e in events if e.type == "block")
    assert stats.acceptance_histogram[7] == stats.verify_steps


def test_adversarial_drafter_gives_tau_one():
    model = make_target("llama", vocab_size=96, seed=2)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=4)
    p = [5, 6, 7]
    events = list(OracleDecoder(target, drafter, adversarial=True).stream(p, SamplingParams(max_new_tokens=20)))
    stats = events[-1].stats
    assert stats.tau == 1.0 and stats.accepted_tokens == 0 and stats.drafted_tokens > 0
    assert collect_ids(events) == greedy_reference(model, p, 20)
    assert all(t.status.value == "target" for e in events[:-1] for t in e.tokens)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 25])
def test_max_tokens_exact(n):
    model = make_target("qwen3", vocab_size=96)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=8)
    for dec in (OracleDecoder(target, drafter), chain_decoder(target, drafter), plain_decoder(target)):
        events = list(dec.stream([1, 2], SamplingParams(max_new_tokens=n)))
        assert len(collect_ids(events)) == n
        assert events[-1].reason == "length" and events[-1].stats.generated_tokens == n


def test_stop_token_ends_generation_even_when_it_is_the_mask_id():
    model = make_target("qwen3", vocab_size=96, seed=4)
    target = TargetModel(model)
    p = [3, 4, 5]
    ref = greedy_reference(model, p, 40)
    stop = ref[10]  # the 11th greedy token
    drafter = make_drafter(model.config, block_size=4, mask_token_id=stop)
    ref2 = greedy_reference(model, p + [stop], 40)
    assert stop in ref2[1:-1]  # the case under test: the stop id comes again mid-answer (seeded model)
    cut = ref2.index(stop) + 1
    for dec in (
        OracleDecoder(target, drafter, stop_token_ids=[stop]),
        chain_decoder(target, drafter, stop_token_ids=[stop]),
        plain_decoder(target, stop_token_ids=[stop]),
    ):
        events = list(dec.stream(p + [stop], SamplingParams(max_new_tokens=40)))  # the stop id in the prompt too
        assert collect_ids(events) == ref2[:cut]
        assert events[-1].reason == "stop"


def test_stop_id_via_params_and_ignore_eos():
    model = make_target("qwen3", vocab_size=96, seed=4)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=4)
    p = [3, 4, 5]
    ref = greedy_reference(model, p, 30)
    stop = ref[5]
    cut = ref.index(stop) + 1
    ev = list(chain_decoder(target, drafter).stream(p, SamplingParams(max_new_tokens=30, stop_token_ids=(stop,))))
    assert collect_ids(ev) == ref[:cut]
    ev = list(
        chain_decoder(target, drafter, stop_token_ids=[stop]).stream(
            p, SamplingParams(max_new_tokens=30, ignore_eos=True)
        )
    )
    assert collect_ids(ev) == ref


def test_verify_length_shorter_than_block_is_still_exact():
    model = make_target("qwen3", vocab_size=96, seed=5)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=8)
    p = [9, 8, 7]
    ref = greedy_reference(model, p, 25)
    for k in (0, 1, 3, 7):
        ev = list(
            OracleDecoder(target, drafter, verify=k).stream(p, SamplingParams(max_new_tokens=25))
        )
        assert collect_ids(ev) == ref
        assert all(len(e.draft) <= k for e in ev if e.type == "block")


def test_sliding_window_drafter_and_top_level_config_keys():
    model = make_target("qwen3", vocab_size=96, seed=6)
    target = TargetModel(model)
    drafter = make_drafter(
        model.config,
        block_size=4,
        layers=2,
        nested=False,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
    )
    assert drafter.layers[0].self_attn.sliding_window == 4 and drafter.layers[1].self_attn.sliding_window is None
    p = list(range(1, 12))
    params = SamplingParams(max_new_tokens=20)
    assert collect_ids(list(chain_decoder(target, drafter).stream(p, params))) == greedy_reference(model, p, 20)


def test_context_limit_stops_with_length():
    model = make_target("qwen3", vocab_size=96, max_position_embeddings=24)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=4)
    ev = list(chain_decoder(target, drafter).stream(list(range(1, 20)), SamplingParams(max_new_tokens=50)))
    assert len(collect_ids(ev)) == 24 - 19 and ev[-1].reason == "length"


def test_every_token_once_and_text_concatenates(tiny_pair):
    from runtime import ModelRef, RuntimeConfig, load_pipeline

    target_dir, drafter_dir = tiny_pair
    pipe = load_pipeline(ModelRef(target=str(target_dir), drafter=str(drafter_dir)), RuntimeConfig(dtype="float32"))
    ids = pipe.encode("def fib(n):", chat=False)
    events = list(pipe.stream(ids, SamplingParams(max_new_tokens=40, ignore_eos=True)))
    out = collect_ids(events)
    text = "".join(t.text for e in events[:-1] for t in e.tokens)
    assert text == pipe.tokenizer.decode(out, skip_special_tokens=True)
    assert events[0].type == "prefill" and events[-1].type == "done"
    assert sum(len(e.tokens) for e in events[:-1]) == events[-1].stats.generated_tokens == 40


def test_torch_generator_seeded_sampling_is_reproducible():
    model = make_target("qwen3", vocab_size=96, seed=8)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=4)
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=123)
    a = collect_ids(list(chain_decoder(target, drafter).stream([1, 2, 3], params)))
    b = collect_ids(list(chain_decoder(target, drafter).stream([1, 2, 3], params)))
    c = collect_ids(
        list(
            chain_decoder(target, drafter).stream(
                [1, 2, 3], SamplingParams(max_new_tokens=20, temperature=1.0, seed=124)
            )
        )
    )
    assert a == b and a != c
