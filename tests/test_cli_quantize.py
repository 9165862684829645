"""`dflash quantize` and `--quantize`: stdout/stderr contract, exit codes, error cases (tiny models)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dflash_cli.app import app
from dflash_cli.commands.quantize import SchemeChoice
from runtime.errors import ConfigError, ModelLoadError
from runtime.models.quant_schemes import SCHEMES
from runtime.models.quantized import QUANT_KEY
from tests.fakes import one_line_error

runner = CliRunner()
F32 = ["--dtype", "float32", "--device", "cpu"]


def cli(*args: str):
    return runner.invoke(app, list(args), input="")


@pytest.fixture(scope="module")
def int8_dir(tiny_pair, tmp_path_factory):
    """The tiny pair quantized to int8 by the CLI (target + drafter), with --report and --json."""
    t, d = tiny_pair
    out = tmp_path_factory.mktemp("cli") / "q8"
    r = cli(
        "quantize", "--target", str(t), "--drafter", str(d), "--scheme", "int8", "--out", str(out), *F32,
        "--report", "--report-tokens", "8", "--report-prompts", "1", "--json",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    return out, r


def test_scheme_choices_match_the_runtime():
    assert [c.value for c in SchemeChoice] == list(SCHEMES)


def test_quantize_json_summary_and_report(int8_dir):
    out, r = int8_dir
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1  # stdout: one JSON document, nothing else
    doc = json.loads(lines[0])
    assert doc["scheme"] == "int8" and doc["library"] == "torchao" and doc["out"] == str(out)
    assert doc["drafter_out"] == str(out / "drafter")
    assert doc["disk_after"] < doc["disk_before"] and doc["memory_after"] < doc["memory_before"]
    assert doc["reload_max_diff"] == 0.0 and doc["load_seconds_after"] > 0
    rep = doc["report"]
    assert rep["unquantized"]["lossless"] is True and rep["quantized"]["lossless"] is True
    assert rep["quantized"]["dflash"]["generated_tokens"] == 8 and "tau" in rep["quantized"]["dflash"]
    assert 0 <= rep["agreement"] <= 1
    # the summary tables and progress go to stderr
    for needle in ("target weights on disk", "pair load time", "tau", "greedy tokens matching", "run it with"):
        assert needle in r.stderr, needle


def test_plain_stdout_is_the_folder(tiny_pair, tmp_path):
    t, _d = tiny_pair
    out = tmp_path / "q4"
    r = cli("quantize", "--target", str(t), "--drafter", "none", "--scheme", "int4", "-o", str(out), *F32)
    assert r.exit_code == 0, r.output
    assert r.stdout == f"{out}\n"
    assert "quantized at load" in r.stderr and f"dflash run --target {out}" in r.stderr
    assert json.loads((out / "config.json").read_text())[QUANT_KEY]["scheme"] == "int4"
    assert not (out / "drafter").exists()


def test_saved_pair_runs_and_matches_on_the_fly(tiny_pair, int8_dir):
    """`run --target OUT` loads the folder; its greedy text equals `run --quantize int8` on the original."""
    t, d = tiny_pair
    out, _ = int8_dir
    prompt = ["--raw", "-n", "12", "def fib(n):"]
    saved = cli("run", "--target", str(out), "--drafter", str(out / "drafter"), *F32, *prompt)
    fly = cli("run", "--target", str(t), "--drafter", str(d), "--quantize", "int8", *F32, *prompt)
    float_ = cli("run", "--target", str(t), "--drafter", str(d), *F32, *prompt)
    ar = cli("run", "--target", str(out), "--drafter", "none", "--decoder", "ar", *F32, *prompt)
    assert saved.exit_code == fly.exit_code == float_.exit_code == ar.exit_code == 0, saved.output + fly.output
    assert saved.stdout == fly.stdout == ar.stdout  # lossless w.r.t. the quantized target
    assert saved.stdout != float_.stdout  # and quantization did change this tiny model's output
    assert saved.stderr == ""  # no library noise
    # no --drafter: the one recorded (a fixed verify length: on a tiny target the measured costs may
    # rightly say drafting does not pay, and the runtime would then verify nothing)
    recorded = cli("run", "--target", str(out), *F32, "--json", "--verify-length", "3", *prompt)
    assert recorded.exit_code == 0, recorded.output
    stats = json.loads(recorded.stdout.splitlines()[-1])["stats"]
    assert stats["decoder"] == "dflash" and stats["drafted_tokens"] > 0


def test_run_json_with_quantize(tiny_pair):
    t, d = tiny_pair
    r = cli("run", "--target", str(t), "--drafter", str(d), "--quantize", "int4", *F32, "--json", "-n", "6", "hi")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.splitlines()[-1])["stats"]["generated_tokens"] == 6


# -- errors ------------------------------------------------------------------------------------------


def test_unknown_scheme(tiny_pair, tmp_path):
    t, _d = tiny_pair
    r = cli("quantize", "--target", str(t), "--scheme", "int3", "--out", str(tmp_path / "x"))
    assert r.exit_code == 2 and "int3" in r.stderr
    r = cli("run", "--target", str(t), "--drafter", "none", "--quantize", "int3", *F32, "hi")
    one_line_error(r, ConfigError.exit_code, "int3", "int8, int4, q4, bnb-int8, bnb-nf4")


@pytest.mark.parametrize("scheme", ["bnb-int8", "bnb-nf4"])
def test_bitsandbytes_on_cpu(tiny_pair, tmp_path, scheme):
    t, _d = tiny_pair
    r = cli("quantize", "--target", str(t), "--scheme", scheme, "--out", str(tmp_path / "x"), *F32)
    one_line_error(r, ConfigError.exit_code, "needs a CUDA GPU", "--scheme int8 or int4")
    assert not (tmp_path / "x").exists()
    r = cli("run", "--target", str(t), "--drafter", "none", "--quantize", scheme, *F32, "hi")
    one_line_error(r, ConfigError.exit_code, "needs a CUDA GPU")


def test_library_not_installed(tiny_pair, tmp_path, monkeypatch):
    import runtime.models.quant_schemes as q

    real = q.library_installed
    monkeypatch.setattr(q, "library_installed", lambda name: False if name == "torchao" else real(name))
    t, _d = tiny_pair
    r = cli("quantize", "--target", str(t), "--scheme", "int8", "--out", str(tmp_path / "x"), *F32)
    one_line_error(r, ConfigError.exit_code, "torchao", "pip install")
    r = cli("run", "--target", str(t), "--drafter", "none", "--quantize", "int4", *F32, "hi")
    one_line_error(r, ConfigError.exit_code, "pip install")


def test_already_quantized_input(int8_dir, tmp_path):
    out, _ = int8_dir
    r = cli("quantize", "--target", str(out), "--drafter", "none", "--scheme", "int4", "--out", str(tmp_path / "y"))
    one_line_error(r, ConfigError.exit_code, "already quantized (int8)")
    r = cli("run", "--target", str(out), "--drafter", "none", "--quantize", "int8", *F32, "hi")
    one_line_error(r, ConfigError.exit_code, "already quantized")


def test_foreign_quantized_input(tiny_pair, tmp_path):
    import shutil

    t, _d = tiny_pair
    gptq = tmp_path / "gptq"
    shutil.copytree(t, gptq)
    cfg = json.loads((gptq / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (gptq / "config.json").write_text(json.dumps(cfg))
    r = cli("quantize", "--target", str(gptq), "--drafter", "none", "--scheme", "int8", "--out", str(tmp_path / "z"))
    one_line_error(r, ConfigError.exit_code, "already quantized (gptq)")


def test_out_folder_is_never_clobbered_without_force(tiny_pair, tmp_path):
    t, _d = tiny_pair
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    args = ["quantize", "--target", str(t), "--drafter", "none", "--scheme", "int8", "--out", str(out), *F32]
    r = cli(*args)
    one_line_error(r, ConfigError.exit_code, "--force")
    assert (out / "keep.txt").read_text() == "mine"
    r = cli(*args, "--force")  # not a folder dflash wrote: --force does not replace it either
    one_line_error(r, ConfigError.exit_code, "not a folder written by dflash quantize")
    assert (out / "keep.txt").read_text() == "mine"
    mine = tmp_path / "mine"
    r = cli(*args[: -len(F32) - 2], "--out", str(mine), *F32)
    assert r.exit_code == 0, r.output
    (mine / "stale.txt").write_text("old output")
    r = cli(*args[: -len(F32) - 2], "--out", str(mine), *F32, "--force")  # a folder dflash wrote: replaced
    assert r.exit_code == 0, r.output
    assert not (mine / "stale.txt").exists() and (mine / "config.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_out_inside_the_source_and_nothing_to_quantize(tiny_pair, tmp_path):
    t, _d = tiny_pair
    r = cli("quantize", "--target", str(t), "--drafter", "none", "--scheme", "int8", "--out", str(t / "q"), *F32)
    one_line_error(r, ConfigError.exit_code, "overlaps")
    assert not (t / "q").exists()
    r = cli(
        "quantize", "--target", str(t), "--drafter", "none", "--quantize-drafter", "--scheme", "int8",
        "--out", str(tmp_path / "q"), *F32,
    )  # fmt: skip
    one_line_error(r, ConfigError.exit_code, "no drafter")


def test_saved_folder_with_unknown_scheme(int8_dir, tmp_path):
    import shutil

    out, _ = int8_dir
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg[QUANT_KEY]["scheme"] = "fp3"
    (bad / "config.json").write_text(json.dumps(cfg))
    r = cli("run", "--target", str(bad), "--drafter", "none", *F32, "hi")
    one_line_error(r, ModelLoadError.exit_code, "fp3", "upgrade dflash")
