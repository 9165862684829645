"""Issue 46: one `dflash train` per run folder (a lock held for the run, stale locks taken over), and
a damaged run folder stops `--resume` with exit 4 naming the file, before anything is written."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
F32 = ["--dtype", "float32", "--device", "cpu"]


def dflash(*args: str, home: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python -m dflash_cli ARGS` in a real process."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "DFLASH_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hf"),
    }
    env.pop("PYTEST_CURRENT_TEST", None)  # the CLI's own error lines, as a user sees them
    cmd = [sys.executable, "-m", "dflash_cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("dflash: error:")]


HOLD = """
import sys, time
from pathlib import Path
from runtime.train.lock import RunFolderLock
lock = RunFolderLock(Path(sys.argv[1])).acquire()
print("locked", flush=True)
time.sleep(600)
"""


def _holder(folder: Path) -> subprocess.Popen[str]:
    """A second process that takes the run folder's lock and keeps it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def _data_only(target: Path, out: Path) -> list[str]:
    return ["train", "--target", str(target), "--out", str(out), "--data-only", "--prompts", "2"] + [
        "--answer-tokens",
        "4",
        "--gen-batch",
        "2",
        *F32,
    ]


# -- defect 7: two trainers on one run folder ---------------------------------------------------------
def test_a_second_train_on_a_locked_run_folder_exits_2_naming_it_and_the_holder(tiny_pair, tmp_path):
    target, _ = tiny_pair
    out = tmp_path / "run"
    holder = _holder(out)
    try:
        r = dflash(*_data_only(target, out), home=tmp_path / "home")
        assert r.returncode == 2, r.stderr
        errors = _errors(r.stderr)
        assert len(errors) == 1, r.stderr
        assert str(out) in errors[0] and f"pid {holder.pid}" in errors[0] and "Traceback" not in r.stderr
        assert not (out / "data").exists()  # it wrote nothing
        # --resume and --eval-only wait their turn too
        for extra in (["--resume", "--steps", "1"], ["--eval-only"]):
            r = dflash("train", "--target", str(target), "--out", str(out), *extra, *F32, home=tmp_path / "home")
            assert r.returncode == 2 and f"pid {holder.pid}" in r.stderr, r.stderr
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_lock_of_a_killed_run_is_taken_over_and_released_on_exit(tiny_pair, tmp_path):
    target, _ = tiny_pair
    out = tmp_path / "run"
    holder = _holder(out)
    os.kill(holder.pid, signal.SIGKILL)  # dies holding it: the lock file stays, with its pid inside
    holder.wait()
    assert (out / ".lock").read_text().strip() == str(holder.pid)
    r = dflash(*_data_only(target, out), home=tmp_path / "home")
    assert r.returncode == 0, r.stderr
    assert (out / "data" / "dataset.json").is_file()
    assert not (out / ".lock").exists()  # released on exit
    # and the folder is free for the next command
    r = dflash(*_data_only(target, out), home=tmp_path / "home")
    assert r.returncode == 0, r.stderr


def test_two_trainers_started_together_one_wins(tiny_pair, tmp_path):
    """Two real `dflash train` processes on one folder: exactly one runs, the other exits 2."""
    target, _ = tiny_pair
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTEST_CURRENT_TEST", None)
    cmd = [sys.executable, "-m", "dflash_cli", *_data_only(target, out)]
    procs = []
    for i in range(2):
        home = {"DFLASH_HOME": str(tmp_path / f"home{i}"), "HF_HUB_CACHE": str(tmp_path / f"home{i}" / "hf")}
        procs.append(subprocess.Popen(cmd, env={**env, **home}, cwd=ROOT, stderr=subprocess.PIPE, text=True))
        time.sleep(0.3)
    results = [(p.wait(timeout=300), p.stderr.read() if p.stderr else "") for p in procs]
    codes = sorted(code for code, _ in results)
    # either the second started while the first held the folder (0, 2), or after it had finished (0, 0)
    assert codes in ([0, 2], [0, 0]), results
    for code, err in results:
        if code == 2:
            assert "is in use by another dflash train" in err and str(out) in err
    assert not (out / ".lock").exists()


# -- defect 8: --resume with a damaged run folder -----------------------------------------------------
@pytest.fixture(scope="module")
def run_folder(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A real run folder trained for 2 steps on the tiny pair's target: (target, run folder)."""
    root = tmp_path_factory.mktemp("run")
    target = tiny_pair[0]
    out = root / "run"
    args = ["train", "--target", str(target), "--out", str(out), "--prompts", "8", "--answer-tokens", "8"]
    args += ["--gen-batch", "2", "--steps", "2", "--block-size", "4", "--anchors", "4", "--draft-vocab", "full"]
    args += ["--no-eval", "--no-ood-eval", "--eval-every", "1000", *F32]
    r = dflash(*args, home=root / "home")
    assert r.returncode == 0, r.stderr
    assert (out / "checkpoint" / "config.json").is_file() and (out / "data-sources.json").is_file()
    return target, out


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("checkpoint/config.json", None),  # truncated: its first half
        ("data-sources.json", "{not json"),
        ("data-sources.json", '["/data"]'),  # a list
        ("data-sources.json", '{"data": 5, "extra_data": [], "corpus_data": []}'),  # wrong types
        ("data-sources.json", '{"data": "/x", "extra_data": "abc", "corpus_data": []}'),
        ("data-sources.json", '{"data": "/x", "extra_data": [], "corpus_data": [null]}'),
        ("data-sources.json", b"\xff\xfe\x00"),  # not UTF-8
    ],
)
def test_resume_with_a_damaged_run_folder_is_exit_4_naming_the_file(run_folder, tmp_path, name, content):
    import shutil

    target, src = run_folder
    out = tmp_path / "run"
    shutil.copytree(src, out)
    path = out / name
    if content is None:
        raw = path.read_bytes()
        path.write_bytes(raw[: len(raw) // 2])
    else:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    before = _digest(out)
    for extra in ([], ["--extend", "--steps", "2"]):
        r = dflash("train", "--target", str(target), "--out", str(out), "--resume", *extra, *F32, home=tmp_path / "h")
        errors = _errors(r.stderr)
        assert r.returncode == 4, r.stderr
        assert len(errors) == 1 and str(path) in errors[0] and "internal error" not in r.stderr, r.stderr
        assert _digest(out) == before  # nothing written: checkpoint, commands.txt, sources untouched
