"""Freed memory kept in the heap on Linux CPUs (runtime.engine.models.heap), and its switch."""

import os
import platform
import subprocess
import sys

import pytest

ASK = "from runtime.engine.models.heap import keep_heap; print(keep_heap(), keep_heap())"


def _run(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_KEEP_HEAP"}
    if env_value is not None:
        env["DFLASH_KEEP_HEAP"] = env_value
    r = subprocess.run([sys.executable, "-c", ASK], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc on Linux only")
def test_the_heap_thresholds_are_raised_once_and_can_be_turned_off():
    assert _run(None) == "True True"
    assert _run("0") == "False False"
