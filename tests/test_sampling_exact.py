"""Sampling stays exact: DFlash samples have the target's distribution (chi-square test over many
seeds on a tiny vocabulary), with temperature, top-k and top-p applied to the target."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from runtime.config import SamplingParams
from runtime.engine import plain_decoder, tree_decoder
from runtime.engine.models.target import TargetModel
from runtime.engine.sampling import probabilities
from tests.fakes import OracleDecoder, collect_ids, make_drafter, make_target

V, N_NEW, RUNS = 5, 3, 1500
PROMPT = [1, 3, 2]


def exact_distribution(model, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(x1..x3 | prompt) under the filtered target, by enumeration."""
    out = {}
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=N_NEW):
            ids = PROMPT + list(seq)
            logits = model(input_ids=torch.tensor([ids])).logits[0]
            p = 1.0
            for i, tok in enumerate(seq):
                dist = probabilities(logits[len(PROMPT) - 1 + i][None], params)[0]
                p *= float(dist[tok])
            out[seq] = p
    return out


def chi_square(counts: dict[tuple[int, ...], int], probs: dict[tuple[int, ...], float], n: int) -> tuple[float, int]:
    """Chi-square statistic with cells of expected count < 5 merged; returns (stat, dof)."""
    big = [k for k, p in probs.items() if p * n >= 5]
    stat = sum((counts.get(k, 0) - probs[k] * n) ** 2 / (probs[k] * n) for k in big)
    rest_p = sum(p for k, p in probs.items() if k not in big)
    rest_c = sum(c for k, c in counts.items() if k not in big)
    bins = len(big)
    if rest_p * n >= 1:
        stat += (rest_c - rest_p * n) ** 2 / (rest_p * n)
        bins += 1
    else:
        assert rest_c <= 3, "samples landed on tokens the filtered distribution forbids"
    return stat, bins - 1


def critical(dof: int, z: float = 3.09) -> float:
    """Upper 0.001 quantile of chi-square (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=N_NEW),
        SamplingParams(temperature=0.7, top_k=3, max_new_tokens=N_NEW),
        SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=N_NEW),
    ],
    ids=["t1", "topk", "topp"],
)
def test_dflash_sampling_matches_target_distribution(params):
    model = make_target("qwen3", vocab_size=V, seed=11, initializer_range=0.5)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=4)
    probs = exact_distribution(model, params)
    spec, plain = {}, {}
    accepted = 0
    for seed in range(RUNS):
        p = SamplingParams(**{**params.__dict__, "seed": seed})
        ev = list(OracleDecoder(target, drafter, corrupt=0.3, seed=seed).stream(PROMPT, p))
        accepted += ev[-1].stats.accepted_tokens
        key = tuple(collect_ids(ev))
        spec[key] = spec.get(key, 0) + 1
        key = tuple(collect_ids(list(plain_decoder(target).stream(PROMPT, p))))
        plain[key] = plain.get(key, 0) + 1
    assert accepted > RUNS * 0.3, "drafts must be accepted often for the test to mean anything"
    for counts in (spec, plain):
        stat, dof = chi_square(counts, probs, RUNS)
        assert stat < critical(dof), (stat, dof, critical(dof))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=N_NEW),
        SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=N_NEW),
    ],
    ids=["t1", "topp"],
)
def test_tree_sampling_matches_target_distribution(params):
    """The walk follows the target's sample at each visited node: every committed token is an
    exact sample of the target given the accepted path, whatever the tree holds."""
    model = make_target("qwen3", vocab_size=V, seed=11, initializer_range=0.5)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=4)
    probs = exact_distribution(model, params)
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for seed in range(RUNS):
        p = SamplingParams(**{**params.__dict__, "seed": seed})
        ev = list(tree_decoder(target, drafter, tree_budget=6).stream(PROMPT, p))
        accepted += ev[-1].stats.accepted_tokens
        key = tuple(collect_ids(ev))
        counts[key] = counts.get(key, 0) + 1
    assert accepted > RUNS * 0.3, "tree nodes must be accepted often for the test to mean anything"
    stat, dof = chi_square(counts, probs, RUNS)
    assert stat < critical(dof), (stat, dof, critical(dof))
