"""Small native kernels for CPU decode steps, compiled on first use (no build step at install).

``gemm.c`` (AVX2 + FMA, OpenMP), float32 inputs and outputs:

- ``int8_gemm``: int8 weights (one scale per output row) x activations rounded per row to 15-bit
  integers, exact int32 sums. ATen's own ``_weight_int8pack_mm`` reaches about a third of the
  memory bandwidth on AVX2 CPUs and takes bf16 activations. On CPUs with AVX-512 VNNI the sums run
  as ``vpdpwssd`` (chosen at run time, ``int8_isa``): the same integers, identical results.
- ``bf16_gemm``: bfloat16 weights, widened to float32 exactly, float32 accumulation. On CPUs without native bf16
  (AVX2, AVX-512 without BF16) oneDNN and ATen emulate bf16 GEMMs several times slower than
  float32; this reads half float32's bytes at float32's arithmetic.
- ``bf16dp_gemm``: bfloat16 weights x activations rounded per row to bfloat16, ``vdpbf16ps``
  (AVX-512-BF16; only where cpuid reports it, else None). Different results from ``bf16_gemm``'s, so
  a model runs one of the two for every step (``runtime.engine.models.linear.choose_bf16`` measures which).
- ``f32_gemm``: float32 weights in register-blocked tiles (2 input rows x 4 weight rows). With
  float32's bytes a step of a few rows runs out of arithmetic sooner than with bf16 or int8 weights,
  so this one shares loads across a tile instead of streaming one weight row at a time.

- ``q4_gemm``: 4-bit weights in groups of 32 with a float16 scale and minimum each (``q4.c``,
  dflash's ``q4`` scheme, ``runtime.engine.models.q4``) x activations rounded per row to 15-bit
  integers: exact integer sums per group, float32 across groups. AVX2, or AVX-512 VNNI where the CPU
  has it (``q4_isa``): the same float operations lane for lane, identical results.

All five read each weight row once per call for all rows of a verify block, and compute every row
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
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("gemm.c")
SOURCES = (SOURCE, Path(__file__).with_name("layers.c"), Path(__file__).with_name("q4.c"))
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]

Int8Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
Bf16Gemm = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
Q4Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

_loaded: dict[str, Any] = {}
_why_not: dict[str, str] = {}
_settings: dict[str, Any] = {"enabled": True, "cache": None}
_lock = threading.RLock()


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
    if "avx2" not in flags or "fma" not in flags or "f16c" not in flags:
        return "this CPU has no AVX2/FMA/F16C"
    return None


def _compiler() -> str | None:
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return name
    return None


def _compiler_id(cc: str | None) -> str | None:
    """Which compiler ``cc`` is (its resolved path, size and modification time: an upgrade changes
    it); None without one."""
    path = shutil.which(cc) if cc is not None else None
    if path is None:
        return None
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError:
        return real
    return f"{real}:{st.st_size}:{st.st_mtime_ns}"


# Every symbol dflash calls in the library: one that lacks any of them is not used.
SYMBOLS = (
    "dflash_int8_isa",
    "dflash_int8_gemm",
    "dflash_bf16_gemm",
    "dflash_bf16dp_supported",
    "dflash_bf16dp_gemm",
    "dflash_f32_gemm",
    "dflash_layers",
    "dflash_q4_isa",
    "dflash_q4_gemm",
)
ELF = b"\x7fELF"


def _record_path(lib_path: Path) -> Path:
    """The build record beside a cached library: its sha256, the source key and the compiler."""
    return lib_path.with_name(lib_path.name + ".json")


def _build(dest: Path) -> str | None:
    """Compile the kernels to ``dest`` and write its build record; None on success, else the reason.

    The library is renamed into place atomically (concurrent processes never load a half-written
    file), then its record is written (atomically too): a library without a matching record is
    never loaded."""
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
        data = out.read_bytes()
        if not data.startswith(ELF):
            return f"{cc} wrote no shared library"
        record = {"sha256": hashlib.sha256(data).hexdigest(), "source": _source_hash(), "compiler": _compiler_id(cc)}
        rec = Path(tmp) / "record.json"
        rec.write_text(json.dumps(record))
        out.replace(dest)
        rec.replace(_record_path(dest))
    return None


def _source_hash() -> str:
    return hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES) + " ".join(FLAGS).encode()).hexdigest()


def _source_key() -> str:
    return _source_hash()[:16]


def source_key() -> str:
    """Which native kernels this process would run ("<hash of source and flags>", or "off" where they
    are switched off), without building or loading them."""
    return _source_key() if _settings["enabled"] else "off"


def _check(data: bytes, lib_path: Path) -> str | None:
    """Why the bytes read from ``lib_path`` are not the library this source, compiler and flags
    built (None: they are): checked before the library is loaded, so that a truncated, overwritten
    or foreign file never runs."""
    try:
        record = json.loads(_record_path(lib_path).read_text())
    except FileNotFoundError:
        return "no build record"
    except (OSError, UnicodeDecodeError, ValueError):
        return "unreadable build record"
    if not isinstance(record, dict):
        return "unreadable build record"
    if record.get("source") != _source_hash():
        return "built from another source"
    compiler = _compiler_id(_compiler())
    if compiler is not None and record.get("compiler") != compiler:
        return "built by another compiler"
    if record.get("sha256") != hashlib.sha256(data).hexdigest():
        return "damaged: its sha256 differs from its build record"
    if not data.startswith(ELF):
        return "not a shared library"
    return None


def _remove(lib_path: Path) -> None:
    for path in (lib_path, _record_path(lib_path)):
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def _open(lib_path: Path) -> tuple[ctypes.CDLL | None, str | None, bool]:
    """(library, None, _) where ``lib_path`` holds this build's library, else (None, why, rebuild:
    whether building again may help). The bytes checked are the bytes loaded: the library is opened
    through the file descriptor it was read from."""
    try:
        fd = os.open(lib_path, os.O_RDONLY)
    except FileNotFoundError:
        return None, "missing", True
    except OSError as e:
        return None, f"cannot read {lib_path.name}: {e.strerror}", False
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read()
        why = _check(data, lib_path)
        if why is not None:
            return None, why, True
        try:
            lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
        except OSError as e:
            return None, f"cannot load {lib_path.name}: {e}", True
    finally:
        os.close(fd)
    missing = [s for s in SYMBOLS if not hasattr(lib, s)]
    if missing:
        return None, f"{lib_path.name} lacks {', '.join(missing)}", False
    return lib, None, False


class _Locked:
    """An exclusive lock on a file beside the cached library while it is checked or built (where
    the cache folder allows one): one process builds, the others wait and load its library."""

    def __init__(self, lib_path: Path) -> None:
        self.path = lib_path.with_name(lib_path.name + ".lock")
        self.fd: int | None = None

    def __enter__(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError:
            self.__exit__()

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the lock
            self.fd = None


def _load(lib_path: Path) -> tuple[ctypes.CDLL | None, str | None]:
    """The cached library at ``lib_path``, built first where it is missing, and built again (once)
    where the cached file is not this build's or fails to load (one line on stderr says so)."""
    with _Locked(lib_path):
        lib, why, rebuild = _open(lib_path)
        if lib is not None or not rebuild:
            return lib, why
        if why != "missing":
            print(f"dflash: cached native kernels {lib_path} not used ({why}); rebuilding", file=sys.stderr)
            _remove(lib_path)
        try:
            built = _build(lib_path)
        except (OSError, subprocess.SubprocessError) as e:
            built = f"build failed: {e}"
        if built is not None:
            return None, built
        lib, why, _ = _open(lib_path)
        if lib is None:
            _remove(lib_path)  # a build that does not load: the next process tries again
        return lib, why


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
    with _lock:
        if "lib" in _loaded:
            lib: ctypes.CDLL | None = _loaded["lib"]
            return lib
        lib = None
        why = "switched off: DFLASH_NATIVE=0" if not _settings["enabled"] else _cpu_ok()
        if why is None:
            lib, why = _load(cache_dir() / f"gemm-{_source_key()}.so")
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


