"""Pure ``logits -> token`` functions with an explicit ``torch.Generator``.

Filtering (temperature, top-k, top-p) is applied to the *target* distribution before any
acceptance test, which keeps speculative sampling exact.

No value that ``SamplingParams`` accepts can make a step fail: a temperature below
``GREEDY_BELOW`` is the argmax, logits are shifted by their row maximum before the temperature
divides them (huge logits or a tiny temperature cannot overflow into inf - inf = NaN), and top-p
always keeps the most likely token (a top-p that rounds to 0 in float32 still keeps one).
"""

from __future__ import annotations

import torch

from runtime.config import SamplingParams


def _argmax_only(x: torch.Tensor) -> torch.Tensor:
    """[N, V] logits with everything but each row's first maximum set to -inf."""
    keep = torch.zeros_like(x, dtype=torch.bool).scatter(-1, torch.argmax(x, dim=-1, keepdim=True), True)
    return torch.zeros_like(x).masked_fill(~keep, float("-inf"))


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to a batch of logits.

    Args:
        logits: [N, V] raw logits (any floating dtype; +inf counts as the largest finite value).
        params: sampling parameters; greedy ones (a temperature below ``GREEDY_BELOW``) keep only
            each row's argmax, the limit of a vanishing temperature.

    Returns:
        [N, V] float32 logits with filtered entries set to -inf; every row keeps at least one
        finite entry (its maximum, at 0).
    """
    x = logits.float()
    big = torch.finfo(torch.float32).max
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=big)
    if params.greedy:
        return _argmax_only(x)
    top = x.max(dim=-1, keepdim=True).values
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a row of -inf: left as it is
    # shifted first: the maximum becomes 0 and stays 0 whatever the temperature, others only go down;
    # a temperature beyond float32's range would round to inf (and -inf / inf is NaN)
    x = (x - top) / min(params.temperature, big)
    if params.top_k:
        k = min(params.top_k, x.shape[-1])
        kth = torch.topk(x, k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)  # ties: the first id, as argmax
        probs = torch.softmax(sorted_x, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p; the most likely
        # token is always kept (a top_p below float32's smallest value would otherwise drop it)
        before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target distribution after filtering: [N, V] float32 probabilities (one-hot when greedy)."""
    return torch.softmax(filter_logits(logits, params), dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: [N, V] logits.
        params: greedy when ``params.temperature`` is below ``GREEDY_BELOW`` (0 included).
        generator: explicit RNG on the logits' device (unused when greedy).

    Returns:
        [N] int64 token ids.
    """
    if params.greedy:
        # argmax over float32 equals argmax over bf16/fp16 (exact upcast, first maximum wins) and
        # runs ~8x faster on CPUs, where the half-precision reduction is not vectorised
        return torch.argmax(logits.float(), dim=-1)
    probs = probabilities(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
