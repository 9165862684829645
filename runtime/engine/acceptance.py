"""Acceptance rules of speculative decoding (pure functions)."""

from __future__ import annotations

from collections.abc import Sequence


def accept_prefix(draft_ids: Sequence[int], posterior_ids: Sequence[int]) -> int:
    """Length of the leading run where the draft equals the target's choice.

    ``draft_ids[i]`` is the proposal for block slot ``i + 1``; ``posterior_ids[i]`` is the
    target's token (argmax or sample) after seeing slots ``0..i``. The draft is accepted while
    ``draft_ids[i] == posterior_ids[i]`` (z-lab's ``cumprod`` rule). With a deterministic draft
    and a sampled posterior this is exact rejection sampling with a one-hot proposal.

    Args:
        draft_ids: K drafted ids.
        posterior_ids: at least K target choices (K + 1 in the decode loop).

    Returns:
        a in [0, K].
    """
    a = 0
    for d, p in zip(draft_ids, posterior_ids, strict=False):
        if d != p:
            break
        a += 1
    return a
