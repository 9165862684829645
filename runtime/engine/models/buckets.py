"""Verify widths in a few fixed buckets, so that a captured forward has one shape per bucket.

A verify of ``n`` rows (the anchor and its drafts: a chain, or a tree with lookup branches) runs as
the smallest bucket ``b >= n`` of ``VerifyBuckets.widths`` (1, 2, 4, 8, 16, 32, 64 by default).
The ``b - n`` padding rows are masked out: no real row sees them (their keys are hidden by the
block mask), each padding row sees only itself (no empty softmax row), and their outputs are
dropped. Their K/V are written to the cache slots just past the real rows, beyond the cache's
length, where the next step overwrites them. So the real rows do not depend on the padding
(``tests/test_bucketed_step.py`` checks it bit for bit in float32) and equal an unpadded verify's
to float32 rounding (a CPU GEMM of 3 rows rounds differently from one of 4: not bit for bit).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DEFAULT_WIDTHS = (1, 2, 4, 8, 16, 32, 64)


class VerifyBuckets:
    """The fixed widths verify forwards are padded to.

    Args:
        widths: ascending bucket widths (rows); a verify wider than the largest does not fit.
    """

    def __init__(self, widths: Sequence[int] = DEFAULT_WIDTHS) -> None:
        ws = tuple(int(w) for w in widths)
        if not ws or any(w < 1 for w in ws) or list(ws) != sorted(set(ws)):
            raise ValueError(f"bucket widths must be ascending positive integers, got {list(widths)}")
        self.widths = ws

    @property
    def largest(self) -> int:
        """The widest bucket (the rows a cache needs as headroom past its length)."""
        return self.widths[-1]

    def width(self, n: int) -> int | None:
        """The bucket ``n`` rows run in (None: wider than every bucket)."""
        for w in self.widths:
            if n <= w:
                return w
        return None

    @staticmethod
    def block_mask(n: int, tree_mask: torch.Tensor | None, causal: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The mask of a padded block, written into ``out`` ([width, width] bool, True = may attend).

        Real rows ``[0, n)`` see each other causally (``tree_mask`` None: ``causal``'s lower
        triangle, [>= n, >= n]) or as ``tree_mask`` [n, n] says; padding rows see only themselves;
        no real row sees a padding row. Device copies only: no host read.
        """
        out.fill_(False)
        out.fill_diagonal_(True)
        out[:n, :n] = causal[:n, :n] if tree_mask is None else tree_mask
        return out
