"""The verify costs cannot be spoiled by a busy machine (issue 11): untrustworthy cost measurements
are repeated and never cached."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.engine import calibrate
from runtime.engine.calibrate import VerifyCosts, cached_costs, untrustworthy
from runtime.engine.costs import DEFAULT_COST

TRUE_COST = DEFAULT_COST["cpu"][:8]  # what a step really costs here (relative to one token), b = 8

BUSY = [1.0, 1.15, 0.33, 1.58, 0.33, 1.12, 2.63, 0.38]  # a cache measured while compiling on both cores
STEEP = [1.0, 1.9, 2.8, 3.7, 4.6, 5.5, 6.4, 7.3]  # a cache that made every run verify 1 draft


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
