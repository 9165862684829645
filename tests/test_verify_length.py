"""The verify length cannot be spoiled by a busy machine (issue 11): untrustworthy cost measurements
are repeated and never cached, and the adaptive policy learns the real step costs while it decodes."""

from __future__ import annotations

import json
import random

import pytest
import torch

from runtime.engine import calibrate
from runtime.engine.calibrate import VerifyCosts, cached_costs, untrustworthy
from runtime.engine.verify_length import DEFAULT_COST, AdaptiveVerifyLength, best_length_for_costs

TRUE_COST = DEFAULT_COST["cpu"][:8]  # what a step really costs here (relative to one token), b = 8
TRUE_DRAFT = 0.1
COND = [0.8, 0.6, 0.4, 0.2, 0.1, 0.05, 0.02]  # P(draft k accepted | 1..k-1 accepted)
BUSY = [1.0, 1.15, 0.33, 1.58, 0.33, 1.12, 2.63, 0.38]  # a cache measured while compiling on both cores
STEEP = [1.0, 1.9, 2.8, 3.7, 4.6, 5.5, 6.4, 7.3]  # a cache that made every run verify 1 draft


def cumulative(cond):
    out, p = [], 1.0
    for c in cond:
        p *= c
        out.append(p)
    return out


def true_best() -> int:
    steps = [TRUE_COST[k] + (TRUE_DRAFT if k else 0.0) for k in range(8)]
    return best_length_for_costs(cumulative(COND), steps, 7)


def simulate(prior_cost, draft_cost, steps=240, seed=0, base=0.15):
    """Decode ``steps`` steps against the true costs (2% timing noise); returns the policy and its K by step."""
    rng = random.Random(seed)
    pol = AdaptiveVerifyLength(7, prior_cost, draft_cost=draft_cost, prior=COND, prior_weight=1e6)
    chosen = []
    for _ in range(steps):
        k = pol.length()
        seconds = base * (TRUE_COST[k] + (TRUE_DRAFT if k else 0.0)) * rng.uniform(0.98, 1.02)
        accepted = 0
        while accepted < k and rng.random() < COND[accepted]:
            accepted += 1
        pol.observe(k, accepted, seconds)
        chosen.append(pol.k)
    return pol, chosen


def test_prior_cost_alone_would_pick_the_wrong_length():
    assert true_best() == 3
    for bad in (BUSY, STEEP):
        pol = AdaptiveVerifyLength(7, bad, draft_cost=TRUE_DRAFT, prior=COND, prior_weight=1e6)
        assert pol.k != 3, bad  # the measured curve alone misleads


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("prior", [BUSY, STEEP], ids=["busy", "steep"])
def test_noisy_cost_measurement_ends_with_the_same_verify_length_as_a_clean_one(prior, seed):
    clean, clean_k = simulate(TRUE_COST, TRUE_DRAFT, seed=seed)
    noisy, noisy_k = simulate(prior, 0.8, seed=seed)  # the draft cost measured on a busy machine too
    assert clean.k == noisy.k == true_best()
    assert noisy_k[100:] == [true_best()] * (len(noisy_k) - 100)  # corrected within a run of ~100 steps
    assert clean_k[20:] == [true_best()] * (len(clean_k) - 20)  # a good measurement stays good


def test_untimed_steps_keep_the_acceptance_only_behaviour():
    pol = AdaptiveVerifyLength(7, TRUE_COST, prior=[0.3] * 7, every=4)
    k0 = pol.length()
    for _ in range(100):
        pol.observe(pol.length(), pol.length())
    assert pol.length() > k0 and pol.probe is None


# -- calibration -----------------------------------------------------------------------------------------
def test_untrustworthy_measurements_are_recognised():
    assert untrustworthy(VerifyCosts(tuple(TRUE_COST), 0.1, 0.1)) is None
    assert "cheaper" in untrustworthy(VerifyCosts(tuple(BUSY), 0.1, 0.1))
    assert "disagree" in untrustworthy(VerifyCosts(tuple(TRUE_COST), 0.1, 0.1, spread=0.8))
    near = VerifyCosts(tuple(c * 1.05 for c in TRUE_COST), 0.1, 0.1)
    far = VerifyCosts(tuple(c * 2 for c in TRUE_COST), 0.1, 0.1)
    assert untrustworthy(near, VerifyCosts(tuple(TRUE_COST), 0.1, 0.1)) is None
    assert "away from" in untrustworthy(far, VerifyCosts(tuple(TRUE_COST), 0.1, 0.1))


@pytest.fixture
def fake_measure(monkeypatch):
    """``measure_costs`` that returns scripted measurements (busy machine first)."""
    script: list[VerifyCosts] = []
    calls = []

    def measure(_pipe, **_kw):
        calls.append(1)
        return script.pop(0) if len(script) > 1 else script[0]

    monkeypatch.setattr(calibrate, "measure_costs", measure)
    monkeypatch.setattr(calibrate, "cache_key", lambda _pipe: "key")
    return script, calls


def test_a_busy_measurement_is_repeated_and_only_the_clean_one_cached(tmp_path, fake_measure):
    script, calls = fake_measure
    clean = VerifyCosts(tuple(TRUE_COST), 0.1, 0.15, 0.05)
    script += [VerifyCosts(tuple(BUSY), 0.8, 0.3, 0.9), clean]
    f = tmp_path / "calibration.json"
    assert cached_costs(None, f) == clean and len(calls) == 2
    assert json.loads(f.read_text())["key"]["verify"] == list(TRUE_COST)


def test_a_measurement_that_never_settles_is_not_cached(tmp_path, fake_measure):
    script, calls = fake_measure
    script += [VerifyCosts(tuple(BUSY), 0.8, 0.3, 0.9)]
    f = tmp_path / "calibration.json"
    costs = cached_costs(None, f)
    assert len(calls) == calibrate.ATTEMPTS and not f.exists()
    assert list(costs.verify) == sorted(costs.verify)  # used for this run only, made monotone


def test_a_poisoned_cache_entry_is_measured_again(tmp_path, fake_measure):
    script, calls = fake_measure
    clean = VerifyCosts(tuple(TRUE_COST), 0.1, 0.15, 0.05)
    script += [clean]
    f = tmp_path / "calibration.json"
    f.write_text(json.dumps({"key": {"verify": BUSY, "draft": 0.8, "one_token_seconds": 0.3}}))
    assert cached_costs(None, f) == clean and len(calls) == 1
    assert json.loads(f.read_text())["key"]["verify"] == list(TRUE_COST)
    assert cached_costs(None, f) == clean and len(calls) == 1  # now cached


@pytest.mark.parametrize("start", range(0, 40, 3))
def test_a_busy_spell_during_calibration_leaves_every_cost_exact(monkeypatch, start):
    """A spell as long as all repetitions of one size (here 4 forwards at 1.6x) cannot inflate any
    size: sizes are timed in interleaved rounds and the least time kept. Timing each size's
    repetitions back to back let such a spell make 9-token trees look 25% dearer than they were."""
    clock = {"t": 0.0, "calls": 0}
    reps = 3
    spell = range(start, start + reps + 1)
    true = {n: 0.05 * TRUE_COST[n - 1] for n in range(1, 9)}

    def job(n):
        def run():
            slow = 1.6 if clock["calls"] in spell else 1.0
            clock["t"] += true[n] * slow
            clock["calls"] += 1

        return run

    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: clock["t"])
    best, spreads = calibrate._timed_rounds({n: job(n) for n in true}, reps, torch.device("cpu"))
    assert clock["calls"] == 8 * (reps + 1)
    assert best == pytest.approx(true)
    assert len(spreads) == 8
