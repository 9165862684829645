"""The native GEMMs (runtime.engine.models.kernels): int8 weights x activations rounded per row to 15-bit
integers, and bf16 or float32 weights x float32 activations; every input row computed exactly as it would be
alone (the lossless contract of greedy DFlash), and a clean fallback where they cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from runtime.engine.models import kernels

gemm = kernels.int8_gemm()
bf16 = kernels.bf16_gemm()
f32 = kernels.f32_gemm()
needs_native = pytest.mark.skipif(gemm is None, reason=f"native kernel unavailable: {kernels.why_not()}")


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return q, torch.rand(n, generator=g) / 50, torch.randn(n, generator=g)


@needs_native
@pytest.mark.parametrize(("n", "k"), [(64, 896), (37, 77), (5, 32), (130, 4864)])
def test_int8_gemm_computes_the_dequantized_product(n, k):
    q, s, b = _weights(n, k, seed=n + k)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(n * k))
    x[3, 5 % k] = 40.0  # an outlier sets its row's scale, not the others'
    ref = x.double() @ (q.double() * s.double()[:, None]).T + b.double()
    y = gemm(x, q, s, b)
    assert y.dtype == torch.float32 and y.shape == (9, n)
    # exactly the product of the activations rounded per row to multiples of max|row| / 16383
    # (rounded as the kernel rounds them: x times the float32 inverse of the scale, ties to even;
    # x / scale would now and then land on the other side of a .5 and move one step)
    xs = x.abs().amax(dim=1, keepdim=True) / 16383
    xr = torch.round(x * (1.0 / xs)).double() * xs.double()
    exact = xr @ (q.double() * s.double()[:, None]).T + b.double()
    assert float((y.double() - exact).abs().max() / exact.abs().max()) < 1e-5  # float32 scaling
    # which is within the rounding of 15-bit activations of the float product: half a step of the
    # row's scale per weight at most
    bound = 0.5 * xs.double() * (q.double().abs() * s.double()[:, None]).sum(dim=1) + 1e-5 * ref.abs()
    assert bool(((y.double() - ref).abs() <= bound).all())
    torch.testing.assert_close(gemm(x, q, s, None), y - b)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "k"), [(64, 896), (37, 77), (5, 32), (130, 4864)])
def test_float_weight_gemms_compute_the_float_product(n, k, dtype):
    fn = bf16 if dtype == torch.bfloat16 else f32
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g)
    x = torch.randn(9, k, generator=g)
    ref = x.double() @ w.double().T + b.double()
    y = fn(x, w, b)
    assert y.dtype == torch.float32 and y.shape == (9, n)
    assert float((y.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    torch.testing.assert_close(fn(x, w, None), y - b)


@needs_native
@pytest.mark.parametrize("k", [896, 77, 33, 4864])
def test_every_row_is_computed_as_if_alone(k):
    """A verify block of T rows gives, row for row, bit-identical results to T one-row calls (at K >=
    2048 a verify's rows meet two weight rows per tile on the AVX-512 paths; a one-row step, one)."""
    q, s, b = _weights(49, k, seed=k)  # an odd row count: the last weight row has no partner
    w16 = (torch.randn(49, k) / 10).to(torch.bfloat16)
    x = torch.randn(150, k)
    for t in (2, 3, 4, 7, 8, 9, 16, 17, 33, 65, 150):  # over 64 rows: a prompt, computed in passes
        block = gemm(x[:t], q, s, b)
        alone = torch.cat([gemm(x[i : i + 1], q, s, b) for i in range(t)])
        assert torch.equal(block, alone), t
        block = bf16(x[:t], w16, b)
        alone = torch.cat([bf16(x[i : i + 1], w16, b) for i in range(t)])
        assert torch.equal(block, alone), t
        block = f32(x[:t], w16.float(), b)
        alone = torch.cat([f32(x[i : i + 1], w16.float(), b) for i in range(t)])
        assert torch.equal(block, alone), t


@needs_native
@pytest.mark.parametrize("n", [45, 2051])
def test_a_prompts_rows_are_computed_as_if_alone(n):
    """Passes of many rows (a prefill) take tiles of two or four weight rows (four from N >= 2048) on
    the int8, AVX-512-BF16 and AMX paths: rows 0..69 of such a GEMM equal the same rows computed alone,
    bit for bit, with a last tile of fewer weight rows (45 and 2051 are not multiples of 4)."""
    q, s, b = _weights(n, 896, seed=n)
    w16 = (torch.randn(n, 896) / 10).to(torch.bfloat16)
    x = torch.randn(70, 896)
    x[5] *= 1e3
    kernels_here = [lambda r: gemm(r, q, s, b)]
    dp, amx = kernels.bf16dp_gemm(), kernels.bf16amx_gemm()
    if dp is not None:
        kernels_here.append(lambda r: dp(r, w16, b))
    if amx is not None:
        kernels_here.append(lambda r: amx(r, w16, b))
    for fn in kernels_here:
        block = fn(x)
        for i in (0, 3, 5, 33, 63, 64, 69):
            assert torch.equal(block[i : i + 1], fn(x[i : i + 1])), i
        assert torch.equal(fn(x[:40])[:40], block[:40])


@needs_native
@pytest.mark.parametrize("k", [896, 4864, 77, 48, 16400])
def test_int8_paths_give_identical_results(k):
    """The AVX-512 VNNI path and the AMX tiles (where the CPU has them) sum the same integers as the
    AVX2 path: equal bit for bit, at every row count (AMX: one and several 16-row column blocks),
    K tail and chunk boundary (16400 > 4096 * 4)."""
    best = kernels.int8_isa()
    if best == "avx2":
        pytest.skip(f"this CPU runs the int8 kernel with {best} only")
    q, s, b = _weights(41, k, seed=k)
    x = torch.randn(40, k)
    x[2] *= 300.0  # a row of large values: int32 partial sums near their bound
    x[33] *= -300.0
    runs = {}
    try:
        for isa in ("avx2", "avx512vnni", "amx"):
            if kernels.int8_isa(isa) == isa:
                runs[isa] = [gemm(x[:t], q, s, b) for t in (1, 3, 8, 12, 40)]
    finally:
        assert kernels.int8_isa("best") == best
    assert best in runs
    for isa, got in runs.items():
        for a, c in zip(got, runs["avx2"], strict=True):
            assert torch.equal(a, c), isa
    # every product at its largest: the int32 partial sums must not wrap
    y = gemm(torch.ones(2, k), torch.full((3, k), -128, dtype=torch.int8), torch.ones(3), None)
    torch.testing.assert_close(y, torch.full((2, 3), -128.0 * k), rtol=1e-6, atol=0)


@needs_native
def test_threads_do_not_change_results():
    q, s, b = _weights(200, 896, seed=3)
    x = torch.randn(5, 896)
    before = torch.get_num_threads()
    try:
        w16 = torch.randn(200, 896).to(torch.bfloat16)
        torch.set_num_threads(1)
        one, one16, one32 = gemm(x, q, s, b), bf16(x, w16, b), f32(x, w16.float(), b)
        torch.set_num_threads(2)
        two, two16, two32 = gemm(x, q, s, b), bf16(x, w16, b), f32(x, w16.float(), b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two) and torch.equal(one16, two16) and torch.equal(one32, two32)


def test_disabled_native_kernel_falls_back_with_one_line(tmp_path):
    """DFLASH_NATIVE=0 (or no compiler / no AVX2): int8_gemm() is None, one line on stderr says why,
    and int8 linears still run (ATen's kernel)."""
    code = (
        "import torch; from runtime.engine.models import kernels; from runtime.engine.models.linear import Int8Head, FusedLinear\n"
        "from dflash_cli.common import configure_kernels; configure_kernels()\n"
        "assert kernels.int8_gemm() is None and kernels.why_not().startswith('switched off'), kernels.why_not()\n"
        "lin = torch.nn.Linear(64, 16)\n"
        "f = FusedLinear([Int8Head(lin)], pack=False)\n"
        "assert f.int8 and f.native is None\n"
        "y = f(torch.randn(3, 64))[0]\n"
        "assert y.shape == (3, 16)\n"
    )
    env = {**os.environ, "DFLASH_NATIVE": "0", "DFLASH_HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "native int8 kernel" in ln]
    assert lines == ["dflash: native int8 kernel unavailable (switched off: DFLASH_NATIVE=0); using ATen's int8 GEMM"]


@needs_native
def test_amx_switched_off_keeps_the_kernels_off_tiles_with_the_same_int8_results(kernel_settings):
    """``configure(amx=False)`` (the CLI's DFLASH_AMX=0) on a CPU with AMX: no AMX bf16 path is
    offered, the int8 kernel runs AVX-512 VNNI, and int8 results do not change (the same integers)."""
    from runtime.engine.models import linear

    if not kernels.bf16amx_supported():
        pytest.skip("no AMX here (cpuid, the kernel's tile state or the probe tile)")
    enabled, cache, _ = kernels.settings()
    q, s, b = _weights(48, 896, seed=4)
    x = torch.randn(40, 896)
    on = kernels.int8_gemm()(x, q, s, b)
    assert kernels.int8_isa() == "amx"
    kernels.configure(enabled, cache, amx=False)
    assert not kernels.bf16amx_supported() and kernels.bf16amx_gemm() is None
    assert "dflash-amx" not in linear.bf16_candidates()
    assert kernels.int8_isa() == "avx512vnni"
    assert torch.equal(kernels.int8_gemm()(x, q, s, b), on)
    kernels.configure(enabled, cache, amx=True)
    assert kernels.bf16amx_supported() and kernels.int8_isa() == "amx"


def test_dflash_amx_0_reaches_the_kernels_from_the_cli_environment():
    """The CLI reads DFLASH_AMX=0 into the kernel settings (and nothing else changes)."""
    code = (
        "from dflash_cli.common import configure_kernels; configure_kernels()\n"
        "from runtime.engine.models import kernels\n"
        "print(kernels.settings()[0], kernels.settings()[2], kernels.bf16amx_supported(), kernels.int8_isa())\n"
    )
    env = {**os.environ, "DFLASH_AMX": "0"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    native, amx, tiles, isa = r.stdout.split()
    assert (native, amx, tiles) == ("True", "False", "False") and isa != "amx"


def test_no_compiler_falls_back(tmp_path):
    code = (
        "from pathlib import Path; from runtime.engine.models import kernels\n"
        f"kernels.configure(cache=Path({str(tmp_path)!r}))\n"
        "fn = kernels.int8_gemm()\n"
        "print('none' if fn is None else 'built', kernels.why_not())\n"
    )
    env = {**os.environ, "PATH": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    if "x86-64" in r.stdout or "AVX2" in r.stdout:
        pytest.skip(r.stdout)
    assert r.stdout.startswith("none no C compiler"), r.stdout
