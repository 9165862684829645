"""Small native kernels for CPU decode steps, compiled on first use (no build step at install).

``gemm.c`` (AVX2 + FMA, OpenMP), float32 inputs and outputs:

- ``int8_gemm``: int8 weights (one scale per output row) x activations rounded per row to 15-bit
  integers, exact int32 sums. ATen's own ``_weight_int8pack_mm`` reaches about a third of the
  memory bandwidth on AVX2 CPUs and takes bf16 activations. On CPUs with AVX-512 VNNI the sums run
  as ``vpdpwssd``, and on CPUs with AMX-INT8 calls of several rows run on tiles (``amx.c``: each
  activation split into a high and a low byte, ``tdpbssd`` + ``tdpbsud``); chosen at run time
  (``int8_isa``): the same integers, identical results.
- ``bf16_gemm``: bfloat16 weights, widened to float32 exactly, float32 accumulation. On CPUs without native bf16
  (AVX2, AVX-512 without BF16) oneDNN and ATen emulate bf16 GEMMs several times slower than
  float32; this reads half float32's bytes at float32's arithmetic.
- ``bf16dp_gemm``: bfloat16 weights x activations rounded per row to bfloat16, ``vdpbf16ps``
  (AVX-512-BF16; only where cpuid reports it, else None). Different results from ``bf16_gemm``'s, so
  a model runs one of the two for every step (``runtime.engine.models.linear.choose_bf16`` measures which).
- ``bf16amx_gemm``: the same bf16 x bf16-rounded product on AMX tiles (``amx.c``, ``tdpbf16ps``; only
  where cpuid reports AMX-BF16, Linux grants the tile state and a probe in a forked child passes,
  else None): one pass over the weights for up to 16 rows, and a prefill at the tiles' rate. Its
  sums differ from ``bf16dp_gemm``'s; again one path per process, chosen by measurement.
- ``f32_gemm``: float32 weights in register-blocked tiles (2 input rows x 4 weight rows). With
  float32's bytes a step of a few rows runs out of arithmetic sooner than with bf16 or int8 weights,
  so this one shares loads across a tile instead of streaming one weight row at a time.

- ``q4_gemm``: 4-bit weights in groups of 32 with a float16 scale and minimum each (``q4.c``,
  dflash's ``q4`` scheme, ``runtime.engine.models.q4``) x activations rounded per row to 15-bit
  integers: exact integer sums per group, float32 across groups. AVX2, or AVX-512 VNNI where the CPU
  has it (``q4_isa``): the same float operations lane for lane, identical results.

All six read each weight row once per call for all rows of a verify block, and compute every row
exactly as it would alone (the lossless contract of greedy DFlash).

The shared library is built with the system C compiler (``cc``, ``gcc`` or ``clang`` on PATH) into
a cache folder (``configure``; default ``~/.cache/dflash/kernels``, the CLI passes
``$DFLASH_HOME/kernels``), keyed by a hash of the source and flags, and loaded with ctypes. Beside
the library a build record (``gemm-<key>.so.json``: its sha256, the source and flags, the compiler)
is written after the library is renamed into place; a cached file is loaded only where the record
matches it (checked before ``dlopen``, on the bytes that are loaded) and it offers every symbol in
``SYMBOLS``. A truncated, overwritten, foreign or junk file is removed and built again, once, with
one line on stderr; nothing is loaded before a kernel is asked for. The wrappers check the dtype,
shape and layout of every tensor they hand to C (``ValueError`` otherwise). Where
there is no compiler, no AVX2/FMA, or native kernels are switched off (``configure(enabled=False)``;
the CLI's ``DFLASH_NATIVE=0``), ``int8_gemm()`` returns None and callers use ATen's kernel instead
(one line on stderr says why).

The build and cache machinery lives in ``build``, the GEMM wrappers in ``wrappers``, the decoder-layer
stack's structures and wrapper in ``layers``; this module holds the process-wide settings and the
loaded kernels, and hands them out.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runtime.engine.models.kernels.build import FLAGS, SOURCE, SOURCES, _compiler, _cpu_ok, _load, _source_key
from runtime.engine.models.kernels.layers import Layer, LayersFn, Proj, Shape, _wrap_layers
from runtime.engine.models.kernels.wrappers import Bf16Gemm, Int8Gemm, Q4Gemm, _wrap_float, _wrap_int8, _wrap_q4

__all__ = [
    "FLAGS",
    "SOURCE",
    "SOURCES",
    "F32_NATIVE_MAX_ROWS",
    "Bf16Gemm",
    "Int8Gemm",
    "Layer",
    "LayersFn",
    "Proj",
    "Q4Gemm",
    "Shape",
    "bf16_gemm",
    "bf16amx_gemm",
    "bf16amx_supported",
    "bf16dp_gemm",
    "bf16dp_supported",
    "cache_dir",
    "configure",
    "f32_gemm",
    "f32_project",
    "identity",
    "int8_gemm",
    "int8_isa",
    "layers_fn",
    "note_bf16_path",
    "q4_gemm",
    "q4_isa",
    "source_key",
    "why_not",
    "_compiler",
    "_cpu_ok",
    "_wrap_float",
]

_loaded: dict[str, Any] = {}
_why_not: dict[str, str] = {}
_settings: dict[str, Any] = {"enabled": True, "cache": None, "amx": True}
_lock = threading.RLock()


def configure(enabled: bool = True, cache: Path | None = None, amx: bool = True) -> None:
    """Process-wide settings, before the first model loads: use native kernels at all, where to
    keep compiled ones (None: ``~/.cache/dflash/kernels``), and whether their AMX paths may run
    where the CPU has them (the CLI's ``DFLASH_AMX=0`` says no). Changing them forgets a loaded
    kernel."""
    if enabled != _settings["enabled"] or cache != _settings["cache"] or amx != _settings["amx"]:
        _loaded.clear()
        _why_not.clear()
    _settings.update(enabled=enabled, cache=cache, amx=amx)


def settings() -> tuple[bool, Path | None, bool]:
    """The process-wide settings ``configure`` took: (enabled, cache, amx), e.g. to restore them."""
    return bool(_settings["enabled"]), _settings["cache"], bool(_settings["amx"])


def cache_dir() -> Path:
    """Where compiled kernels are kept."""
    cache = _settings["cache"]
    return Path(cache) if cache is not None else Path.home() / ".cache" / "dflash" / "kernels"


def source_key() -> str:
    """Which native kernels this process would run ("<hash of source and flags>", or "off" where they
    are switched off), without building or loading them."""
    return _source_key() if _settings["enabled"] else "off"


def identity() -> str:
    """Which native kernels a process runs ("native-<hash of source and flags>-<int8 path>", then
    "-bf16:<path>" where a bf16 path was chosen by measurement (``note_bf16_path``), or "off"): part
    of the key of cached speed measurements, which a kernel change invalidates."""
    if _library() is None:
        return "off"
    chosen = _loaded.get("bf16_path")
    return f"native-{_source_key()}-{int8_isa()}" + (f"-bf16:{chosen}" if chosen else "")


def note_bf16_path(path: str | None) -> None:
    """Record the bf16 path this process chose by measurement (``linear.choose_bf16``), for ``identity``."""
    _loaded["bf16_path"] = path


_ISAS = ("avx2", "avx512vnni", "amx")


def int8_isa(want: str | None = None) -> str:
    """The int8 kernel's instruction set: "avx2", "avx512vnni" where the CPU has AVX-512 VNNI, or
    "amx" where AMX-INT8 runs too (tiles for calls of many rows, VNNI for fewer: gemm.c's
    INT8_AMX_M): the best
    this CPU has by default. ``want`` switches it for this process ("avx2", "avx512vnni", "amx" or
    "best"; one the CPU lacks falls back to the best below it); all compute the same integer sums,
    so results do not change. "off" where the library does not run."""
    lib = _library()
    if lib is None:
        return "off"
    fn = lib.dflash_int8_isa
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
    if want is not None:
        _loaded["isa"] = _ISAS[fn(_ISAS.index(want) if want in _ISAS else -1)]
    elif "isa" not in _loaded:
        _loaded["isa"] = _ISAS[fn(-1)]
    isa: str = _loaded["isa"]
    return isa


def _library() -> ctypes.CDLL | None:
    """The compiled kernels (built on first use), or None where they cannot run (see ``why_not``)."""
    with _lock:
        if "lib" in _loaded:
            lib: ctypes.CDLL | None = _loaded["lib"]
            return lib
        lib = None
        why = "switched off: DFLASH_NATIVE=0" if not _settings["enabled"] else _cpu_ok()
        if why is None:
            lib, why = _load(cache_dir() / f"gemm-{_source_key()}.so")
        if lib is not None:  # the AMX paths as the settings say, then the int8 path chosen again
            allow, choose = lib.dflash_amx_allow, lib.dflash_int8_isa
            allow.restype, allow.argtypes = ctypes.c_int, [ctypes.c_int]
            choose.restype, choose.argtypes = ctypes.c_int, [ctypes.c_int]
            allow(1 if _settings["amx"] else 0)
            choose(-1)
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


def q4_gemm() -> Q4Gemm | None:
    """The compiled 4-bit GEMM (``q4.c``), ``f(x [M, K] f32, w [N, K/2] uint8, sm [N, 2 Gp] f16,
    bias [N] f32 | None) -> y [M, N] f32`` (``runtime.engine.models.q4`` describes the format and
    builds ``sm``: ``kernel_sm``), or
    None where it cannot run here (see ``why_not``)."""
    fn: Q4Gemm | None = _kernel("q4", "dflash_q4_gemm", _wrap_q4, "PyTorch's de-quantized matmul")
    return fn


def q4_isa(want: str | None = None) -> str:
    """The 4-bit kernel's instruction set: "avx2", or "avx512vnni" where the CPU has AVX-512 VNNI
    (the default there); ``want`` switches it for this process ("avx2", or "best"). Both give
    identical results. "off" where the library does not run."""
    lib = _library()
    if lib is None:
        return "off"
    fn = lib.dflash_q4_isa
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
    if want is not None:
        _loaded["q4_isa"] = _ISAS[fn(0 if want == "avx2" else -1)]
    elif "q4_isa" not in _loaded:
        _loaded["q4_isa"] = _ISAS[fn(-1)]
    isa: str = _loaded["q4_isa"]
    return isa


def bf16_gemm() -> Bf16Gemm | None:
    """The compiled bf16-weight GEMM, ``f(x [M, K] f32, w [N, K] bf16, bias [N] f32 | None) -> y [M, N]
    f32``, or None where it cannot run here (see ``why_not``)."""
    fn: Bf16Gemm | None = _kernel("bf16", "dflash_bf16_gemm", _wrap_float(torch.bfloat16), "ATen's bf16 GEMM")
    return fn


def bf16dp_supported() -> bool:
    """Whether this CPU (cpuid: AVX-512 F/BW/BF16) and this build run ``bf16dp_gemm``'s own path."""
    lib = _library()
    if lib is None:
        return False
    fn = lib.dflash_bf16dp_supported
    fn.restype, fn.argtypes = ctypes.c_int, []
    return bool(fn())


def bf16dp_gemm() -> Bf16Gemm | None:
    """The AVX-512-BF16 bf16-weight GEMM (``vdpbf16ps``; activations rounded per row to bf16 inside),
    ``f(x [M, K] f32, w [N, K] bf16, bias [N] f32 | None) -> y [M, N] f32``, or None where this CPU or
    build has no AVX-512-BF16 or the library cannot run here (no line on stderr: callers offer the
    other bf16 paths instead)."""
    if "bf16dp" not in _loaded:
        lib = _library()
        wrap = _wrap_float(torch.bfloat16, returns_rc=True)
        _loaded["bf16dp"] = wrap(lib.dflash_bf16dp_gemm) if lib is not None and bf16dp_supported() else None
    fn: Bf16Gemm | None = _loaded["bf16dp"]
    return fn


def bf16amx_supported() -> bool:
    """Whether this CPU (cpuid: AMX-TILE, AMX-BF16, AVX-512 F/BW/BF16), its kernel (the tile state
    granted to this process) and this build run ``bf16amx_gemm``'s own path; a probe of one tile runs
    in a forked child first, so a VM that advertises AMX and faults on it only answers False."""
    lib = _library()
    if lib is None:
        return False
    if "amx_ok" not in _loaded:
        fn = lib.dflash_bf16amx_supported
        fn.restype, fn.argtypes = ctypes.c_int, []
        _loaded["amx_ok"] = bool(fn())
    ok: bool = _loaded["amx_ok"]
    return ok


def bf16amx_gemm() -> Bf16Gemm | None:
    """The AMX bf16-weight GEMM (``amx.c``: ``tdpbf16ps`` tiles; activations rounded per row to bf16
    inside), ``f(x [M, K] f32, w [N, K] bf16, bias [N] f32 | None) -> y [M, N] f32``, or None where
    AMX does not run here (no line on stderr: callers offer the other bf16 paths instead)."""
    if "bf16amx" not in _loaded:
        lib = _library()
        wrap = _wrap_float(torch.bfloat16, returns_rc=True)
        _loaded["bf16amx"] = wrap(lib.dflash_bf16amx_gemm) if lib is not None and bf16amx_supported() else None
    fn: Bf16Gemm | None = _loaded["bf16amx"]
    return fn


def f32_gemm() -> Bf16Gemm | None:
    """The compiled float32-weight GEMM, ``f(x [M, K] f32, w [N, K] f32, bias [N] f32 | None) -> y [M, N]
    f32``, or None where it cannot run here (see ``why_not``)."""
    fn: Bf16Gemm | None = _kernel("f32", "dflash_f32_gemm", _wrap_float(torch.float32), "oneDNN's float32 GEMM")
    return fn


def layers_fn() -> LayersFn | None:
    """The compiled decoder-layer stack (``dflash_layers`` of ``layers.c``, its arguments checked:
    see ``_wrap_layers``), or None where the library cannot run here (see ``why_not``)."""
    fn: LayersFn | None = _kernel("layers", "dflash_layers", _wrap_layers, "PyTorch's layers")
    return fn


def why_not() -> str | None:
    """Why the native kernels are unavailable (None when they are, or were not asked for yet)."""
    return _why_not.get("lib")


# Float32 steps of at most this many rows run dflash's native GEMM, longer ones (a prompt's prefill)
# the BLAS ``F.linear``. Every decode step and every verify block or tree (at most 65 rows) stays on
# the native kernel, so a row's value never depends on how many rows its step verified.
F32_NATIVE_MAX_ROWS = 128


def f32_project(fn: Any, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A float32 projection: ``fn`` (dflash's float32 GEMM) for a step's rows, the BLAS above
    ``F32_NATIVE_MAX_ROWS`` rows. y [M, N]."""
    if x.shape[0] <= F32_NATIVE_MAX_ROWS:
        y: torch.Tensor = fn(x, w, bias)
        return y
    return torch.nn.functional.linear(x, w, bias)
