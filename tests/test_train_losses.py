"""The fused head + cross-entropy equals the plain formula: loss, gradient, argmax and rank."""

from __future__ import annotations

import pytest
import torch

from runtime.train.losses import fused_head_loss


def _problem(dtype: torch.dtype, rows: int = 37, vocab: int = 301, dim: int = 24, k: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, dim, generator=g).to(dtype).requires_grad_(True)
    head = (torch.randn(vocab, dim, generator=g) * 0.5).to(dtype)
    ids = torch.randint(0, vocab, (rows, 1 + k), generator=g)
    coef = torch.rand(rows, 1 + k, generator=g)
    coef[::5] = 0.0  # rows without a label weigh nothing
    coef[1::7, 1:] = 0.0  # rows with a hard label only
    return h, head, ids, coef


def _plain(h, head, ids, coef):
    logits = (h @ head.T).float()
    logp = logits.log_softmax(-1)
    loss = -(coef * logp.gather(1, ids)).sum()
    lab = logits.gather(1, ids[:, :1])
    return loss, logits.logsumexp(-1), logits.gather(1, ids), logits.argmax(-1), (logits > lab).sum(-1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("chunk", [1, 8, 64])
def test_fused_head_loss_matches_the_plain_formula(dtype, tol, chunk):
    h, head, ids, coef = _problem(dtype)
    out = fused_head_loss(h, head, ids, coef, metrics=True, chunk=chunk)
    (g_fused,) = torch.autograd.grad(out.loss * 3.0, h)  # the upstream gradient scales it
    h2 = h.detach().clone().requires_grad_(True)
    loss, lse, picked, pred, rank = _plain(h2, head, ids, coef)
    (g_plain,) = torch.autograd.grad(loss * 3.0, h2)
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, loss, rtol=tol, atol=tol)
    torch.testing.assert_close(out.lse, lse, rtol=tol, atol=tol)
    torch.testing.assert_close(out.picked, picked, rtol=tol, atol=tol)
    torch.testing.assert_close(g_fused.float(), g_plain.float(), rtol=tol, atol=tol * 4)
    assert g_fused.dtype == dtype
    if dtype == torch.float32:  # exact argmax and rank (no ties in float32 random logits)
        assert torch.equal(out.pred, pred)
        assert torch.equal(out.rank, rank)


def test_fused_head_loss_without_metrics_or_gradient():
    h, head, ids, coef = _problem(torch.float32)
    with torch.no_grad():
        out = fused_head_loss(h, head, ids, coef)
    assert out.pred is None and out.rank is None
    assert not out.loss.requires_grad
    torch.testing.assert_close(out.loss, _plain(h, head, ids, coef)[0])


def test_fused_head_loss_rejects_mismatched_targets():
    h, head, ids, coef = _problem(torch.float32)
    with pytest.raises(ValueError, match="must be"):
        fused_head_loss(h, head, ids[:, :2], coef)


@pytest.mark.parametrize("chunk", [1, 16])
def test_fused_head_loss_with_the_copy_pointer_matches_the_plain_formula(chunk):
    """``bonus`` added at ``bonus_col`` and an ``extra`` column N (-inf where unused): loss, argmax,
    rank and the gradients of h, bonus and extra equal autograd through dense logits."""
    h, head, ids, coef = _problem(torch.float32)
    rows, vocab = h.shape[0], head.shape[0]
    g = torch.Generator().manual_seed(5)
    bonus = (torch.randn(rows, generator=g) * 3).requires_grad_(True)
    col = torch.randint(0, vocab, (rows,), generator=g)
    extra = torch.where(torch.rand(rows, generator=g) < 0.5, torch.randn(rows, generator=g) * 4 + 2, float("-inf"))
    extra = extra.requires_grad_(True)
    ids = ids.clone()
    named = torch.isfinite(extra.detach()) & (torch.arange(rows) % 3 == 0)
    ids[named, 0] = vocab  # some rows are labelled with the extra column
    out = fused_head_loss(h, head, ids, coef, metrics=True, chunk=chunk, bonus=bonus, bonus_col=col, extra=extra)
    grads = torch.autograd.grad(out.loss * 2.0, (h, bonus, extra))
    h2, b2, e2 = (t.detach().clone().requires_grad_(True) for t in (h, bonus, extra))
    dense = (h2 @ head.T).float() + torch.zeros(rows, vocab).scatter(1, col[:, None], 1.0) * b2[:, None]
    dense = torch.cat([dense, e2[:, None]], 1)
    logp = dense.log_softmax(-1).gather(1, ids)
    loss = -torch.where(coef != 0, coef * logp, 0.0).sum()
    want = torch.autograd.grad(loss * 2.0, (h2, b2, e2))
    torch.testing.assert_close(out.loss, loss)
    for got, ref in zip(grads, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.pred, dense.argmax(-1))
    assert torch.equal(out.rank, (dense > dense.gather(1, ids[:, :1])).sum(-1))
    assert (out.pred == vocab).any()  # the extra column wins somewhere: the test exercises it
