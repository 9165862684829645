"""dflash's 4-bit scheme (``q4``): the native kernel against the de-quantized product, every row of a
block computed as if alone (on the path this machine runs, and on the AVX2 path where the CPU has
AVX-512), the fallback without native kernels, DFlash on a q4 target equal to its plain greedy
output in float32, the saved folder's round trip, and clear refusals (tiny models)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors import safe_open
from torch import nn
from typer.testing import CliRunner

from dflash_cli.app import app
from runtime import LoadOptions, ModelRef, RuntimeConfig, SamplingParams, load_pipeline
from runtime.engine.models import kernels
from runtime.engine.models.lean_target import LeanTarget
from runtime.engine.models.linear import FusedLinear
from runtime.engine.models.q4 import GROUP, Q4Linear, dequantize, kernel_sm, q4_matmul, quantize
from runtime.engine.models.target import TargetModel
from runtime.errors import ConfigError, ModelLoadError
from runtime.models.quant_schemes import SCHEMES, check_supported, quantize_model_inplace
from runtime.models.quantized import QUANT_KEY, load_q4_folder, read_saved_quantization
from runtime.quantize.job import QuantizeRequest, quantize_pair
from tests.fakes import (
    OracleDecoder,
    collect_ids,
    greedy_pair,
    greedy_reference,
    lean_greedy_reference,
    make_drafter,
    make_target,
    one_line_error,
)

gemm = kernels.q4_gemm()
needs_native = pytest.mark.skipif(gemm is None, reason=f"native kernel unavailable: {kernels.why_not()}")
CPU = RuntimeConfig(device="cpu", dtype="float32")
F32 = ["--dtype", "float32", "--device", "cpu"]
runner = CliRunner()


def _layer(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q4 tensors of a random [n, k] weight: (qweight, scales, mins, kernel sm)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / 10 + torch.rand(n, 1, generator=g) / 20  # lopsided rows
    q, s, m = quantize(w)
    return q, s, m, kernel_sm(s, m)


def _opts(tmp_path, **kw) -> LoadOptions:
    return LoadOptions(models_dir=tmp_path / "models", offline=True, **kw)


def _logits(pipe, ids) -> torch.Tensor:
    with torch.inference_mode():
        return pipe.target.model(input_ids=torch.tensor([ids])).logits[0]


# -- the format ------------------------------------------------------------------------------------


def test_quantize_packs_groups_of_32_and_fits_them_better_than_min_max():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 256, generator=g) * torch.rand(16, 1, generator=g)
    q, s, m = quantize(w)
    assert q.dtype == torch.uint8 and q.shape == (16, 128)
    assert s.dtype == m.dtype == torch.float16 and s.shape == m.shape == (16, 256 // GROUP)
    assert all(torch.equal(a, b) for a, b in zip((q, s, m), quantize(w), strict=True))  # deterministic
    deq = dequantize(q, s, m)
    # nibble layout: byte i of a group holds weights i (low) and 16 + i (high)
    assert int(q[0, 0]) & 15 == round(float((deq[0, 0] - m[0, 0].float()) / s[0, 0].float()))
    assert int(q[0, 0]) >> 4 == round(float((deq[0, 16] - m[0, 0].float()) / s[0, 0].float()))
    # the fitted scales and minimums beat the plain min..max grid (Q4_1's) on squared error
    grp = w.reshape(-1, GROUP)
    lo, hi = grp.amin(1, keepdim=True), grp.amax(1, keepdim=True)
    step = (hi - lo) / 15
    plain = torch.round((grp - lo) / step).clamp(0, 15) * step + lo
    err, err_plain = float(((deq - w) ** 2).sum()), float(((plain - grp) ** 2).sum())
    assert err < 0.97 * err_plain
    assert float(((deq - w) ** 2).mean() / (w**2).mean()) < 0.01


def test_quantize_refuses_widths_that_are_not_whole_groups():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 48))
    with pytest.raises(ValueError, match="multiple of 32"):
        Q4Linear(48, 4, bias=False)


# -- the native kernel -------------------------------------------------------------------------------


@needs_native
@pytest.mark.parametrize(("n", "k"), [(64, 896), (37, 96), (5, 32), (130, 4864), (9, 288)])
def test_q4_gemm_computes_the_dequantized_product(n, k):
    q, s, m, sm = _layer(n, k, seed=n + k)
    w = dequantize(q, s, m).double()
    gen = torch.Generator().manual_seed(n * k)
    b = torch.randn(n, generator=gen)
    x = torch.randn(9, k, generator=gen)
    x[3, 5] = 40.0  # an outlier sets its row's activation scale, not the others'
    y = gemm(x, q, sm, b)
    assert y.dtype == torch.float32 and y.shape == (9, n)
    ref = x.double() @ w.T + b.double()
    # exactly the product of the activations rounded per row to multiples of max|row| / 16383 ...
    # (rounded as the kernel rounds them: x times the float32 inverse of the scale, ties to even;
    # x / scale would now and then land on the other side of a .5 and move one step)
    xs = x.abs().amax(dim=1, keepdim=True) / 16383
    exact = (torch.round(x * (1.0 / xs)).double() * xs.double()) @ w.T + b.double()
    assert float((y.double() - exact).abs().max() / exact.abs().max()) < 1e-5
    # ... which is within half a step of each row's scale per weight of the float product
    bound = 0.5 * xs.double() * w.abs().sum(dim=1) + 1e-5 * ref.abs().max()
    assert bool(((y.double() - ref).abs() <= bound).all())
    torch.testing.assert_close(gemm(x, q, sm, None), y - b)


def _isas() -> list[str]:
    """The q4 paths this machine runs: its best, and AVX2 where the best is AVX-512."""
    best = kernels.q4_isa()
    return [best] + (["avx2"] if best != "avx2" else [])


@needs_native
@pytest.mark.parametrize("k", [896, 96, 32, 4864])
def test_every_row_is_computed_as_if_alone(k):
    """A verify block of T rows gives, row for row, bit-identical results to T one-row calls, on
    every q4 path this CPU runs; the AVX-512 and AVX2 paths give identical results."""
    q, _s, _m, sm = _layer(41, k, seed=k)
    b = torch.randn(41)
    x = torch.randn(150, k)
    x[4] *= 300.0  # a row of large values
    best = kernels.q4_isa()
    results = {}
    try:
        for isa in _isas():
            assert kernels.q4_isa(isa) == isa
            for t in (2, 3, 4, 5, 8, 9, 16, 33, 65, 150):  # over 64 rows: computed in passes
                block = gemm(x[:t], q, sm, b)
                alone = torch.cat([gemm(x[i : i + 1], q, sm, b) for i in range(t)])
                assert torch.equal(block, alone), (isa, t)
            results[isa] = gemm(x[:8], q, sm, b)
    finally:
        kernels.q4_isa("best")
    assert kernels.q4_isa() == best
    first = next(iter(results.values()))
    assert all(torch.equal(first, r) for r in results.values())


@needs_native
def test_threads_do_not_change_results():
    q, _s, _m, sm = _layer(200, 896, seed=3)
    x = torch.randn(5, 896)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm(x, q, sm, None)
        torch.set_num_threads(2)
        two = gemm(x, q, sm, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_native
def test_the_wrapper_refuses_what_the_kernel_would_misread():
    q, _s, _m, sm = _layer(8, 64, seed=1)
    with pytest.raises(ValueError, match="multiple of 32"):
        gemm(torch.randn(2, 48), q, sm, None)
    with pytest.raises(ValueError, match="sm must be a contiguous float16 tensor"):
        gemm(torch.randn(2, 64), q, sm.float(), None)
    with pytest.raises(ValueError, match="w must be a contiguous uint8"):
        gemm(torch.randn(2, 64), q[:, :16], sm, None)


def test_fallback_is_the_dequantized_product_row_by_row():
    """Without the native kernel (DFLASH_NATIVE=0, no compiler): the de-quantized float32 product,
    each row of a step computed alone (row-independent too), close to the native result."""
    q, s, m, sm = _layer(24, 96, seed=5)
    x = torch.randn(8, 96)
    y = q4_matmul(x, q, sm, None, native=None)
    torch.testing.assert_close(y, x @ dequantize(q, s, m).T, rtol=1e-5, atol=1e-5)
    assert torch.equal(y, torch.cat([q4_matmul(x[i : i + 1], q, sm, None, native=None) for i in range(8)]))
    if gemm is not None:  # not bit for bit: the native kernel rounds the activations to 15 bits
        torch.testing.assert_close(gemm(x, q, sm, None), y, rtol=1e-3, atol=1e-3)


# -- models ----------------------------------------------------------------------------------------


def test_every_linear_but_the_head_becomes_q4():
    model = make_target("qwen3", vocab_size=96, seed=0)
    x = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.inference_mode():
        before = model(input_ids=x).logits
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    summary = quantize_model_inplace(model, "q4", "cpu")
    assert (summary.quantized, summary.kept_float) == (n_linear - 1, 1)
    assert isinstance(model.lm_head, nn.Linear) and type(model.model.embed_tokens.weight) is nn.Parameter
    assert isinstance(model.model.layers[0].mlp.down_proj, Q4Linear)
    # 5 bits per quantized weight instead of 32
    q4_bytes = sum(
        b.numel() * b.element_size() for m in model.modules() if isinstance(m, Q4Linear) for b in m.buffers()
    )
    q4_weights = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, Q4Linear))
    assert q4_bytes * 8 / q4_weights == 5.0
    with torch.inference_mode():
        after = model(input_ids=x).logits
    assert not torch.equal(before, after) and torch.isfinite(after).all()
    assert quantize_model_inplace(model, "q4", "cpu").quantized == 0  # nothing left to quantize


def test_q4_projections_fuse_onto_the_kernel_and_the_head_runs_in_int8():
    model = make_target("qwen3", vocab_size=96, seed=1)
    quantize_model_inplace(model, "q4", "cpu")
    lean = LeanTarget(model)
    qkv = lean.lean_layers[0].qkv
    assert qkv.q4 and qkv.native_kind == 4 and lean.head.int8 and lean.int8
    assert lean.native_layers == (gemm is not None)
    # the fused q/k/v GEMM computes what the three modules compute
    attn = model.model.layers[0].self_attn
    x = torch.randn(3, 64)
    with torch.inference_mode():
        fused = qkv(x)
        alone = (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
    assert all(torch.equal(a, b) for a, b in zip(fused, alone, strict=True))
    assert isinstance(FusedLinear([attn.q_proj], pack=True).weight, torch.Tensor)


@pytest.mark.parametrize("forward", ["lean", "hf"])
def test_dflash_on_a_q4_target_equals_its_plain_greedy(forward):
    """Lossless with respect to the q4 target in float32: every acceptance length, random drafter too."""
    model = make_target("qwen3", vocab_size=96, seed=3)
    quantize_model_inplace(model, "q4", "cpu")
    target = LeanTarget(model) if forward == "lean" else TargetModel(model)
    drafter = make_drafter(model.config, block_size=6)
    quantize_model_inplace(drafter, "q4", "cpu")  # a q4 drafter changes acceptance only
    params = SamplingParams(max_new_tokens=16)
    rng = random.Random(forward)
    taus = []
    for i in range(3):
        p = [rng.randrange(96) for _ in range(rng.randint(2, 10))]
        ref = lean_greedy_reference(target, p, 16) if forward == "lean" else greedy_reference(model, p, 16)
        assert greedy_pair(target, drafter, p, 16) == (ref, ref)
        events = list(OracleDecoder(target, drafter, corrupt=0.3, seed=i).stream(p, params))
        assert collect_ids(events) == ref
        taus.append(events[-1].stats.tau)
    assert max(taus) > 2  # multi-token verify blocks on q4 weights were exercised


def test_on_the_fly_q4_runs_dflash_losslessly(tiny_pair, tmp_path):
    t, d = tiny_pair
    ref = ModelRef(target=str(t), drafter=str(d))
    base = load_pipeline(ref, CPU, _opts(tmp_path))
    quant = load_pipeline(ref, CPU, _opts(tmp_path, quantize="q4"))
    assert quant.describe()["quantization"] == "q4"
    assert isinstance(quant.target.model.model.layers[0].mlp.up_proj, Q4Linear)
    assert isinstance(quant.drafter.layers[0].mlp.up_proj, nn.Module)  # --quantize is for the target only
    assert not isinstance(quant.drafter.layers[0].mlp.up_proj, Q4Linear)
    ids = [5, 6, 7, 8, 9]
    assert not torch.equal(_logits(base, ids), _logits(quant, ids))
    dflash = collect_ids(list(quant.stream(ids, SamplingParams(max_new_tokens=16))))
    assert dflash == lean_greedy_reference(quant.target, ids, 16)


# -- saved folders -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def q4_saved(tiny_pair, tmp_path_factory):
    """The tiny pair quantized with q4 (target and drafter) by quantize_pair."""
    t, d = tiny_pair
    root = tmp_path_factory.mktemp("q4")
    req = QuantizeRequest(
        scheme="q4",
        out=root / "q4",
        ref=ModelRef(target=str(t), drafter=str(d)),
        runtime=CPU,
        load=LoadOptions(models_dir=root / "models", offline=True),
        quantize_drafter=True,
    )
    return quantize_pair(req)


def test_saved_q4_folder_round_trip(q4_saved, tiny_pair, tmp_path):
    res = q4_saved
    t, d = tiny_pair
    assert res.reload_max_diff == 0.0 and res.stored_quantized and res.library == "dflash"
    assert res.disk_after < res.disk_before / 2 and res.memory_after < res.memory_before / 2
    cfg = json.loads((res.out / "config.json").read_text())
    assert cfg[QUANT_KEY]["scheme"] == "q4" and cfg[QUANT_KEY]["stored_quantized"]
    assert (res.out / "tokenizer.json").exists()
    with safe_open(str(res.out / "model.safetensors"), "pt") as f:
        dtypes = {k.rsplit(".", 1)[-1]: f.get_slice(k).get_dtype() for k in f.keys()}
    assert (dtypes["qweight"], dtypes["scales"], dtypes["mins"]) == ("U8", "F16", "F16")
    loaded = load_pipeline(ModelRef(target=str(res.out)), CPU, _opts(tmp_path))  # the recorded drafter
    assert loaded.quantization == "q4" and loaded.pair.drafter_dir == res.drafter_out
    assert isinstance(loaded.target.model.model.layers[1].self_attn.q_proj, Q4Linear)
    assert isinstance(loaded.drafter.layers[0].self_attn.q_proj, Q4Linear)
    assert type(loaded.target.model.lm_head.weight) is nn.Parameter
    # the folder loads to exactly what on-the-fly quantization of the original gives
    fly = load_pipeline(ModelRef(target=str(t), drafter=str(d)), CPU, _opts(tmp_path, quantize="q4"))
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    assert torch.equal(_logits(loaded, ids), _logits(fly, ids))
    params = SamplingParams(max_new_tokens=12)
    out = collect_ids(list(loaded.stream(ids, params)))
    assert out == lean_greedy_reference(loaded.target, ids, 12)
    assert out == lean_greedy_reference(fly.target, ids, 12)


def test_a_tied_head_is_saved_once_and_tied_again(tmp_path):
    model = make_target("qwen2", vocab_size=96, seed=2)
    model.config.tie_word_embeddings = True  # as Qwen2.5-0.5B's head is
    model.lm_head.weight = model.model.embed_tokens.weight
    quantize_model_inplace(model, "q4", "cpu")
    from runtime.models.quantized import save_quantized_target

    src = tmp_path / "src"
    src.mkdir()
    save_quantized_target(model, src, tmp_path / "out", "q4", "tiny")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    back = load_q4_folder(tmp_path / "out", torch.device("cpu"), torch.float32)
    assert back.lm_head.weight is back.model.embed_tokens.weight
    x = torch.tensor([[4, 5, 6, 7]])
    with torch.inference_mode():
        assert torch.equal(back(input_ids=x).logits, model(input_ids=x).logits)


def test_a_damaged_q4_folder_is_a_model_load_error(q4_saved, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(q4_saved.out, bad)
    state = load_file(str(bad / "model.safetensors"))
    del state["model.layers.0.mlp.up_proj.mins"]
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="mins"):
        load_pipeline(ModelRef(target=str(bad), drafter="none"), CPU, _opts(tmp_path))
    r = runner.invoke(app, ["run", "--target", str(bad), "--drafter", "none", *F32, "hi"])
    one_line_error(r, ModelLoadError.exit_code, "do not match")


def test_cli_quantize_and_run_q4(q4_saved, tiny_pair, tmp_path):
    t, d = tiny_pair
    out = tmp_path / "cli-q4"
    r = runner.invoke(
        app, ["quantize", "--target", str(t), "--drafter", "none", "--scheme", "q4", "-o", str(out), *F32]
    )
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == str(out.resolve())
    saved = read_saved_quantization(out)
    assert saved is not None and saved.scheme == "q4" and saved.stored_quantized
    r = runner.invoke(
        app, ["run", "--target", str(t), "--drafter", str(d), "--quantize", "q4", *F32, "--json", "-n", "6", "hi"]
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.splitlines()[-1])["stats"]["generated_tokens"] == 6
    # a q4 folder is already quantized: quantizing it again is refused before anything loads
    r = runner.invoke(
        app, ["quantize", "--target", str(out), "--drafter", "none", "--scheme", "q4", "-o", str(tmp_path / "again")]
    )
    one_line_error(r, ConfigError.exit_code, "already quantized (q4)")


def test_q4_is_refused_where_it_does_not_run(tiny_pair, tmp_path):
    with pytest.raises(ConfigError, match="does not run on cuda.*--device cpu"):
        check_supported(SCHEMES["q4"], torch.device("cuda"), torch.bfloat16)
    # a model none of whose layers is whole groups of 32 has nothing to store in q4
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg)
    assert quantize_model_inplace(model, "q4", "cpu").quantized == 0
    from runtime.models.quantized import save_quantized_target

    with pytest.raises(ConfigError, match="no layer of this model was quantized"):
        save_quantized_target(model, tmp_path, tmp_path / "out", "q4", "tiny")


def test_a_dtype_cast_keeps_the_float16_scales():
    layer = Q4Linear.from_linear(nn.Linear(64, 8))
    scales = layer.scales.clone()
    layer.to(torch.bfloat16)
    assert layer.scales.dtype == torch.float16 and torch.equal(layer.scales, scales)
    assert layer.weight.dtype == torch.bfloat16 and layer.bias is not None and layer.bias.dtype == torch.bfloat16
    y = layer(torch.randn(2, 64, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (2, 8)


def test_without_native_kernels_dflash_on_q4_still_equals_plain_greedy(kernel_settings):
    """DFLASH_NATIVE=0 (or no compiler): the PyTorch layers and the de-quantized q4 product, each
    step row computed alone, so DFlash on the q4 target still equals its plain greedy output."""
    model = make_target("qwen3", vocab_size=96, seed=7)
    quantize_model_inplace(model, "q4", "cpu")
    kernels.configure(enabled=False, cache=kernels.settings()[1])
    lean = LeanTarget(model)
    assert not lean.native_layers and lean.lean_layers[0].qkv.q4 and lean.lean_layers[0].qkv.q4_native is None
    drafter = make_drafter(model.config, block_size=6)
    rng = random.Random(7)
    for _ in range(3):
        p = [rng.randrange(96) for _ in range(rng.randint(2, 10))]
        ref = lean_greedy_reference(lean, p, 16)
        assert greedy_pair(lean, drafter, p, 16) == (ref, ref)


def test_the_quality_script_runs_on_a_tiny_pair(tiny_pair, tmp_path, monkeypatch, capsys):
    """scripts/quant_quality.py (a benchmark for the embedded pair) on the tiny pair: a table row per
    pair, finite perplexities, DFlash == plain on the q4 target."""
    import runpy
    import sys

    t, d = tiny_pair
    out = tmp_path / "quality.json"
    argv = ["quant_quality.py", "--target", str(t), "--drafter", str(d), "--limit", "1", "-n", "4", "--ctx", "16"]
    argv += ["--max-text-tokens", "64", "--base-dtype", "float32", "--dtype", "float32", "--threads", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    runpy.run_path("scripts/quant_quality.py", run_name="__main__")
    table = capsys.readouterr().out
    assert "| float | float32 |" in table and "| q4 | float32 |" in table
    rows = json.loads(out.read_text())["rows"]
    assert [r["weights"] for r in rows] == ["float", "q4"]
    assert all(r["perplexity"] > 1 and r["scored_tokens"] == 32 for r in rows)
    assert rows[1]["dflash_equals_plain"] == 1 and 0 <= rows[1]["agreement"] <= 1
