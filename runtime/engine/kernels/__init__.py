"""Small native kernels for CPU decode steps, compiled on first use (no build step at install).

``gemm.c`` (AVX2 + FMA, OpenMP), float32 inputs and outputs:

- ``int8_gemm``: int8 weights (one scale per output row) x activations rounded per row to 15-bit
  integers, exact int32 sums. ATen's own ``_weight_int8pack_mm`` reaches about a third of the
  memory bandwidth on AVX2 CPUs and takes bf16 activations. On CPUs with AVX-512 VNNI the sums run
  as ``vpdpwssd`` (chosen at run time, ``int8_isa``): the same integers, identical results.
- ``bf16_gemm``: bfloat16 weights, widened to float32 exactly, float32 accumulation. On CPUs without native bf16
  (AVX2, AVX-512 without BF16) oneDNN and ATen emulate bf16 GEMMs several times slower than
  float32; this reads half float32's bytes at float32's arithmetic.
- ``f32_gemm``: float32 weights in register-blocked tiles (2 input rows x 4 weight rows). With
  float32's bytes a step of a few rows runs out of arithmetic sooner than with bf16 or int8 weights,
  so this one shares loads across a tile instead of streaming one weight row at a time.

All three read each weight row once per call for all rows of a verify block, and compute every row
exactly as it would alone (the lossless contract of greedy DFlash).

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

SOURCE = Path(__file__).with_name("gemm.c")
SOURCES = (SOURCE, Path(__file__).with_name("layers.c"))
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]

Int8Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
Bf16Gemm = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

_loaded: dict[str, Any] = {}
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
        cmd = [cc, *FLAGS, *(str(src) for src in SOURCES), "-o", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            return f"{cc} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
        out.replace(dest)  # atomic: concurrent processes never load a half-written file
    return None


def _source_key() -> str:
    return hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES) + " ".join(FLAGS).encode()).hexdigest()[:16]


def identity() -> str:
    """Which native kernels a process runs ("native-<hash of source and flags>-<int8 path>", or
    "off"): part of the key of cached speed measurements, which a kernel change invalidates."""
    return f"native-{_source_key()}-{int8_isa()}" if _library() is not None else "off"


_ISAS = ("avx2", "avx512vnni")


def int8_isa(want: str | None = None) -> str:
    """The int8 kernel's instruction set: "avx2", or "avx512vnni" where the CPU has AVX-512 VNNI
    (the default there). ``want`` switches it for this process ("avx2", or "best"); both compute
    the same integer sums, so results do not change. "off" where the library does not run."""
    lib = _library()
    if lib is None:
        return "off"
    fn = lib.dflash_int8_isa
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
    if want is not None:
        _loaded["isa"] = _ISAS[fn(0 if want == "avx2" else -1)]
    elif "isa" not in _loaded:
        _loaded["isa"] = _ISAS[fn(-1)]
    isa: str = _loaded["isa"]
    return isa


def _library() -> ctypes.CDLL | None:
    """The compiled kernels (built on first use), or None where they cannot run (see ``why_not``)."""
    if "lib" in _loaded:
        return _loaded["lib"]
    lib = None
    why = "switched off: DFLASH_NATIVE=0" if not _settings["enabled"] else _cpu_ok()
    if why is None:
        lib_path = cache_dir() / f"gemm-{_source_key()}.so"
        if not lib_path.exists():
            try:
                why = _build(lib_path)
            except (OSError, subprocess.SubprocessError) as e:
                why = f"build failed: {e}"
        if why is None:
            try:
                lib = ctypes.CDLL(str(lib_path))
            except OSError as e:
                why = f"cannot load {lib_path.name}: {e}"
    if why is not None:
        _why_not["lib"] = why
    _loaded["lib"] = lib
    return lib


def _kernel(name: str, symbol: str, wrap: Callable[[Any], Any], instead: str) -> Any:
    """A wrapped symbol of the library, loaded once; where the library cannot run, None and one
    line on stderr naming what is used instead."""
    if name not in _loaded:
        lib = _library()
        _loaded[name] = wrap(getattr(lib, symbol)) if lib is not None else None
        if lib is None:
            print(f"dflash: native {name} kernel unavailable ({why_not()}); using {instead}", file=sys.stderr)
    return _loaded[name]


def int8_gemm() -> Int8Gemm | None:
    """The compiled int8 GEMM, ``f(x [M, K] f32, w [N, K] int8, scale [N] f32, bias [N] f32 | None)
    -> y [M, N] f32``, or None where it cannot run here (see ``why_not``)."""
    fn: Int8Gemm | None = _kernel("int8", "dflash_int8_gemm", _wrap_int8, "ATen's int8 GEMM")
    return fn


def bf16_gemm() -> Bf16Gemm | None:
    """The compiled bf16-weight GEMM, ``f(x [M, K] f32, w [N, K] bf16, bias [N] f32 | None) -> y [M, N]
    f32``, or None where it cannot run here (see ``why_not``)."""
    fn: Bf16Gemm | None = _kernel("bf16", "dflash_bf16_gemm", _wrap_bf16, "ATen's bf16 GEMM")
    return fn


def f32_gemm() -> Bf16Gemm | None:
    """The compiled float32-weight GEMM, ``f(x [M, K] f32, w [N, K] f32, bias [N] f32 | None) -> y [M, N]
    f32``, or None where it cannot run here (see ``why_not``)."""
    fn: Bf16Gemm | None = _kernel("f32", "dflash_f32_gemm", _wrap_bf16, "oneDNN's float32 GEMM")
    return fn


class Proj(ctypes.Structure):
    """One projection of ``layers.c``: weights [n, k] (int8 + per-row scales, bf16 or float32), bias or NULL."""

    _fields_ = [
        ("w", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("kind", ctypes.c_int64),  # weights: 0 = bf16, 1 = int8, 2 = float32
    ]


class Layer(ctypes.Structure):
    """One decoder layer of ``layers.c`` (pointers into tensors the caller keeps alive)."""

    _fields_ = [
        ("qkv", Proj),
        ("o", Proj),
        ("gate_up", Proj),
        ("down", Proj),
        ("ln1", ctypes.c_void_p),
        ("ln2", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("eps1", ctypes.c_float),
        ("eps2", ctypes.c_float),
        ("qk_eps", ctypes.c_float),
        ("scaling", ctypes.c_float),
    ]


class Shape(ctypes.Structure):
    """The model's shape for ``layers.c``."""

    _fields_ = [(name, ctypes.c_int64) for name in ("d", "heads", "kv_heads", "head_dim", "ffn")]


