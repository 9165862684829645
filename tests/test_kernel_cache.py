"""The native kernels' cache ($DFLASH_HOME/kernels/gemm-<key>.so): a library is loaded only when it
is the one this source, compiler and flags built. A truncated, overwritten, foreign or junk file at
the cached name is rebuilt (one line on stderr says so) and the decoded text stays the same; nothing
crashes. These run real builds with the system compiler, in subprocesses (a bad library could kill
the process that loads it)."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.engine.models import kernels

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    kernels._cpu_ok() is not None or kernels._compiler() is None,
    reason=f"the native kernels cannot be built here: {kernels._cpu_ok() or 'no C compiler'}",
)

# Greedy DFlash and plain decoding of a tiny float32 target whose layers run on the native kernels
# (float32 GEMM + the native layer stack where the library loads; PyTorch's layers where it does
# not). Prints the ids and whether the native layers ran.
DECODE = """
import json, sys
from dflash_cli.common import configure_kernels
configure_kernels()
from runtime.engine.models.lean_target import LeanTarget
from tests.fakes import greedy_pair, make_drafter, make_target
model = make_target("qwen2", vocab_size=96, seed=3)
lean = LeanTarget(model, native_f32=True)
drafter = make_drafter(model.config, block_size=6, taps=[0, 2, 3])
plain, spec = greedy_pair(lean, drafter, [5, 17, 3, 60], 16, block_size=6)
print(json.dumps({"plain": plain, "dflash": spec, "native": lean.native_layers}))
"""

FOREIGN_WITH_SYMBOLS = r"""
#include <stdint.h>
int dflash_int8_isa(int want) { (void)want; return 0; }
int dflash_int8_gemm(const float *x, int64_t m, int64_t k, const void *w, const float *s, const float *b,
                     int64_t n, float *y, int threads) { for (int64_t i = 0; i < m * n; i++) y[i] = 0.5f; return 0; }
void dflash_bf16_gemm(const float *x, int64_t m, int64_t k, const void *w, const float *b, int64_t n, float *y,
                      int threads) { for (int64_t i = 0; i < m * n; i++) y[i] = 0.5f; }
void dflash_f32_gemm(const float *x, int64_t m, int64_t k, const float *w, const float *b, int64_t n, float *y,
                     int threads) { for (int64_t i = 0; i < m * n; i++) y[i] = 0.5f; }
int dflash_layers(void) { return 0; }
"""

FOREIGN_WITHOUT_SYMBOLS = "int something_else(int a) { return a + 1; }\n"


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "DFLASH_HOME": str(home), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}
    env.pop("DFLASH_NATIVE", None)
    return env


def _decode(home: Path) -> tuple[subprocess.CompletedProcess[str], dict | None]:
    r = subprocess.run(
        [sys.executable, "-c", DECODE], capture_output=True, text=True, env=_env(home), cwd=ROOT, timeout=300
    )
    out = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else None
    return r, out


def _dflash_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("dflash:")]


def _library(home: Path) -> Path:
    (lib,) = (home / "kernels").glob("gemm-*.so")
    return lib


def _text_section(lib: bytes) -> tuple[int, int]:
    """(file offset, size) of an ELF64 library's .text section."""
    shoff = struct.unpack_from("<Q", lib, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", lib, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", lib, shoff + i * shentsize) for i in range(shnum)]
    names = sections[shstrndx][4]
    for name, _, _, _, offset, size in sections:
        if lib[names + name : names + name + 6] == b".text\0":
            return offset, size
    raise AssertionError("no .text section")


def _compile(src: str, out: Path) -> Path:
    c = out.with_suffix(".c")
    c.write_text(src)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", str(c), "-o", str(out)], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, bytes]:
    """A DFLASH_HOME with the kernels built once by a decode, that decode's output and the library."""
    home = tmp_path_factory.mktemp("kernels-home")
    r, out = _decode(home)
    assert r.returncode == 0 and out is not None, r.stderr
    assert out["native"], r.stderr  # the native layers ran: the library loads here
    assert out["plain"] == out["dflash"]
    assert _dflash_lines(r.stderr) == [], r.stderr
    return home, out, _library(home).read_bytes()


