"""Attention of verify rows over a KV cache with grouped K/V heads and an explicit mask.

PyTorch's SDPA dispatches a masked call with ``enable_gqa=True`` to the math kernel on CUDA: the
flash kernel takes no arbitrary mask and the memory-efficient kernel no grouped heads, so the math
kernel repeats the whole cache for every query head, per layer, per step. ``grouped_attention``
folds the query heads of each K/V group into the rows instead: q [H, T, hd] becomes
[KV, g*T, hd] (query head i is served by K/V head i // g, as transformers' ``repeat_kv``), the
mask is repeated g times along the rows, and SDPA sees plain multi-head attention with KV heads
and a mask. On CUDA that call runs the memory-efficient kernel (masks of any shape; float32,
float16 and bfloat16), on the CPU the flash kernel; nothing repeats the cache.
``attention_kernel`` asks PyTorch which kernel a call of this layout takes on a device
(``torch._fused_sdp_choice``), so the choice is tested rather than assumed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked attention of grouped-query heads without repeating K/V.

    Args:
        q: [H, T, hd] queries.
        k, v: [1, KV, S, hd] keys and values (H a multiple of KV).
        mask: [T, S] bool, True = may attend (every row sees at least one key).
        scale: the softmax scale.

    Returns:
        [H, T, hd].
    """
    h, t, hd = q.shape
    kv = k.shape[1]
    g = h // kv
    folded = q.reshape(1, kv, g * t, hd)
    rows = mask.repeat(g, 1) if g > 1 else mask  # [g*T, S]: row gi*T + ti is query head gi of the group, row ti
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=rows, scale=scale)
    return out.reshape(h, t, hd)


def attention_kernel(device: torch.device, dtype: torch.dtype, masked: bool, gqa: bool, folded: bool = True) -> str:
    """The SDPA kernel PyTorch picks on ``device`` for a verify's attention.

    Args:
        device, dtype: where and in what the attention runs.
        masked: an explicit mask (tree verifies, chains after the first step, every bucketed verify).
        gqa: fewer K/V heads than query heads.
        folded: the layout of ``grouped_attention`` (query groups folded into rows, with a mask);
            False: SDPA called with ``enable_gqa`` as it comes.

    Returns:
        "flash", "efficient", "cudnn", "math" or another name of ``torch.nn.attention.SDPBackend``
        (lower case).
    """
    from torch.nn.attention import SDPBackend

    h, kv, t, s, hd = 4, (2 if gqa else 4), 5, 64, 64
    q = torch.zeros(1, h, t, hd, dtype=dtype, device=device)
    k = torch.zeros(1, kv, s, hd, dtype=dtype, device=device)
    mask = torch.ones(t, s, dtype=torch.bool, device=device) if masked else None
    if folded and masked and gqa:
        g = h // kv
        q = q.reshape(1, kv, g * t, hd)
        assert mask is not None
        mask = mask.repeat(g, 1)
        gqa = False
    choice = torch._fused_sdp_choice(q, k, k, attn_mask=mask, is_causal=False, enable_gqa=gqa)
    return SDPBackend(choice).name.lower().replace("_attention", "")
