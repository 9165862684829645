"""Hand freed heap memory back to the operating system after a large request.

Tokenizing a prompt of a megabyte (refused afterwards as longer than the context) allocates a few
hundred megabytes that are freed at once, but glibc's malloc keeps freed heap pages mapped for
reuse: the server's resident memory then stays at that high-water mark (issue 46: 395 -> 614 MB
after a few 1 MB bodies). ``malloc_trim(0)`` returns those pages; elsewhere (macOS, musl) this is
a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable

# a request body at least this large may leave hundreds of MB of freed heap behind it
TRIM_AFTER_BYTES = 256 * 1024


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def release_free_memory() -> bool:
    """Return freed heap pages to the OS; True when something could be asked (glibc)."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
