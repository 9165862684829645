"""The lean target forward (static KV cache, packed weights) against transformers' own forward:
same logits and features, same greedy outputs, for every architecture it claims; tree masks and
cache compaction; models it cannot run stay on transformers."""

from __future__ import annotations

import random

import pytest
import torch

from runtime.config import RuntimeConfig
from runtime.engine.models.lean_target import LeanTarget, StaticKVCache, lean_supported
from runtime.engine.models.linear import FusedLinear, pack_linears
from runtime.engine.models.target import TargetModel
from runtime.errors import ConfigError
from runtime.pipeline import make_target as wrap_target
from tests.fakes import greedy_pair, greedy_reference, lean_greedy_reference, make_drafter, make_target

ARCHS = ["qwen3", "qwen2", "llama"]


def _ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, n), generator=g)


@pytest.mark.parametrize("arch", ARCHS)
def test_lean_forward_matches_transformers(arch):
    model = make_target(arch, vocab_size=96, seed=4)
    hf, lean = TargetModel(model), LeanTarget(model)
    for t in (hf, lean):
        t.set_taps([0, 2, 3])
    c_hf, c_lean = hf.new_cache(), lean.new_cache(capacity=8)  # small: forces the cache to grow
    with torch.inference_mode():
        for n in (7, 5, 1, 3):  # prefill, a verify block, one token, another block
            x = _ids(n, 96, seed=n)
            l1, f1 = hf.forward(x, c_hf)
            l2, f2 = lean.forward(x, c_lean)
            torch.testing.assert_close(l2, l1, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(f2, f1, rtol=1e-4, atol=1e-4)
            assert lean.cache_len(c_lean) == hf.cache_len(c_hf)
            hf.crop(c_hf, hf.cache_len(c_hf) - 1)  # a rejected draft: roll back one
            lean.crop(c_lean, lean.cache_len(c_lean) - 1)
        l1, _ = hf.forward(_ids(1, 96, 0), c_hf, logits_to_keep=1)
        l2, _ = lean.forward(_ids(1, 96, 0), c_lean, logits_to_keep=1)
        torch.testing.assert_close(l2, l1, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_mask_and_keep_equal_the_chosen_path(arch):
    """Two branches verified in one forward with an ancestor mask and depth positions give the same
    logits as each branch alone; keeping one branch's slots leaves the cache of that branch."""
    model = make_target(arch, vocab_size=96, seed=5)
    lean = LeanTarget(model)
    prompt = _ids(6, 96, seed=1)
    # tree: root r; children a (depth 1), b (depth 1); a's child c (depth 2). slots: r a b c
    tokens = torch.tensor([[11, 22, 33, 44]])
    parents = [-1, 0, 0, 1]
    depth = [0, 1, 1, 2]
    mask = torch.zeros(4, 4, dtype=torch.bool)
    for i in range(4):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    with torch.inference_mode():
        cache = lean.new_cache()
        lean.forward(prompt, cache)
        start = lean.cache_len(cache)
        tree_logits, _ = lean.forward(tokens, cache, positions=torch.tensor(depth) + start, tree_mask=mask)
        for path in ([0, 1, 3], [0, 2]):
            ref_cache = lean.new_cache()
            lean.forward(prompt, ref_cache)
            ref, _ = lean.forward(tokens[:, path], ref_cache)
            torch.testing.assert_close(tree_logits[path], ref, rtol=1e-4, atol=1e-4)
        # keep the path r -> a -> c, then continue: equals the chain r a c + next token
        lean.keep(cache, start, [0, 1, 3])
        assert lean.cache_len(cache) == start + 3
        nxt, _ = lean.forward(torch.tensor([[55]]), cache)
        ref_cache = lean.new_cache()
        lean.forward(prompt, ref_cache)
        ref, _ = lean.forward(torch.tensor([[11, 22, 44, 55]]), ref_cache)
        torch.testing.assert_close(nxt[0], ref[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch,block", [("qwen3", 4), ("qwen2", 8), ("llama", 16), ("qwen3", 2)])
def test_lean_dflash_greedy_equals_transformers_plain_greedy(arch, block):
    model = make_target(arch, vocab_size=96, seed=2)
    lean = LeanTarget(model)
    drafter = make_drafter(model.config, block_size=block, taps=[0, 2, 3])
    rng = random.Random(block)
    for _ in range(8):
        p = [rng.randrange(96) for _ in range(rng.randint(1, 10))]
        ref = greedy_reference(model, p, 20)  # cache-free transformers greedy decoding
        assert greedy_pair(lean, drafter, p, 20, block_size=block) == (ref, ref)


def test_static_cache_grows_and_crops():
    c = StaticKVCache(layers=2, kv_heads=1, head_dim=4, capacity=16, dtype=torch.float32, device=torch.device("cpu"))
    c.k[0][0, 0, :3] = torch.arange(12.0).view(3, 4)
    c.length = 3
    c.reserve(40)
    assert c.capacity >= 40 and torch.equal(c.k[0][0, 0, :3], torch.arange(12.0).view(3, 4))
    c.crop(1)
    assert c.get_seq_length() == 1
    with pytest.raises(ValueError):
        c.crop(2)


def test_engine_choice():
    model = make_target("qwen3", vocab_size=64)
    assert isinstance(wrap_target(model, "auto"), LeanTarget)
    assert type(wrap_target(model, "hf")) is TargetModel
    model.config.hidden_act = "gelu"  # an activation the lean forward does not implement
    assert lean_supported(model) is not None
    assert type(wrap_target(model, "auto")) is TargetModel
    with pytest.raises(ConfigError, match="engine lean"):
        wrap_target(model, "lean")
    with pytest.raises(ConfigError, match="unknown engine"):
        RuntimeConfig(engine="fast")


@pytest.mark.skipif(not FusedLinear.can_pack(torch.device("cpu"), torch.bfloat16), reason="no oneDNN bf16 here")
def test_packed_bf16_matches_unpacked(monkeypatch):
    """Packed oneDNN GEMMs compute what F.linear computes (bf16), for the target and the drafter
    (bf16 activations on both sides: CPUs without native bf16 would otherwise compute the lean side
    in float32, see test_bf16_weights_with_float32_activations). The oneDNN path is pinned: the path
    chosen by measurement may be one of dflash's, see test_bf16_choice.py."""
    from runtime.engine.models import linear

    monkeypatch.setattr(linear, "current_bf16_path", lambda: linear.ONEDNN_BF16)
    model = make_target("qwen2", vocab_size=96, seed=6).to(torch.bfloat16)
    hf, lean = TargetModel(model), LeanTarget(model, float_activations=False)
    assert lean.packed
    with torch.inference_mode():
        x = _ids(9, 96, seed=3)
        l1, _ = hf.forward(x, hf.new_cache())
        l2, _ = lean.forward(x, lean.new_cache())
    torch.testing.assert_close(l2.float(), l1.float(), rtol=2e-2, atol=2e-2)
    assert (l1.argmax(-1) == l2.argmax(-1)).float().mean() >= 0.85
    drafter = make_drafter(make_target("qwen3", vocab_size=96).config, block_size=4).to(torch.bfloat16)
    x = torch.randn(3, 5, drafter.fc.in_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        before = drafter.fuse_context(x)
        assert pack_linears(drafter) > 0
        after = drafter.fuse_context(x)
    torch.testing.assert_close(after.float(), before.float(), rtol=2e-2, atol=2e-2)
    assert "fc.weight" in drafter.state_dict()  # saving is unchanged


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_bf16_weights_with_float32_activations(arch, monkeypatch):
    """Where bf16 runs on dflash's kernel (CPUs without native bf16; forced here, so that CPUs with
    it test the path too), a bf16 target computes in float32 over its bf16 weights: the float32
    forward of the bf16-rounded weights, and DFlash greedy (verify blocks, a bf16 drafter whose
    norms follow the activations) equals plain greedy of that target."""
    from runtime.engine.models import kernels, linear
    from runtime.engine.models.linear import activations_in, all_linears_packed

    monkeypatch.setattr(linear, "cpu_has_fast_bf16", lambda: False)  # as on an AVX2 CPU
    if kernels.bf16_gemm() is None:
        pytest.skip(f"dflash's bf16 kernel does not build here: {kernels.why_not()}")
    assert FusedLinear.native_bf16_runs(torch.device("cpu"))
    model = make_target(arch, vocab_size=96, seed=8).to(torch.bfloat16)
    lean = LeanTarget(model)
    assert lean.dtype == torch.float32 and lean.embed.weight.dtype == torch.bfloat16
    rounded = LeanTarget(make_target(arch, vocab_size=96, seed=8).to(torch.bfloat16).float())
    lean.set_taps([0, 2, 3])
    rounded.set_taps([0, 2, 3])
    with torch.inference_mode():
        c1, c2 = lean.new_cache(), rounded.new_cache()
        assert c1.k[0].dtype == torch.float32
        for n in (7, 1, 4):
            x = _ids(n, 96, seed=n)
            l1, f1 = lean.forward(x, c1)
            l2, f2 = rounded.forward(x, c2)
            assert l1.dtype == torch.float32
            torch.testing.assert_close(l1, l2, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(f1, f2, rtol=1e-4, atol=1e-4)
    drafter = make_drafter(model.config, block_size=4, taps=[0, 2, 3]).to(torch.bfloat16)
    pack_linears(drafter)
    assert all_linears_packed(drafter)
    activations_in(drafter, lean.dtype)
    assert drafter.norm.weight.dtype == torch.float32
    rng = random.Random(3)
    for _ in range(4):
        p = [rng.randrange(96) for _ in range(rng.randint(1, 8))]
        ref = lean_greedy_reference(lean, p, 16)
        assert greedy_pair(lean, drafter, p, 16, block_size=4) == (ref, ref)


@pytest.mark.skipif(not FusedLinear.can_pack(torch.device("cpu"), torch.float32), reason="no oneDNN here")
def test_packed_float32_matches_unpacked():
    """float32 weights are packed too (oneDNN's small-row GEMMs beat the BLAS path on AVX2 CPUs): the
    same logits up to float32 rounding, the same greedy tokens, for the target and the drafter."""
    model = make_target("qwen3", vocab_size=96, seed=7)
    hf, lean = TargetModel(model), LeanTarget(model)
    assert lean.packed and all(lay.qkv.packed and lay.down.packed for lay in lean.lean_layers)
    with torch.inference_mode():
        x = _ids(11, 96, seed=4)
        l1, f1 = hf.forward(x, hf.new_cache())
        l2, f2 = lean.forward(x, lean.new_cache())
    torch.testing.assert_close(l2, l1, rtol=1e-4, atol=1e-4)
    assert torch.equal(l1.argmax(-1), l2.argmax(-1))
    drafter = make_drafter(model.config, block_size=4)
    x = torch.randn(3, 5, drafter.fc.in_features)
    with torch.inference_mode():
        before = drafter.fuse_context(x)
        assert pack_linears(drafter) > 0
        after = drafter.fuse_context(x)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_calibration_key_names_quantization_and_engine():
    from runtime.engine.calibrate import cache_key

    class Pipe:
        drafter = None
        block_size = 1

        def __init__(self, quant, target):
            self.quant, self.target = quant, target

        def describe(self):
            return {"target": "t", "device": "cpu", "dtype": "bfloat16", "quantization": self.quant}

    model = make_target("qwen3", vocab_size=64)
    lean, hf = LeanTarget(model), TargetModel(model)
    keys = {cache_key(Pipe(q, t)) for q in (None, "int4", "int8") for t in (lean, hf)}
    assert len(keys) == 6  # int4 no longer reuses bf16's verify costs; lean and hf are measured apart


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_lean_forward_on_quantized_target_equals_its_plain_greedy(scheme):
    """Quantized weights run through the lean forward (int8: ATen's int8 GEMM, the head in int8 too;
    int4: torchao's modules, unpacked); DFlash on them equals plain greedy decoding of the same
    quantized target, in float32."""
    pytest.importorskip("torchao")
    from runtime.models.quant_schemes import quantize_model_inplace

    model = make_target("qwen2", vocab_size=96, seed=3)
    quantize_model_inplace(model, scheme, "cpu")
    lean = LeanTarget(model)
    assert not any(lay.qkv.packed for lay in lean.lean_layers)
    int8 = scheme == "int8"
    assert all(lay.qkv.int8 and lay.down.int8 for lay in lean.lean_layers) == int8
    assert lean.head.int8 == int8
    drafter = make_drafter(model.config, block_size=6)
    rng = random.Random(scheme)
    for _ in range(3):
        p = [rng.randrange(96) for _ in range(rng.randint(2, 10))]
        ref = lean_greedy_reference(lean, p, 16) if int8 else greedy_reference(model, p, 16)
        assert greedy_pair(lean, drafter, p, 16) == (ref, ref)


def test_lean_int8_logits_stay_close_to_the_quantized_modules():
    """The int8 GEMM path (bf16 activations inside the GEMM, int8 head) computes the same function
    as torchao's int8 modules with a float head, up to bf16 rounding and the head's quantization."""
    pytest.importorskip("torchao")
    from runtime.models.quant_schemes import quantize_model_inplace

    model = make_target("qwen3", vocab_size=96, seed=5)
    quantize_model_inplace(model, "int8", "cpu")
    lean = LeanTarget(model)
    ids = _ids(12, 96, 1)
    with torch.no_grad():
        ref = model(input_ids=ids).logits[0].float()
        got, _ = lean.forward(ids, lean.new_cache(), capture=False)
    err = (got.float() - ref).abs().max() / ref.abs().max()
    assert err < 0.05
