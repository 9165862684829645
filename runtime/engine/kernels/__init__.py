"""Small native kernels for CPU decode steps, compiled on first use (no build step at install).

``int8_gemm``: int8 weight-only GEMM with float32 activations and accumulation (AVX2 + FMA,
OpenMP), ``int8_gemm.c``. ATen's own ``_weight_int8pack_mm`` reaches about a third of the memory
bandwidth on AVX2 CPUs and takes bf16 activations; this one reads each weight row once per call
for all rows of a verify block, and computes every row exactly as it would alone (the lossless
contract of greedy DFlash).

The shared library is built with the system C compiler (``cc``, ``gcc`` or ``clang`` on PATH) into
a cache folder (``configure``; default ``~/.cache/dflash/kernels``, the CLI passes
``$DFLASH_HOME/kernels``), keyed by a hash of the source and flags, and loaded with ctypes. Where
there is no compiler, no AVX2/FMA, or native kernels are switched off (``configure(enabled=False)``;
the CLI's ``DFLASH_NATIVE=0``), ``int8_gemm()`` returns None and callers use ATen's kernel instead
(one line on stderr says why).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("int8_gemm.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]

Int8Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

_loaded: dict[str, Int8Gemm | None] = {}
_why_not: dict[str, str] = {}
_settings: dict[str, Any] = {"enabled": True, "cache": None}


def configure(enabled: bool = True, cache: Path | None = None) -> None:
    """Process-wide settings, before the first model loads: use native kernels at all, and where to
    keep compiled ones (None: ``~/.cache/dflash/kernels``). Changing them forgets a loaded kernel."""
    if enabled != _settings["enabled"] or cache != _settings["cache"]:
        _loaded.clear()
        _why_not.clear()
    _settings.update(enabled=enabled, cache=cache)


def cache_dir() -> Path:
    """Where compiled kernels are kept."""
    cache = _settings["cache"]
    return Path(cache) if cache is not None else Path.home() / ".cache" / "dflash" / "kernels"


def _cpu_ok() -> str | None:
    if sys.platform != "linux" or os.uname().machine not in ("x86_64", "AMD64"):
        return "not an x86-64 Linux machine"
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return "cannot read /proc/cpuinfo"
    if "avx2" not in flags or "fma" not in flags:
        return "this CPU has no AVX2/FMA"
    return None


def _compiler() -> str | None:
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return name
    return None


def _build(dest: Path) -> str | None:
    """Compile the kernel to ``dest``; None on success, else the reason."""
    cc = _compiler()
    if cc is None:
        return "no C compiler (cc, gcc or clang) on PATH"
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        out = Path(tmp) / dest.name
        r = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(out)], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            return f"{cc} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
        out.replace(dest)  # atomic: concurrent processes never load a half-written file
    return None


def int8_gemm() -> Int8Gemm | None:
    """The compiled int8 GEMM, ``f(x [M, K] f32, w [N, K] int8, scale [N] f32, bias [N] f32 | None)
    -> y [M, N] f32``, or None where it cannot run here (see ``why_not``)."""
    if "int8" in _loaded:
        return _loaded["int8"]
    fn = None
    why = None
    if not _settings["enabled"]:
        why = "switched off: DFLASH_NATIVE=0"
    else:
        why = _cpu_ok()
    if why is None:
        key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
        lib_path = cache_dir() / f"int8_gemm-{key}.so"
        if not lib_path.exists():
            try:
                why = _build(lib_path)
            except (OSError, subprocess.SubprocessError) as e:
                why = f"build failed: {e}"
        if why is None:
            try:
                fn = _wrap(ctypes.CDLL(str(lib_path)).dflash_int8_gemm)
            except (OSError, AttributeError) as e:
                why = f"cannot load {lib_path.name}: {e}"
    if why is not None:
        _why_not["int8"] = why
        print(f"dflash: native int8 kernel unavailable ({why}); using ATen's int8 GEMM", file=sys.stderr)
    _loaded["int8"] = fn
    return fn


def why_not() -> str | None:
    """Why ``int8_gemm()`` returned None (None when it did not, or was not asked yet)."""
    return _why_not.get("int8")


def _wrap(c_fn: ctypes._NamedFuncPointer) -> Int8Gemm:
    c_fn.restype = None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    c_fn.argtypes = [p, i64, i64, p, p, p, i64, p, ctypes.c_int]

    def gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        m, k = x.shape
        n = w.shape[0]
        y = torch.empty((m, n), dtype=torch.float32)
        c_fn(
            x.data_ptr(),
            m,
            k,
            w.data_ptr(),
            scale.data_ptr(),
            bias.data_ptr() if bias is not None else None,
            n,
            y.data_ptr(),
            torch.get_num_threads(),
        )
        return y

    return gemm
