"""Faults and hostile input (issue 11): each answered cleanly, nothing lost (tiny models only)."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from dflash_cli.app import app
from runtime.errors import ConfigError

runner = CliRunner()
F32 = ["--dtype", "float32", "--device", "cpu"]


def cli(*args: str, input: str | bytes = ""):  # noqa: A002
    return runner.invoke(app, list(args), input=input)


def one_line_error(r, code: int, *needles: str) -> None:
    assert r.exit_code == code, r.output
    assert r.stderr.startswith("dflash: error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.output
    for n in needles:
        assert n in r.stderr, (n, r.stderr)


def _no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a model would load."""
    import runtime.quantize.job as job

    def boom(*_a, **_k):
        raise AssertionError("a model was loaded before --out was checked")

    monkeypatch.setattr(job, "load_pipeline", boom)


# -- 1. dflash quantize --out/--force ---------------------------------------------------------------
def test_quantize_out_dot_force_never_empties_the_current_folder(tiny_pair, tmp_path, monkeypatch):
    t, d = tiny_pair
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "notes.txt").write_text("x\n")
    monkeypatch.chdir(scratch)
    _no_load(monkeypatch)
    for out in (".", "..", str(scratch)):
        r = cli("quantize", "--target", str(t), "--drafter", str(d), "--scheme", "int8", "--out", out, "--force", *F32)
        one_line_error(r, ConfigError.exit_code, "cannot be used", "current folder")
    assert sorted(p.name for p in scratch.iterdir()) == ["notes.txt"]
    assert (scratch / "notes.txt").read_text() == "x\n"


def test_quantize_force_never_replaces_home_or_root(tiny_pair, tmp_path, monkeypatch):
    t, _d = tiny_pair
    home = tmp_path / "home"
    home.mkdir()
    (home / "keep").write_text("k")
    monkeypatch.setenv("HOME", str(home))
    _no_load(monkeypatch)
    for out, why in ((str(home), "home folder"), ("/", "root folder")):
        r = cli("quantize", "--target", str(t), "--drafter", "none", "--scheme", "int8", "--out", out, "--force", *F32)
        one_line_error(r, ConfigError.exit_code, why)
    assert (home / "keep").read_text() == "k"


def test_quantize_unwritable_out_is_exit_2_before_loading(tiny_pair, tmp_path, monkeypatch):
    t, _d = tiny_pair
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    _no_load(monkeypatch)
    if os.geteuid() == 0:  # root writes anywhere: let the permission check see what a user would
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, m, **k: False if str(p) == str(locked) else real(p, m, **k))
    try:
        r = cli("quantize", "--target", str(t), "--drafter", "none", "--scheme", "int8", "--out", str(locked / "q"), *F32)
        one_line_error(r, ConfigError.exit_code, "cannot write", "permission denied")
    finally:
        locked.chmod(0o755)