def _damaged(clean: tuple[Path, dict, bytes], tmp_path: Path, how: str) -> Path:
    home = tmp_path / "home"
    shutil.copytree(clean[0], home)
    lib = _library(home)
    good = clean[2]
    if how == "truncated":
        lib.write_bytes(good[:4096])
    elif how == "overwritten":
        data = bytearray(good)
        offset, size = _text_section(good)
        rng = random.Random(0)
        for i in range(offset + size // 4, offset + 3 * size // 4):
            data[i] = rng.randrange(256)
        lib.write_bytes(bytes(data))
    elif how == "foreign":
        _compile(FOREIGN_WITH_SYMBOLS, tmp_path / "foreign.so").replace(lib)
    elif how == "foreign-without-symbols":
        _compile(FOREIGN_WITHOUT_SYMBOLS, tmp_path / "other.so").replace(lib)
    elif how == "junk":
        lib.write_bytes(b"this is not a shared library\n")
    else:
        raise AssertionError(how)
    return home


@pytest.mark.parametrize("how", ["truncated", "overwritten", "foreign", "foreign-without-symbols", "junk"])
def test_a_damaged_or_foreign_library_is_rebuilt_and_the_text_is_unchanged(clean, tmp_path, how):
    home = _damaged(clean, tmp_path, how)
    r, out = _decode(home)
    assert r.returncode == 0, f"rc {r.returncode}: {r.stderr[-2000:]}"  # not a crash (SIGBUS/SIGSEGV)
    assert out == clean[1], r.stderr  # the same ids, through the native layers of a rebuilt library
    lines = _dflash_lines(r.stderr)
    assert len(lines) == 1 and "rebuil" in lines[0] and _library(home).name in lines[0], r.stderr
    assert _library(home).read_bytes() == clean[2]  # the cache holds this build's library again
    if how == "junk":  # a junk file used to stay: every run fell back, saying "file too short"
        again, out2 = _decode(home)  # now the next run loads the rebuilt library without a word
        assert out2 == clean[1] and _dflash_lines(again.stderr) == [], again.stderr


def test_a_truncated_library_does_not_stop_dflash_run(clean, tmp_path, tiny_pair):
    """The reported crash: `dflash run` died with a bus error, nothing on stderr, on every run."""
    target, drafter = tiny_pair
    args = [sys.executable, "-m", "dflash_cli", "run", "--target", str(target), "--drafter", str(drafter)]
    args += ["--dtype", "float32", "-n", "8", "--raw", "def fib(n):"]
    ref = subprocess.run(args, capture_output=True, text=True, env=_env(clean[0]), cwd=ROOT, timeout=300)
    assert ref.returncode == 0, ref.stderr
    home = _damaged(clean, tmp_path, "truncated")
    r = subprocess.run(args, capture_output=True, text=True, env=_env(home), cwd=ROOT, timeout=300)
    assert r.returncode == 0, f"rc {r.returncode}: {r.stderr[-2000:]}"
    assert r.stdout == ref.stdout
    lines = _dflash_lines(r.stderr)
    assert len(lines) == 1 and "rebuil" in lines[0], r.stderr


def test_a_library_missing_a_symbol_is_not_used(clean, tmp_path):
    """After loading, the library must offer every symbol dflash calls; where one is missing, one
    line says so and the decode runs on PyTorch's layers with the same text."""
    home = tmp_path / "home"
    shutil.copytree(clean[0], home)
    code = (
        "from runtime.engine.models.kernels import build\nbuild.SYMBOLS = (*build.SYMBOLS, 'dflash_not_there')\n"
        + DECODE
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(home), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert not out["native"] and out["plain"] == clean[1]["plain"] and out["dflash"] == clean[1]["dflash"]
    lines = _dflash_lines(r.stderr)
    assert lines and all("dflash_not_there" in ln for ln in lines), r.stderr
    assert len({ln.split(" kernel unavailable")[1] for ln in lines}) == 1  # one reason, said once per kernel


def test_importing_dflash_loads_no_library(clean, tmp_path):
    """Code that does not decode never loads the library: `import` of every module and
    `dflash --help` run even with a library that would crash the process at the cached name."""
    home = _damaged(clean, tmp_path, "truncated")
    code = (
        "import pkgutil, importlib, runtime, dflash_cli.app\n"
        "for m in pkgutil.walk_packages(runtime.__path__, 'runtime.'):\n"
        "    importlib.import_module(m.name)\n"
        "from runtime.engine.models import kernels\n"
        "assert 'lib' not in kernels._loaded\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(home), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run(
        [sys.executable, "-m", "dflash_cli", "--help"], capture_output=True, text=True, env=_env(home), cwd=ROOT
    )
    assert r.returncode == 0 and "run" in r.stdout, r.stderr[-2000:]