def layers_fn() -> Any:
    """The compiled decoder-layer stack (``dflash_layers`` of ``layers.c``, argument types set), or
    None where the library cannot run here (see ``why_not``)."""
    return _kernel("layers", "dflash_layers", _wrap_layers, "PyTorch's layers")


def _wrap_layers(c_fn: ctypes._NamedFuncPointer) -> Any:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    c_fn.restype = ctypes.c_int
    c_fn.argtypes = [p, i64, p, p, p, i64, p, i64, i64, p, p, p, p, i64, p, ctypes.c_int]
    return c_fn


def why_not() -> str | None:
    """Why the native kernels are unavailable (None when they are, or were not asked for yet)."""
    return _why_not.get("lib")


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()


def _wrap_int8(c_fn: ctypes._NamedFuncPointer) -> Int8Gemm:
    c_fn.restype = ctypes.c_int
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    c_fn.argtypes = [p, i64, i64, p, p, p, i64, p, ctypes.c_int]

    def gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = _f32(x)
        m, k = x.shape
        n = w.shape[0]
        y = torch.empty((m, n), dtype=torch.float32)
        rc = c_fn(
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
        if rc != 0:
            raise MemoryError(f"int8 GEMM: no memory for a {m}x{k} activation buffer")
        return y

    return gemm


def _wrap_bf16(c_fn: ctypes._NamedFuncPointer) -> Bf16Gemm:
    c_fn.restype = None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    c_fn.argtypes = [p, i64, i64, p, p, i64, p, ctypes.c_int]

    def gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = _f32(x)
        m, k = x.shape
        n = w.shape[0]
        y = torch.empty((m, n), dtype=torch.float32)
        c_fn(
            x.data_ptr(),
            m,
            k,
            w.data_ptr(),
            bias.data_ptr() if bias is not None else None,
            n,
            y.data_ptr(),
            torch.get_num_threads(),
        )
        return y

    return gemm
