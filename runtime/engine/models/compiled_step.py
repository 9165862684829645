"""A fixed-shape forward run through ``torch.compile``, kept for the life of a loaded model.

``mode`` is "default" (inductor) or "reduce-overhead" (inductor with CUDA graphs: a bucket's
forward replays as one graph launch). The compiled callable lives on the loaded model's object, so
a process compiles each bucket once and every later request (``serve``, ``chat``, ``bench``)
reuses it. Where compilation or a compiled call fails, the step runs eagerly from then on, and the
process says so once: one line on stderr (``dflash: ...``, as the runtime's other one-line notices).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

COMPILE_MODES = ("default", "reduce-overhead")
_said: list[bool] = [False]  # the process's one line about a failed compilation


def say_compile_failed(e: BaseException) -> None:
    """One line on stderr, once per process, naming why compilation failed."""
    if _said[0]:
        return
    _said[0] = True
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    print(f"dflash: torch.compile failed ({type(e).__name__}: {first}); running eagerly", file=sys.stderr)


class CompiledStep:
    """``fn`` eagerly, or through ``torch.compile`` after ``compile(mode)``.

    Args:
        fn: the forward (fixed shapes per bucket, no host reads: it compiles with ``fullgraph``).
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.eager = fn
        self.compiled: Callable[..., Any] | None = None
        self.mode: str | None = None

    def compile(self, mode: str = "default") -> None:
        """Compile ``fn`` from its next call on (one graph per bucket shape)."""
        if mode not in COMPILE_MODES:
            raise ValueError(f"unknown compile mode {mode!r}; use {' or '.join(COMPILE_MODES)}")
        import torch._dynamo

        # one graph per bucket and cache capacity (7 widths, a few capacities): above the default limit of 8
        torch._dynamo.config.cache_size_limit = max(int(torch._dynamo.config.cache_size_limit), 64)
        self.mode = mode
        self.compiled = torch.compile(
            self.eager, mode=None if mode == "default" else mode, dynamic=False, fullgraph=True
        )

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            return self.eager(*args)
        try:
            if self.mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]  # the previous replay's outputs are consumed
                out = self.compiled(*args)
                # outputs of a CUDA graph live in its static memory, which the next replay overwrites
                return tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in out)
            return self.compiled(*args)
        except Exception as e:  # noqa: BLE001 - any compiler failure: eager from here on, said once
            say_compile_failed(e)
            self.compiled = None
            return self.eager(*args)
