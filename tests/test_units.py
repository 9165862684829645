"""Tier 1: pure functions on hand-made tensors."""

from __future__ import annotations

import pytest
import torch

from runtime.config import DecodeOptions, RuntimeConfig, SamplingParams
from runtime.engine.acceptance import accept_prefix
from runtime.engine.detok import IncrementalDetokenizer, TextAssembler
from runtime.engine.models.drafter_config import default_target_layer_ids
from runtime.engine.models.kv_cache import DraftKVCache, crop_to
from runtime.engine.plan import AdaptivePlanner, best_plan, prior_coverage
from runtime.engine.sampling import filter_logits, sample
from runtime.engine.step import StepOutcome
from runtime.engine.tree import chain_tree
from runtime.errors import ConfigError


def test_layer_id_formula():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(24, 5) == [1, 6, 11, 16, 21]
    assert default_target_layer_ids(8, 2) == [1, 5]
    # Python's round: half to even (1 + 1 * 5 / 2 = 3.5 -> 4, 1 + 3*3/2 = 5.5 -> 6)
    assert default_target_layer_ids(9, 3) == [1, 4, 6]


def test_accept_prefix_golden_sequences():
    assert accept_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert accept_prefix([1, 2, 3], [1, 9, 3, 4]) == 1
    assert accept_prefix([1, 2, 3], [0, 2, 3, 4]) == 0
    assert accept_prefix([], [5]) == 0


def test_greedy_and_filters():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert sample(logits, SamplingParams(), None).tolist() == [1]
    f = filter_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.isinf(f[0, 0]) and torch.isinf(f[0, 2]) and not torch.isinf(f[0, 1])
    f = filter_logits(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), SamplingParams(temperature=1.0, top_p=0.7))
    assert (~torch.isinf(f[0])).tolist() == [True, True, False, False]
    g = torch.Generator().manual_seed(0)
    s = sample(torch.zeros(1000, 4), SamplingParams(temperature=1.0), g)
    assert set(s.tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": -1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"max_new_tokens": 0},
        {"top_k": -2},
        {"stop_strings": ("",)},
    ],
)
def test_sampling_params_validated(kw):
    with pytest.raises(ConfigError):
        SamplingParams(**kw)


def test_other_configs_validated():
    with pytest.raises(ConfigError):
        RuntimeConfig(device="tpu")
    with pytest.raises(ConfigError):
        RuntimeConfig(dtype="int3")
    with pytest.raises(ConfigError):
        DecodeOptions(decoder="medusa")
    with pytest.raises(ConfigError):
        DecodeOptions(block_size=0)


def test_hf_cache_crop_portable():
    from transformers import DynamicCache

    c = DynamicCache()
    k = torch.randn(1, 2, 7, 4)
    c.update(k, k.clone(), 0)
    crop_to(c, 5)
    assert c.get_seq_length() == 5
    crop_to(c, 5)
    with pytest.raises(ValueError):
        crop_to(c, 6)


def test_draft_cache_update_and_crop():
    c = DraftKVCache(2)
    k = torch.randn(1, 2, 3, 4)
    for layer in range(2):
        full_k, _ = c.update(layer, k, k)
        assert full_k.shape[-2] == 3
    c.crop(2)
    assert c.seq_len == 2
    full_k, _ = c.update(0, k, k)
    assert full_k.shape[-2] == 5


class ByteTok:
    """UTF-8 bytes as tokens (nanochat style)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def encode(self, text, add_special_tokens=True):
        return list(text.encode())


def test_incremental_detok_never_splits_characters():
    tok = ByteTok()
    text = "añ✓日本 ok"
    d = IncrementalDetokenizer(tok)
    pieces = [d.push(b) for b in text.encode()]
    assert "".join(pieces) + d.flush() == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_strings_cut_output_and_hold_back_prefixes():
    tok = ByteTok()
    a = TextAssembler(tok, stop_strings=("END",))
    out, stopped = [], False
    for b in b"abc ENx END tail":
        t, stopped = a.push(b)
        out.append(t)
        if stopped:
            break
    assert stopped and "".join(out) == "abc ENx "
    a = TextAssembler(tok, stop_strings=("END",))
    out = [a.push(b)[0] for b in b"abEN"]
    assert "".join(out) == "ab"  # "EN" held back: may start the stop string
    assert a.finish() == "EN"


def test_best_chain_prefers_short_blocks_when_verify_is_costly():
    cost = [1.0, 1.08, 1.16, 1.24, 1.31, 1.38, 1.45, 1.52]
    low, high = prior_coverage([0.4], 7), prior_coverage([0.95], 7)
    assert best_plan(low, cost, 0.05, 7, budgets=())[1] in (1, 2)
    assert best_plan(high, cost, 0.05, 7, budgets=()) == (0, 7)
    assert best_plan(prior_coverage([0.01], 7), cost, 0.3, 7, budgets=()) == (0, 0)
    flat = [1.0] * 8
    assert best_plan(low, flat, 0.0, 7, budgets=())[1] >= best_plan(low, cost, 0.0, 7, budgets=())[1]


def _chain_step(ranks: list[int]) -> StepOutcome:
    """A chain step whose target choices ranked ``ranks`` at the visited depths."""
    a = next((i for i, r in enumerate(ranks) if r != 0), len(ranks))
    return StepOutcome(chain_tree(1, [2] * len(ranks)), list(range(a + 1)), [2] * (len(ranks) + 1), ranks, None, 7, 0.0)


def test_adaptive_chain_length_learns_from_steps():
    pol = AdaptivePlanner(7, [1.0, 1.08, 1.16, 1.24, 1.31, 1.38, 1.45, 1.52], prior=[0.3], trees=False, cut=False, every=4)
    k0 = pol.plan().depth
    for _ in range(200):
        pol.observe(_chain_step([0] * 7))  # everything accepted
    assert pol.plan().depth > k0
    for _ in range(2000):
        pol.observe(_chain_step([-1]))  # nothing accepted
    assert pol.plan().depth <= 1
