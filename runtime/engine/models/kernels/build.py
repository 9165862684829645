"""Building, caching and checking the native kernels' shared library (``gemm.c``, ``layers.c``, ``q4.c``,
``amx.c``; ``kernels.h`` declares what they call in one another).

The library is compiled with the system C compiler into the cache folder the package is configured
with, keyed by a hash of the source and flags. Beside it a build record (its sha256, the source and
flags, the compiler) is written after the library is renamed into place; a cached file is loaded only
where the record matches it (checked before ``dlopen``, on the bytes that are loaded) and it offers
every symbol in ``SYMBOLS``. A file that fails the check is removed and built again, once.
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
from pathlib import Path

SOURCE = Path(__file__).with_name("gemm.c")
SOURCES = (
    SOURCE,
    Path(__file__).with_name("layers.c"),
    Path(__file__).with_name("q4.c"),
    Path(__file__).with_name("amx.c"),
)
HEADERS = (Path(__file__).with_name("kernels.h"),)  # included by the sources: part of the source key
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]


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
    "dflash_bf16amx_supported",
    "dflash_amx_allow",
    "dflash_bf16amx_gemm",
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
    code = b"".join(src.read_bytes() for src in (*SOURCES, *HEADERS))
    return hashlib.sha256(code + " ".join(FLAGS).encode()).hexdigest()


def _source_key() -> str:
    return _source_hash()[:16]


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
