"""$DFLASH_HOME/calibration.json (measured verify costs, ``runtime.engine.calibrate``) is read
through one schema: contents that do not fit it are ignored with one line naming the file and the
costs are measured again; costs that cannot be real (1e300, inf) are not trusted."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from dflash_cli.app import app
from runtime.engine.calibrate import VerifyCosts, cache_key, untrustworthy

runner = CliRunner()


@pytest.fixture(scope="module")
def pair_args(tiny_pair):
    t, d = tiny_pair
    return ["run", "--target", str(t), "--drafter", str(d), "--dtype", "float32", "-n", "8", "--raw", "def fib(n):"]


@pytest.fixture(scope="module")
def reference(pair_args, tmp_path_factory) -> str:
    home = tmp_path_factory.mktemp("calib-ref")
    r = runner.invoke(app, pair_args, env={"DFLASH_HOME": str(home)})
    assert r.exit_code == 0, r.output
    return r.stdout


BAD = {
    "list": b"[1, 2, 3]",
    "string": b'"x"',
    "null": b"null",
    "binary": bytes(range(256)),
    "truncated": b'{"a|b": {"verify": [1.0, 1.1',
    "wrong types": json.dumps({"k": {"verify": "fast", "draft": 0.5, "one_token_seconds": 0.01}}).encode(),
    "no costs": json.dumps({"k": {"draft": 0.5}}).encode(),
}


@pytest.mark.parametrize("contents", [*BAD, "directory"])
def test_a_calibration_file_that_is_not_costs_is_ignored_with_one_line(pair_args, reference, tmp_path, contents):
    home = tmp_path / "home"
    home.mkdir()
    path = home / "calibration.json"
    if contents == "directory":
        path.mkdir()
    else:
        path.write_bytes(BAD[contents])
    r = runner.invoke(app, pair_args, env={"DFLASH_HOME": str(home)})
    assert r.exit_code == 0, r.output
    assert r.stdout == reference
    lines = [ln for ln in r.stderr.splitlines() if str(path) in ln]
    assert len(lines) == 1 and "ignor" in lines[0], r.stderr
    assert "internal error" not in r.stderr
    if contents != "directory":  # the ignored contents are gone: the next run reads a valid file
        assert isinstance(json.loads(path.read_text()), dict)


@pytest.mark.parametrize(
    "costs",
    [
        VerifyCosts((1.0, 1e300), 0.5, 0.01),
        VerifyCosts((1.0, math.inf), 0.5, 0.01),
        VerifyCosts((1.0, math.nan), 0.5, 0.01),
        VerifyCosts((1.0, 1.1), 1e300, 0.01),
        VerifyCosts((1.0, 1.1), math.inf, 0.01),
        VerifyCosts((1.0, 1.1), 0.5, math.inf),
        VerifyCosts((1.0, 1.1), 0.5, 0.0),
        VerifyCosts((1.0, 1.1), 0.5, 0.01, spread=math.nan),
        VerifyCosts((1e-300, 1.0), 0.5, 0.01),
    ],
)
def test_implausible_costs_are_untrustworthy(costs):
    assert untrustworthy(costs) is not None


def test_plausible_costs_stay_trusted():
    assert untrustworthy(VerifyCosts((1.0, 1.02, 1.05, 1.3, 2.0, 3.9), 0.4, 0.05, spread=0.1)) is None


@pytest.mark.parametrize("absurd", [1e300, "inf"])
def test_absurd_cached_costs_are_measured_again(tiny_pair, tmp_path, absurd):
    """A stored entry for this very setup with absurd costs is not used: the run measures again."""
    from runtime import ModelRef, RuntimeConfig, load_pipeline
    from runtime.session import calibrate

    t, d = tiny_pair
    pipe = load_pipeline(ModelRef(target=str(t), drafter=str(d)), RuntimeConfig(dtype="float32"))
    path = tmp_path / "calibration.json"
    value = "Infinity" if absurd == "inf" else repr(absurd)
    verify = ", ".join(["1.0"] + [value] * 64)
    path.write_text(f'{{"{cache_key(pipe)}": {{"verify": [{verify}], "draft": {value}, "one_token_seconds": 0.01}}}}')
    calibrate(pipe, path)
    costs = pipe.costs
    assert costs is not None
    assert all(math.isfinite(x) and x < 1e3 for x in costs.verify) and costs.draft < 1e3


def test_the_line_names_the_file_and_the_run_measures(tiny_pair, tmp_path, capsys):
    from runtime import ModelRef, RuntimeConfig, load_pipeline
    from runtime.session import calibrate

    t, d = tiny_pair
    pipe = load_pipeline(ModelRef(target=str(t), drafter=str(d)), RuntimeConfig(dtype="float32"))
    path = tmp_path / "calibration.json"
    path.write_text("[1, 2, 3]")
    calibrate(pipe, path)
    err = capsys.readouterr().err.splitlines()
    assert len([ln for ln in err if str(path) in ln]) == 1, err
    assert pipe.costs is not None and len(pipe.costs.verify) >= 1
    stored = json.loads(path.read_text())  # a valid file now: this measurement where it was trustworthy
    assert stored == {} or list(stored) == [cache_key(pipe)]
    calibrate(pipe, path)  # read without a word from now on
    assert str(path) not in capsys.readouterr().err
