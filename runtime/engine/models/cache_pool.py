"""Cache buffers allocated once per loaded model and lent to one request at a time.

A captured step (CUDA graphs) bakes the addresses of the KV caches into its graphs, and a request
that allocated its own caches would also pay for the allocation. ``BufferPool`` keeps buffer sets
by capacity: a request borrows the smallest free set that holds it (a new one, rounded up to a
power of two, only when none does) and the set comes back when the request's cache object is
dropped (``Loan``), for the next request to reuse: same memory, same addresses. Sets kept by the
prompt cache's slots stay lent until a slot lets go of them. Nothing grows inside a step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

B = TypeVar("B")

MIN_CAPACITY = 256


def round_capacity(n: int) -> int:
    """The capacity a set for ``n`` entries gets: a power of two, at least ``MIN_CAPACITY`` (few
    distinct shapes, so few compiled graphs)."""
    return max(MIN_CAPACITY, 1 << max(int(n) - 1, 0).bit_length())


class BufferPool(Generic[B]):
    """Buffer sets made by ``make(capacity)``, lent out and given back.

    Args:
        make: allocates one set for a capacity.
    """

    def __init__(self, make: Callable[[int], B]) -> None:
        self.make = make
        self.free: list[tuple[int, B]] = []
        self.allocated = 0  # sets made so far (tests: reuse means this stays put)
        self._lock = threading.Lock()

    def lend(self, capacity: int) -> tuple[int, B]:
        """(capacity, buffers) of a free set with at least ``capacity`` entries, else of a new one
        (free sets too small for it are dropped: a longer request has come)."""
        with self._lock:
            fits = [(c, b) for c, b in self.free if c >= capacity]
            if fits:
                pick = min(fits, key=lambda cb: cb[0])
                self.free = [cb for cb in self.free if cb is not pick]
                return pick
            self.free = [cb for cb in self.free if cb[0] > capacity]
            self.allocated += 1
        cap = round_capacity(capacity)
        return cap, self.make(cap)

    def give_back(self, capacity: int, buffers: B) -> None:
        """Return a set lent by ``lend``."""
        with self._lock:
            self.free.append((capacity, buffers))


class Loan(Generic[B]):
    """A borrowed set that goes back to its pool when this object is dropped."""

    def __init__(self, pool: BufferPool[B], capacity: int) -> None:
        self._pool = pool
        self.capacity, self.buffers = pool.lend(capacity)

    def __del__(self) -> None:
        try:
            self._pool.give_back(self.capacity, self.buffers)
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown: nothing to give back to
            pass
