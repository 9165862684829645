"""The prompt cache: a loaded pair keeps, per slot, the caches of its last request, so that the next
request sharing a prefix with it (a chat's next turn, an editor's next keystroke on the same file)
reads only the rest of its prompt.

A slot holds the token ids whose K/V the target cache holds (the prompt and the committed answer,
without the last token), the target cache, and, where a drafter ran, its cache and the target
features not yet in it (the drafter's context). A request takes the slot it names (``slot``), else
the one sharing the longest prefix with its prompt, else the least recently used one; it crops the
caches to the common prefix and prefills the rest. At least one prompt token is always read (its
logits give the first token). The slot is the request's while it runs and is put back when it ends
(cancelled included); a request that fails leaves it empty.

Memory is bounded by the slot count: each slot holds one context's caches at most, and a slot
taken by a new prompt drops what it held.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from runtime.engine.models.kv_cache import DraftKVCache

DEFAULT_SLOTS = 4


@dataclass
class CachedState:
    """What a slot keeps of its last request.

    Attributes:
        tokens: ids whose K/V ``t_cache`` holds, in order.
        t_cache: the target's KV cache.
        d_cache: the drafter's KV cache (context entries), or None when no drafter ran.
        pending: [1, C, n*D] target features of positions ``d_cache.seq_len .. len(tokens) - 1``.
        drafter: which drafter's state ``d_cache`` is (``id`` of the model), or None.
    """

    tokens: list[int]
    t_cache: Any
    d_cache: DraftKVCache | None = None
    pending: torch.Tensor | None = None
    drafter: int | None = None


@dataclass
class Reuse:
    """A slot's state cropped for one request: ``cached`` leading prompt tokens need no prefill."""

    slot: int
    cached: int
    state: CachedState | None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PromptCache:
    """Per-slot caches of a loaded pair's last requests.

    Args:
        slots: how many contexts are kept (>= 1).
    """

    def __init__(self, slots: int = DEFAULT_SLOTS) -> None:
        if slots < 1:
            raise ValueError(f"the prompt cache needs at least one slot, got {slots}")
        self.slots = slots
        self._states: list[CachedState | None] = [None] * slots
        self._used = [0.0] * slots
        self._busy = [False] * slots
        self._lock = threading.Lock()

    def take(
        self,
        prompt: Sequence[int],
        drafter: int | None,
        crop: Callable[[Any, int], None],
        slot: int | None = None,
    ) -> Reuse:
        """Claim a slot for a request and what of it the request can reuse.

        Args:
            prompt: the request's prompt ids.
            drafter: ``id`` of the drafter the request runs (None: plain decoding, which needs no
                drafter state and reuses any target cache).
            crop: crops the target's cache to n tokens (``TargetModel.crop``).
            slot: the slot asked for (taken modulo the slot count), or None to pick one.

        Returns:
            The slot, the prompt tokens whose caches it holds (``cached``, < len(prompt)) and its
            state cropped to them (None when nothing is reusable).
        """
        with self._lock:
            free = [i for i in range(self.slots) if not self._busy[i]] or list(range(self.slots))
            if slot is not None:
                pick = slot % self.slots
            else:
                scored = [(self._reusable(self._states[i], prompt, drafter), self._used[i], i) for i in free]
                best = max(scored, key=lambda s: (s[0], s[1]))
                pick = best[2] if best[0] > 0 else min(free, key=lambda i: self._used[i])
            state, self._states[pick] = self._states[pick], None
            self._busy[pick] = True
        cached = self._reusable(state, prompt, drafter)
        if state is None or cached == 0:
            return Reuse(pick, 0, None)
        _crop(state, cached, crop)
        return Reuse(pick, cached, state)

    def put(self, slot: int, state: CachedState | None) -> None:
        """Give a slot back with the state its request left (None: empty)."""
        with self._lock:
            self._states[slot] = state
            self._used[slot] = time.monotonic()
            self._busy[slot] = False

    def clear(self) -> None:
        """Drop every slot's state."""
        with self._lock:
            self._states = [None] * self.slots

    def cached_tokens(self) -> list[int]:
        """Tokens each slot holds (0: empty)."""
        with self._lock:
            return [len(s.tokens) if s is not None else 0 for s in self._states]

    @staticmethod
    def _reusable(state: CachedState | None, prompt: Sequence[int], drafter: int | None) -> int:
        """Prompt tokens a request can take from ``state`` (always leaving one to prefill)."""
        if state is None or (drafter is not None and state.drafter != drafter):
            return 0
        return min(common_prefix(state.tokens, prompt), len(prompt) - 1)


def _crop(state: CachedState, keep: int, crop: Callable[[Any, int], None]) -> None:
    """Crop a state to its first ``keep`` tokens (target cache, drafter cache and pending features)."""
    crop(state.t_cache, keep)
    state.tokens = state.tokens[:keep]
    if state.d_cache is None:
        state.pending = None
        return
    have = state.d_cache.seq_len
    if have >= keep:
        state.d_cache.crop(keep)
        state.pending = state.pending[:, :0] if state.pending is not None else None
    elif state.pending is not None:
        state.pending = state.pending[:, : keep - have]
