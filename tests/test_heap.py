"""Freed memory kept in the heap on Linux CPUs (runtime.engine.models.heap), and its switch: the
runtime's configure(), which the CLI sets from DFLASH_KEEP_HEAP."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc on Linux only"
)


def _run(code: str, keep_heap_env: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_KEEP_HEAP"}
    if keep_heap_env is not None:
        env["DFLASH_KEEP_HEAP"] = keep_heap_env
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_the_heap_thresholds_are_raised_once_unless_turned_off():
    ask = "from runtime.engine.models import heap; {} print(heap.keep_heap(), heap.keep_heap())"
    assert _run(ask.format("")) == "True True"
    assert _run(ask.format("heap.configure(False);")) == "False False"


@pytest.mark.parametrize(("value", "kept"), [(None, "True"), ("0", "False"), ("off", "False"), ("1", "True")])
def test_the_cli_reads_dflash_keep_heap(value, kept):
    code = (
        "from dflash_cli.common import configure_kernels; from runtime.engine.models import heap; "
        "configure_kernels(); print(heap.keep_heap())"
    )
    assert _run(code, value) == kept