def f32_gemm() -> Bf16Gemm | None:
    """The compiled float32-weight GEMM, ``f(x [M, K] f32, w [N, K] f32, bias [N] f32 | None) -> y [M, N]
    f32``, or None where it cannot run here (see ``why_not``)."""
    fn: Bf16Gemm | None = _kernel("f32", "dflash_f32_gemm", _wrap_float(torch.float32), "oneDNN's float32 GEMM")
    return fn


class Proj(ctypes.Structure):
    """One projection of ``layers.c``: weights [n, k] (int8 + per-row scales, bf16, float32 or q4 + its
    scales and minimums), bias or NULL."""

    _fields_ = [
        ("w", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        # weights: 0 = bf16, 1 = int8, 2 = float32, 3 = bf16 on the AVX-512-BF16 path, 4 = q4 (scale: its sm)
        ("kind", ctypes.c_int64),
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


def layers_fn() -> LayersFn | None:
    """The compiled decoder-layer stack (``dflash_layers`` of ``layers.c``, its arguments checked:
    see ``_wrap_layers``), or None where the library cannot run here (see ``why_not``)."""
    fn: LayersFn | None = _kernel("layers", "dflash_layers", _wrap_layers, "PyTorch's layers")
    return fn


LayersFn = Callable[..., None]


def _wrap_layers(c_fn: ctypes._NamedFuncPointer) -> LayersFn:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    c_fn.restype = ctypes.c_int
    c_fn.argtypes = [p, i64, p, p, p, i64, p, i64, i64, p, p, p, p, i64, p, ctypes.c_int]
    name = "native layers"

    def layers(
        stack: Any,
        shape: Shape,
        ck: Any,
        cv: Any,
        capacity: int,
        h: torch.Tensor,
        start: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        taps: Sequence[int],
        tapbuf: torch.Tensor | None,
    ) -> None:
        """Run the decoder layers ``stack`` (a ctypes ``Layer`` array) over the rows ``h`` [T, D]
        (float32, updated in place) at positions ``start``..``start + T - 1``, reading and writing
        the per-layer K/V buffers ``ck``/``cv`` (ctypes pointer arrays, room for ``capacity``
        entries). ``cos``/``sin`` [T, head_dim] float32; ``mask`` [T, start + T] uint8 or None
        (causal); after layer ``taps[j]`` the rows are copied into ``tapbuf[:, j * D:(j + 1) * D]``.

        Raises:
            ValueError: a tensor of the wrong dtype, shape or layout, or positions beyond the cache.
            MemoryError: no scratch memory for the step.
        """
        n_layers = len(stack)
        if len(ck) != n_layers or len(cv) != n_layers:
            raise ValueError(f"{name}: {n_layers} layers but {len(ck)} K and {len(cv)} V buffers")
        d, hd = int(shape.d), int(shape.head_dim)
        if not isinstance(h, torch.Tensor) or h.dim() != 2 or h.shape[0] < 1:
            raise ValueError(f"{name}: h must be a 2-D tensor [T, {d}] with T >= 1, {_described(h)}")
        t = int(h.shape[0])
        _need(name, "h", h, torch.float32, (t, d))
        _need(name, "cos", cos, torch.float32, (t, hd))
        _need(name, "sin", sin, torch.float32, (t, hd))
        if not 0 <= start <= capacity - t:
            raise ValueError(f"{name}: rows {start}..{start + t - 1} do not fit a cache of {capacity} entries")
        if mask is not None:
            _need(name, "mask", mask, torch.uint8, (t, start + t))
        if any(not 0 <= j < n_layers for j in taps):
            raise ValueError(f"{name}: taps {list(taps)} outside layers 0..{n_layers - 1}")
        if taps:
            _need(name, "tapbuf", tapbuf, torch.float32, (t, len(taps) * d))
        elif tapbuf is not None:
            raise ValueError(f"{name}: a tap buffer without taps")
        tap_ids = (ctypes.c_int64 * max(len(taps), 1))(*taps)
        rc = c_fn(
            stack,
            n_layers,
            ctypes.byref(shape),
            ck,
            cv,
            capacity,
            h.data_ptr(),
            t,
            start,
            cos.data_ptr(),
            sin.data_ptr(),
            mask.data_ptr() if mask is not None else None,
            tap_ids,
            len(taps),
            tapbuf.data_ptr() if tapbuf is not None else None,
            torch.get_num_threads(),
        )
        if rc == -2:
            raise ValueError(f"{name}: head dimension {hd} over 512")
        if rc != 0:
            raise MemoryError(f"{name}: no memory for a step of {t} rows (code {rc})")

    return layers


def why_not() -> str | None:
    """Why the native kernels are unavailable (None when they are, or were not asked for yet)."""
    return _why_not.get("lib")


def _f32(name: str, x: torch.Tensor) -> torch.Tensor:
    """The activations ``x`` [M, K] as contiguous float32 rows on the CPU (converted from another
    float dtype or layout)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point() or x.device.type != "cpu":
        raise ValueError(f"{name}: x must be a 2-D float tensor [M, K] on the CPU, {_described(x)}")
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()


def _described(t: object) -> str:
    if not isinstance(t, torch.Tensor):
        return f"got {type(t).__name__}"
    return f"got {str(t.dtype).removeprefix('torch.')} {list(t.shape)} on {t.device}" + (
        "" if t.is_contiguous() else " (not contiguous)"
    )


def _need(name: str, what: str, t: object, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Raise a clear error unless ``t`` is a contiguous CPU tensor of ``dtype`` and ``shape`` (-1:
    any size): the C kernels read raw pointers and trust these."""
    ok = (
        isinstance(t, torch.Tensor)
        and t.dtype == dtype
        and t.device.type == "cpu"
        and t.is_contiguous()
        and t.dim() == len(shape)
        and all(want in (-1, got) for want, got in zip(shape, t.shape, strict=True))
    )
    if not ok:
        dims = ", ".join("?" if d == -1 else str(d) for d in shape)
        kind = str(dtype).removeprefix("torch.")
        raise ValueError(f"{name}: {what} must be a contiguous {kind} tensor [{dims}] on the CPU, {_described(t)}")


def _wrap_int8(c_fn: ctypes._NamedFuncPointer) -> Int8Gemm:
    c_fn.restype = ctypes.c_int
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    c_fn.argtypes = [p, i64, i64, p, p, p, i64, p, ctypes.c_int]

    def gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = _f32("int8 GEMM", x)
        m, k = x.shape
        _need("int8 GEMM", "w", w, torch.int8, (-1, k))
        n = w.shape[0]
        _need("int8 GEMM", "scale", scale, torch.float32, (n,))
        if bias is not None:
            _need("int8 GEMM", "bias", bias, torch.float32, (n,))
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


def _wrap_q4(c_fn: ctypes._NamedFuncPointer) -> Q4Gemm:
    c_fn.restype = ctypes.c_int
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    c_fn.argtypes = [p, i64, i64, p, p, p, i64, p, ctypes.c_int]
    name = "q4 GEMM"

    def gemm(x: torch.Tensor, w: torch.Tensor, sm: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = _f32(name, x)
        m, k = x.shape
        if k % 32 != 0:
            raise ValueError(f"{name}: K must be a multiple of 32, got {k}")
        _need(name, "w", w, torch.uint8, (-1, k // 2))
        n = w.shape[0]
        _need(name, "sm", sm, torch.float16, (n, 2 * 8 * ((k // 32 + 7) // 8)))
        if bias is not None:
            _need(name, "bias", bias, torch.float32, (n,))
        y = torch.empty((m, n), dtype=torch.float32)
        rc = c_fn(
            x.data_ptr(),
            m,
            k,
            w.data_ptr(),
            sm.data_ptr(),
            bias.data_ptr() if bias is not None else None,
            n,
            y.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError(f"{name}: no memory for a {m}x{k} activation buffer")
        return y

    return gemm


def _wrap_float(weights: torch.dtype, returns_rc: bool = False) -> Callable[[ctypes._NamedFuncPointer], Bf16Gemm]:
    """The wrapper of a GEMM over ``weights`` (bfloat16 or float32) weights (``returns_rc``: the C
    function returns 0, or -1 without memory for its activation buffer)."""
    name = f"{str(weights).removeprefix('torch.')} GEMM"

    def wrap(c_fn: ctypes._NamedFuncPointer) -> Bf16Gemm:
        c_fn.restype = ctypes.c_int if returns_rc else None
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        c_fn.argtypes = [p, i64, i64, p, p, i64, p, ctypes.c_int]

        def gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            x = _f32(name, x)
            m, k = x.shape
            _need(name, "w", w, weights, (-1, k))
            n = w.shape[0]
            if bias is not None:
                _need(name, "bias", bias, torch.float32, (n,))
            y = torch.empty((m, n), dtype=torch.float32)
            rc = c_fn(
                x.data_ptr(),
                m,
                k,
                w.data_ptr(),
                bias.data_ptr() if bias is not None else None,
                n,
                y.data_ptr(),
                torch.get_num_threads(),
            )
            if returns_rc and rc != 0:
                raise MemoryError(f"{name}: no memory for a {m}x{k} activation buffer")
            return y

        return gemm

    return wrap


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
