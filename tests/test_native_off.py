"""The native kernels are an optimisation, never a change of output: a full greedy decode of the
tiny pair with ``DFLASH_NATIVE=0`` (PyTorch's GEMMs and layers) equals plain greedy decoding in
float32 and the same decode on the native kernels; and the ctypes wrappers refuse tensors the C code
would misread (wrong dtype, shape or layout) with a clear error instead of computing garbage."""

from __future__ import annotations

import ctypes

import pytest
import torch

from dflash_cli.common import configure_kernels
from runtime.config import DecodeOptions, SamplingParams
from runtime.engine.models import kernels, lean_target
from tests.fakes import collect_ids, greedy_reference

native_here = kernels._cpu_ok() is None and kernels._compiler() is not None


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory):
    """One kernel build shared by this module's wrapper tests."""
    return tmp_path_factory.mktemp("kernels")


def _decode(pipe, ids, opts: DecodeOptions) -> list[int]:
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    return collect_ids(list(pipe.stream_ids(ids, params, opts)))


def test_greedy_decode_is_the_same_with_and_without_native_kernels(tiny_pair, monkeypatch, kernel_settings):
    from runtime import ModelRef, RuntimeConfig, load_pipeline

    # the tiny float32 target takes dflash's float32 GEMM and the native layers, as large ones do
    monkeypatch.setattr(lean_target, "NATIVE_F32_MIN_PARAMS", 0)
    t, d = tiny_pair
    ref = ModelRef(target=str(t), drafter=str(d))
    plans = {
        "adaptive": DecodeOptions(),
        "tree": DecodeOptions(tree_budget=8, confidence_cut=False),
        "chain": DecodeOptions(tree_budget=0, verify_length=3),
        "plain": DecodeOptions(decoder="ar"),
    }
    out: dict[str, dict[str, list[int]]] = {}
    for native in ("0", "1"):
        monkeypatch.setenv("DFLASH_NATIVE", native)
        configure_kernels()  # how the CLI maps the variable
        pipe = load_pipeline(ref, RuntimeConfig(dtype="float32", device="cpu"))
        assert pipe.target.native_layers == (native == "1" and native_here)
        prompt = pipe.encode("def fib(n):", chat=False)
        # the reference: greedy decoding with transformers' own forward in float32, no cache
        truth = greedy_reference(pipe.target.model, prompt, 40)
        out[native] = {name: _decode(pipe, prompt, opts) for name, opts in plans.items()}
        for name, ids in out[native].items():
            assert ids == truth, (native, name)
    assert out["0"] == out["1"]


needs_native = pytest.mark.skipif(not native_here, reason="the native kernels cannot be built here")


def _gemm_cases() -> list[tuple[str, tuple, str]]:
    x = torch.randn(3, 16)
    q = torch.randint(-127, 128, (5, 16), dtype=torch.int8)
    s, b = torch.rand(5), torch.randn(5)
    w16, w32 = torch.randn(5, 16).to(torch.bfloat16), torch.randn(5, 16)
    return [
        ("int8", (x, w32, s, b), "w must be a contiguous int8 tensor"),
        ("int8", (x, torch.randint(-127, 128, (5, 32), dtype=torch.int8), s, b), r"\[\?, 16\]"),
        ("int8", (x, torch.randint(-127, 128, (16, 5), dtype=torch.int8).T, s, b), "not contiguous"),
        ("int8", (x, q, s.to(torch.bfloat16), b), "scale must be a contiguous float32 tensor \\[5\\]"),
        ("int8", (x, q, s, torch.randn(4)), "bias must be"),
        ("int8", (x[None], q, s, b), "x must be a 2-D float tensor"),
        ("int8", (x.long(), q, s, b), "x must be a 2-D float tensor"),
        ("bf16", (x, w32, b), "w must be a contiguous bfloat16 tensor"),
        ("bf16", (x, torch.randn(16, 5).to(torch.bfloat16).T, b), "not contiguous"),
        ("bf16", (x, w16, b[:3]), "bias must be"),
        ("f32", (x, w16, b), "w must be a contiguous float32 tensor"),
        ("f32", (x, torch.randn(5, 8), b), r"\[\?, 16\]"),
        ("f32", (x, w32, b.double()), "bias must be"),
    ]


@needs_native
@pytest.mark.parametrize(("kind", "args", "message"), _gemm_cases())
def test_gemm_wrappers_refuse_tensors_the_kernel_would_misread(kind, args, message, kernel_settings, kernel_cache):
    kernels.configure(cache=kernel_cache)
    fn = {"int8": kernels.int8_gemm, "bf16": kernels.bf16_gemm, "f32": kernels.f32_gemm}[kind]()
    assert fn is not None, kernels.why_not()
    with pytest.raises(ValueError, match=message):
        fn(*args)


@needs_native
def test_the_layers_wrapper_refuses_bad_arguments(kernel_settings, kernel_cache):
    """The native layer stack reads raw pointers: rows, rotary tables, mask and tap buffer must have
    the dtype and shape the model's shape implies, and the rows must fit the cache."""
    kernels.configure(cache=kernel_cache)
    fn = kernels.layers_fn()
    assert fn is not None, kernels.why_not()
    shape = kernels.Shape(8, 2, 1, 4, 16)
    stack = (kernels.Layer * 2)()
    ck = (ctypes.c_void_p * 2)()
    cv = (ctypes.c_void_p * 2)()
    h, cos, sin = torch.zeros(3, 8), torch.zeros(3, 4), torch.zeros(3, 4)

    def call(**kw):
        args = dict(stack=stack, shape=shape, ck=ck, cv=cv, capacity=16, h=h, start=0, cos=cos, sin=sin)
        args.update(mask=None, taps=(), tapbuf=None)
        args.update(kw)
        fn(**args)

    with pytest.raises(ValueError, match="h must be a contiguous float32 tensor"):
        call(h=h.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"h must be .*\[3, 8\]"):
        call(h=torch.zeros(3, 6))
    with pytest.raises(ValueError, match="cos must be"):
        call(cos=torch.zeros(3, 2))
    with pytest.raises(ValueError, match="sin must be .*not contiguous"):
        call(sin=torch.zeros(4, 3).T)
    with pytest.raises(ValueError, match="do not fit a cache of 16"):
        call(start=14)
    with pytest.raises(ValueError, match="mask must be a contiguous uint8 tensor \\[3, 5\\]"):
        call(start=2, mask=torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="taps"):
        call(taps=(2,), tapbuf=torch.zeros(3, 8))
    with pytest.raises(ValueError, match="tapbuf must be .*\\[3, 16\\]"):
        call(taps=(0, 1), tapbuf=torch.zeros(3, 8))
    with pytest.raises(ValueError, match="K and"):
        call(ck=(ctypes.c_void_p * 1)())
