"""The lean forward through torch.compile: same numbers and the same greedy outputs as eager (the
GEMMs stay the packed/native kernels as custom operators), and a clean eager fallback with one line
on stderr when compilation fails."""

from __future__ import annotations

import random

import pytest
import torch

from runtime.config import SamplingParams
from runtime.engine import plain_decoder
from runtime.engine.models.lean_target import LeanTarget
from tests.fakes import collect_ids, greedy_pair, greedy_reference, make_drafter, make_target


def _ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, n), generator=g)


def test_compiled_forward_equals_eager_and_decodes_the_same():
    model = make_target("qwen3", vocab_size=96, seed=3)
    eager, compiled = LeanTarget(model), LeanTarget(model)
    compiled.compile()
    for t in (eager, compiled):
        t.set_taps([0, 2, 3])
    ce, cc = eager.new_cache(), compiled.new_cache()
    with torch.inference_mode():
        for n in (6, 1, 4, 1, 3):  # prefill, one token, a verify block, ...
            x = _ids(n, 96, seed=n)
            l1, f1 = eager.forward(x, ce)
            l2, f2 = compiled.forward(x, cc)
            torch.testing.assert_close(l2, l1, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(f2, f1, rtol=1e-4, atol=1e-4)
            eager.crop(ce, ce.length - 1)
            compiled.crop(cc, cc.length - 1)
    assert compiled._compiled is not None  # it ran compiled, no fallback
    drafter = make_drafter(model.config, block_size=4, taps=[0, 2, 3])
    rng = random.Random(0)
    for _ in range(3):
        p = [rng.randrange(96) for _ in range(rng.randint(2, 8))]
        ref = greedy_reference(model, p, 16)
        assert greedy_pair(compiled, drafter, p, 16, block_size=4) == (ref, ref)


def test_compile_failure_falls_back_to_eager_with_one_line(capsys, monkeypatch):
    model = make_target("qwen2", vocab_size=64, seed=1)
    lean = LeanTarget(model)

    def broken(fn, **kw):
        def run(*a, **k):
            raise RuntimeError("inductor: no C++ compiler\nlong traceback")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    lean.compile()
    with torch.inference_mode():
        a, _ = lean.forward(_ids(5, 64, 0), lean.new_cache())
        b, _ = lean.forward(_ids(5, 64, 0), lean.new_cache())
    torch.testing.assert_close(a, b)
    err = capsys.readouterr().err.splitlines()
    assert err == ["dflash: torch.compile failed (RuntimeError: inductor: no C++ compiler); running eagerly"]
    assert lean._compiled is None


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_compiled_lean_greedy_equals_transformers(arch):
    model = make_target(arch, vocab_size=96, seed=5)
    lean = LeanTarget(model)
    lean.compile()
    params = SamplingParams(max_new_tokens=12)
    p = [3, 14, 15, 92, 65]
    assert collect_ids(list(plain_decoder(lean).stream(p, params))) == greedy_reference(model, p, 12)
