"""The decoder layers as one native call (``runtime/engine/models/kernels/layers.c``): the same function as
the lean forward's PyTorch layers over the same GEMM kernels (every architecture, bf16, int8 and
float32 and q4 weights, tree masks, taps, a growing cache), every row of a verify block bit-identical to one-token
steps, and greedy DFlash through it equal to plain greedy decoding of the same target."""

from __future__ import annotations

import random

import pytest
import torch

from runtime.engine.models import kernels, linear
from runtime.engine.models.lean_target import LeanTarget
from tests.fakes import greedy_pair, lean_greedy_reference, make_drafter, make_target

ARCHS = ["qwen3", "qwen2", "llama"]

pytestmark = pytest.mark.skipif(
    kernels.layers_fn() is None, reason=f"native kernels do not run here: {kernels.why_not()}"
)


def _target(arch: str, weights: str, seed: int, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    model = make_target(arch, vocab_size=96, seed=seed)
    if weights == "int8":
        pytest.importorskip("torchao")
        from runtime.models.quant_schemes import quantize_model_inplace

        quantize_model_inplace(model, "int8", "cpu")
        return model
    if weights == "q4":
        from runtime.models.quant_schemes import quantize_model_inplace

        quantize_model_inplace(model, "q4", "cpu")  # dflash's own 4-bit kernel, no library
        return model
    if weights == "f32":
        return model  # float32 weights: dflash's float32 GEMM on every CPU where the kernels build
    monkeypatch.setattr(linear, "cpu_has_fast_bf16", lambda: False)  # bf16 on dflash's kernel, as on AVX2
    return model.to(torch.bfloat16)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("weights", ["bf16", "int8", "f32", "q4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_native_layers_compute_the_lean_forward(arch, weights, monkeypatch):
    model = _target(arch, weights, 4, monkeypatch)
    f32 = weights == "f32"  # a tiny float32 target takes the native float32 GEMM only when asked
    eager, native = LeanTarget(model, native_layers=False, native_f32=f32), LeanTarget(model, native_f32=f32)
    assert native.native_layers and not eager.native_layers
    for t in (eager, native):
        t.set_taps([0, 2, 3])
    # int8 and q4 round activations per row to 15 bits: a last-bit difference upstream may move one step
    tol = 1e-3 if weights in ("int8", "q4") else 1e-5
    c1, c2 = eager.new_cache(capacity=8), native.new_cache(capacity=8)  # small: the cache grows
    with torch.inference_mode():
        for n in (7, 5, 1, 3, 1):
            x = _ids(n, n)
            l1, f1 = eager.forward(x, c1)
            l2, f2 = native.forward(x, c2)
            assert l2.shape == l1.shape and f2 is not None and f1 is not None and f2.shape == f1.shape
            assert _rel(l2, l1) < tol and _rel(f2, f1) < tol
            assert native.cache_len(c2) == eager.cache_len(c1)
            eager.crop(c1, eager.cache_len(c1) - 1)
            native.crop(c2, native.cache_len(c2) - 1)
        # a tree: root r; children a, b; a's child c (ancestor mask, depth positions)
        parents, depth = [-1, 0, 0, 1], torch.tensor([0, 1, 1, 2])
        mask = torch.zeros(4, 4, dtype=torch.bool)
        for i in range(4):
            j = i
            while j >= 0:
                mask[i, j], j = True, parents[j]
        tokens = torch.tensor([[11, 22, 33, 44]])
        start = native.cache_len(c2)
        l1, _ = eager.forward(tokens, c1, positions=depth + start, tree_mask=mask, capture=False)
        l2, f2 = native.forward(tokens, c2, positions=depth + start, tree_mask=mask, capture=False)
        assert f2 is None and _rel(l2, l1) < tol
        native.keep(c2, start, [0, 1, 3])
        eager.keep(c1, start, [0, 1, 3])
        l1, _ = eager.forward(_ids(1, 9), c1, logits_to_keep=1)
        l2, _ = native.forward(_ids(1, 9), c2, logits_to_keep=1)
        assert l2.shape == (1, 96) and _rel(l2, l1) < tol


@pytest.mark.parametrize("weights", ["bf16", "int8", "f32", "q4"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
@pytest.mark.parametrize("prompt_len", [9, 14])
def test_a_verify_block_is_bit_identical_to_one_token_steps(arch, weights, prompt_len, monkeypatch):
    """The exactness contract: each row of a block (a chain, and a tree path) computes exactly what
    a one-token step at its position computes, so greedy DFlash cannot diverge from plain greedy.
    (A 14-token prompt puts keys 8-15 in the tail of the first steps and in an eight-key block of
    the later ones: attention scores eight keys at a time, the rest one by one.)"""
    model = _target(arch, weights, 6, monkeypatch)
    lean = LeanTarget(model, native_f32=weights == "f32")
    assert lean.native_layers
    lean.set_taps([1, 3])
    prompt, block = _ids(prompt_len, 1), _ids(5, 2)
    with torch.inference_mode():
        c_block, c_steps = lean.new_cache(), lean.new_cache()
        lean.forward(prompt, c_block)
        lean.forward(prompt, c_steps)
        lb, fb = lean.forward(block, c_block)
        rows = [lean.forward(block[:, i : i + 1], c_steps) for i in range(block.shape[1])]
        assert torch.equal(lb, torch.cat([r[0] for r in rows]))
        assert fb is not None and torch.equal(fb, torch.cat([r[1] for r in rows], dim=1))
        # the same tokens as the path 0 -> 1 -> 3 of a tree, beside a sibling branch
        tree = torch.tensor([[int(block[0, 0]), int(block[0, 1]), 7, int(block[0, 2])]])
        mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        c_tree = lean.new_cache()
        lean.forward(prompt, c_tree)
        start = lean.cache_len(c_tree)
        lt, _ = lean.forward(tree, c_tree, positions=torch.tensor([0, 1, 1, 2]) + start, tree_mask=mask)
        assert torch.equal(lt[[0, 1, 3]], lb[:3])


@pytest.mark.parametrize("weights", ["bf16", "int8", "f32", "q4"])
def test_dflash_through_native_layers_equals_plain_greedy(weights, monkeypatch):
    model = _target("qwen2", weights, 3, monkeypatch)
    lean = LeanTarget(model, native_f32=weights == "f32")
    assert lean.native_layers
    drafter = make_drafter(model.config, block_size=6, taps=[0, 2, 3])
    if weights == "bf16":
        drafter = drafter.to(torch.bfloat16)
        from runtime.engine.models.linear import activations_in, pack_linears

        pack_linears(drafter)
        activations_in(drafter, lean.dtype)
    rng = random.Random(weights)
    for _ in range(4):
        p = [rng.randrange(96) for _ in range(rng.randint(1, 9))]
        ref = lean_greedy_reference(lean, p, 16)
        assert greedy_pair(lean, drafter, p, 16, block_size=6) == (ref, ref)


def test_float32_targets_take_the_native_kernel_from_a_size_on(monkeypatch):
    """By default only float32 targets of NATIVE_F32_MIN_PARAMS parameters or more (steps bound by
    weight reads) run dflash's float32 GEMM and the native layers; DFLASH_NATIVE=0 keeps oneDNN."""
    from runtime.engine.models import lean_target

    model = make_target("qwen2", vocab_size=96, seed=2)
    assert not LeanTarget(model).native_layers
    monkeypatch.setattr(lean_target, "NATIVE_F32_MIN_PARAMS", 1000)
    lean = LeanTarget(model)
    assert lean.native_layers and all(f.f32 is not None for f in (lean.lean_layers[0].qkv, lean.head))
    monkeypatch.setattr(linear, "_native_f32", lambda: None)  # as with DFLASH_NATIVE=0
    assert not LeanTarget(model).native_layers


def test_native_layers_are_refused_where_they_cannot_run():
    model = make_target("qwen3", vocab_size=96, seed=1)  # a tiny float32 target: oneDNN's packed GEMMs
    assert not LeanTarget(model).native_layers
    with pytest.raises(ValueError, match="native layers cannot run"):
        LeanTarget(model, native_layers=True)


@pytest.mark.parametrize("weights", ["bf16", "f32"])
def test_a_long_prefill_runs_pytorch_layers_then_steps_run_native(weights, monkeypatch):
    """Prompts longer than NATIVE_MAX_ROWS take PyTorch's layers (SDPA; with float32 weights the
    BLAS GEMM past F32_NATIVE_MAX_ROWS); the cache they write is the one the native steps read."""
    from runtime.engine.models import lean_target

    model = _target("qwen2", weights, 5, monkeypatch)
    f32 = weights == "f32"
    eager, native = LeanTarget(model, native_layers=False, native_f32=f32), LeanTarget(model, native_f32=f32)
    monkeypatch.setattr(lean_target, "NATIVE_MAX_ROWS", 4)
    monkeypatch.setattr(kernels, "F32_NATIVE_MAX_ROWS", 4)
    called = []
    real = native._native_body
    monkeypatch.setattr(native, "_native_body", lambda *a, **k: called.append(a[0].shape[1]) or real(*a, **k))
    c1, c2 = eager.new_cache(), native.new_cache()
    with torch.inference_mode():
        for n in (9, 1, 3):
            l1, _ = eager.forward(_ids(n, n), c1)
            l2, _ = native.forward(_ids(n, n), c2)
            assert _rel(l2, l1) < 1e-5
    assert called == [1, 3]


def test_an_int4_body_keeps_bf16_activations_where_dflash_bf16_kernels_run(monkeypatch):
    """torchao's int4 projections take bf16 rows. Where the CPU's bf16 path is one of dflash's kernels
    (which take float32 rows), a bf16 target gets float32 activations, but an int4 body over bf16
    weights must not: `dflash doctor --speed` and `--quantize int4` failed there with "expected scalar
    type Float but found BFloat16". It decodes, on bf16 rows, and DFlash equals plain decoding."""
    pytest.importorskip("torchao")
    from runtime.models.quant_schemes import quantize_model_inplace

    if kernels.bf16_gemm() is None:
        pytest.skip(f"dflash's bf16 kernel does not run here: {kernels.why_not()}")
    monkeypatch.setattr(linear, "_process", {"bf16": "dflash-avx2"})  # dflash's kernel is the bf16 path
    assert linear.FusedLinear.native_bf16_runs(torch.device("cpu"))
    model = make_target("qwen2", vocab_size=96, seed=5).to(torch.bfloat16)
    try:
        quantize_model_inplace(model, "int4", "cpu")
    except Exception as e:  # noqa: BLE001 - torchao's int4 CPU kernel is missing from some builds
        pytest.skip(f"torchao int4 does not run here: {e}")
    lean = LeanTarget(model)
    assert lean.dtype == torch.bfloat16
    drafter = make_drafter(model.config, block_size=4, taps=[0, 2, 3]).to(torch.bfloat16)
    p = [3, 14, 15, 9, 2]
    ref = lean_greedy_reference(lean, p, 8)
    assert len(ref) == 8
    plain, dflash = greedy_pair(lean, drafter, p, 8, block_size=4)
    assert plain == ref and len(dflash) == 8


@pytest.mark.parametrize("weights", ["int8", "q4"])
def test_a_quantized_body_over_bf16_weights_runs_float32_activations(weights, monkeypatch):
    """`--quantize int8|q4` loads bf16 weights first. On a CPU whose default bf16 path is oneDNN's (native
    bf16, no measured choice in this process), the quantized projections still run on dflash's kernels,
    which take float32 rows: the body gets float32 activations and the native layers (not bf16 rows whose
    verify blocks round differently from one-token steps), and DFlash equals plain greedy decoding."""
    pytest.importorskip("torchao")
    from runtime.models.quant_schemes import quantize_model_inplace

    monkeypatch.setattr(linear, "_process", {})  # a fresh process: no bf16 path chosen yet
    monkeypatch.setattr(linear, "cpu_has_fast_bf16", lambda: True)  # oneDNN is the default bf16 path
    assert not linear.FusedLinear.native_bf16_runs(torch.device("cpu"))
    model = make_target("qwen2", vocab_size=96, seed=5).to(torch.bfloat16)
    quantize_model_inplace(model, weights, "cpu")
    lean = LeanTarget(model)
    assert lean.dtype == torch.float32 and lean.native_layers
    drafter = make_drafter(model.config, block_size=6, taps=[0, 2, 3])
    rng = random.Random(weights)
    for _ in range(3):
        p = [rng.randrange(96) for _ in range(rng.randint(1, 9))]
        ref = lean_greedy_reference(lean, p, 16)
        assert greedy_pair(lean, drafter, p, 16, block_size=6) == (ref, ref)
