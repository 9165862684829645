"""Issue 46, defect 9: closed or unwritable standard streams and odd option values are one line and
a documented exit code (2), never an internal error; --threads beyond the CPUs warns.
Each case runs the real CLI in a shell that closes or redirects the stream."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def sh(tiny_pair: tuple[Path, Path], args: str, redirect: str, tmp_path: Path) -> subprocess.CompletedProcess[bytes]:
    """`dflash run` on the tiny pair through ``bash -c '... REDIRECT'`` (bytes, stderr captured)."""
    t, d = tiny_pair
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "DFLASH_HOME": str(tmp_path / "home"),
    }
    env.pop("PYTEST_CURRENT_TEST", None)  # the CLI's own error lines, not the tests' tracebacks
    cli = [sys.executable, "-m", "dflash_cli", "run", "--target", str(t), "--drafter", str(d)]
    cli += ["--dtype", "float32", "--device", "cpu", "--raw", "-n", "8"]
    cmd = " ".join(map(shlex.quote, cli)) + f" {args} {redirect}"
    return subprocess.run(["bash", "-c", cmd], capture_output=True, env=env, cwd=ROOT, timeout=300)


def one_error(p: subprocess.CompletedProcess[bytes], code: int, needle: str) -> None:
    err = p.stderr.decode(errors="replace")
    errors = [line for line in err.splitlines() if line.startswith("dflash: error:")]
    assert p.returncode == code, err
    assert len(errors) == 1 and needle in errors[0], err
    assert "internal error" not in err and "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.parametrize(
    ("args", "redirect", "needle"),
    [
        ("-", "<&-", "stdin is closed"),
        ("", "<&-", "stdin is closed"),
        ("hello", ">&-", "stdout is closed"),
        ("hello", "> /dev/full", "cannot write to stdout: No space left on device"),
        ("--json hello", "> /dev/full", "cannot write to stdout: No space left on device"),
        ("--device cuda:x hello", "", "unknown device 'cuda:x'"),
        ("--seed 18446744073709551616 --temperature 0.8 hello", "", "seed must be between"),
    ],
)
def test_broken_streams_and_odd_values_are_exit_2_with_one_line(tiny_pair, tmp_path, args, redirect, needle):
    one_error(sh(tiny_pair, args, redirect, tmp_path), 2, needle)


def test_a_closed_stdin_is_not_needed_when_the_prompt_is_an_argument(tiny_pair, tmp_path):
    p = sh(tiny_pair, "hello", "<&-", tmp_path)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    assert p.stdout  # the completion


def test_the_largest_seed_still_samples(tiny_pair, tmp_path):
    p = sh(tiny_pair, "--seed 18446744073709551615 --temperature 0.8 hello", "", tmp_path)
    assert p.returncode == 0, p.stderr.decode(errors="replace")


def test_threads_beyond_the_cpus_warn_on_one_line(tiny_pair, tmp_path):
    cpus = len(os.sched_getaffinity(0))
    many = cpus + 1  # one more is enough to warn (hundreds of threads on 2 cores only make the test slow)
    p = sh(tiny_pair, f"--threads {many} hello", "", tmp_path)
    err = p.stderr.decode(errors="replace")
    assert p.returncode == 0, err
    warnings = [line for line in err.splitlines() if "--threads" in line]
    assert len(warnings) == 1 and warnings[0].startswith("dflash: warning:"), err
    assert f"--threads {many} is more than the {cpus} CPU(s)" in warnings[0]
    p = sh(tiny_pair, f"--threads {cpus} hello", "", tmp_path)
    assert p.returncode == 0 and b"--threads" not in p.stderr
