"""bf16 GEMM paths chosen by measurement (issue 45 points 1-2): every path this machine runs computes
a verify row exactly as the row alone; the choice takes the fastest such path and never one whose
rows differ; it is cached beside the calibration and read through a schema; a bf16 target's verify
rows equal its one-token rows and greedy DFlash equals plain greedy in bf16 with the chosen path.

Paths a machine lacks are skipped with the reason: dflash's AVX-512-BF16 kernel needs a CPU with
AVX-512 F/BW/BF16 (and oneDNN's native bf16), its AMX kernel AMX-TILE/AMX-BF16 that Linux grants
this process and that computes a probe tile (run on a 2-core Xeon with AMX, 2026-12-08)."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from runtime.engine.models import bf16_choice, kernels, linear
from runtime.engine.models.kernels import choice
from runtime.engine.models.kernels.choice import Candidate, Timing, cached_choice, pick, read_choices, row_independent
from tests.fakes import greedy_pair, tiny_target_config

PATHS = ("dflash-avx2", "dflash-avx512bf16", "dflash-amx")
_LACKS = {
    "dflash-avx512bf16": "this CPU has no AVX-512-BF16 (cpuid), or the compiler no intrinsics for it",
    "dflash-amx": "no AMX-BF16 here (cpuid), Linux did not grant the tile state, the probe tile failed, or the compiler has no AMX intrinsics",
}


def _path_fn(path: str):
    fn = linear._bf16_kernel(path)
    if fn is None:
        why = kernels.why_not() or _LACKS[path]
        pytest.skip(f"{path} does not run here: {why}")
    return fn


@pytest.fixture(autouse=True)
def _choices_here(tmp_path, monkeypatch):
    """Choices go to this test's folder (never the user's), and no choice leaks between tests."""
    monkeypatch.setattr(choice, "choice_file", lambda: tmp_path / "kernel-choice.json")
    monkeypatch.setattr(linear, "_process", {})


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("k", [896, 4864, 77, 33, 100])
def test_every_row_is_computed_as_if_alone(path, k):
    """1 row alone vs the same row inside 2, 3, 8, 17 rows and a prompt's 33, 70 and 300 (tiles of
    four weight rows, passes of 64; AMX: 16-row tiles, passes of 256): bit-identical, on each path."""
    fn = _path_fn(path)
    g = torch.Generator().manual_seed(k)
    w = (torch.randn(45, k, generator=g) / 10).to(torch.bfloat16)  # 45 = 4 * 11 + 1: a last row alone
    b = torch.randn(45, generator=g)
    x = torch.randn(300, k, generator=g)
    x[3] *= 1e4  # a row of large values beside small ones
    alone = [fn(x[i : i + 1], w, b) for i in range(300)]
    for t in (2, 3, 8, 17, 33, 70, 300):
        block = fn(x[:t], w, b)
        for i in range(t):
            assert torch.equal(block[i : i + 1], alone[i]), (t, i)


@pytest.mark.parametrize("path", PATHS)
def test_threads_do_not_change_results(path):
    fn = _path_fn(path)
    w = torch.randn(200, 896).to(torch.bfloat16)
    x = torch.randn(9, 896)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fn(x, w, None)
        torch.set_num_threads(2)
        two = fn(x, w, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("path", ["dflash-avx512bf16", "dflash-amx"])
@pytest.mark.parametrize(("n", "k"), [(64, 896), (37, 77), (5, 32), (130, 4864), (3, 1), (45, 64)])
def test_bf16_activation_paths_compute_the_product_of_bf16_rounded_rows(path, n, k):
    """vdpbf16ps and tdpbf16ps round the activations to bf16: the result is the (float32-accumulated)
    product of the rounded rows and the bf16 weights, plus the bias (AMX: K a multiple of 32 and N
    >= 16 run on tiles, the last block of 16 weight rows overlapping the one before; other shapes
    run the AVX-512-BF16 kernel)."""
    fn = _path_fn(path)
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g)
    x = torch.randn(9, k, generator=g)
    ref = x.to(torch.bfloat16).double() @ w.double().T + b.double()
    y = fn(x, w, b)
    assert y.dtype == torch.float32 and y.shape == (9, n)
    assert float((y.double() - ref).abs().max() / ref.abs().max()) < 1e-5


# -- the choice ---------------------------------------------------------------------------------


def test_pick_takes_the_fastest_path_whose_rows_match():
    table = {
        "onednn-bf16": Timing(0.010, 0.012, row_independent=False),  # fastest, rows differ
        "dflash-avx512bf16": Timing(0.014, 0.016, row_independent=True),
        "dflash-avx2": Timing(0.013, 0.025, row_independent=True),
    }
    assert pick(table) == "dflash-avx512bf16"  # 0.030 < 0.038; oneDNN's 0.022 never counts
    table["dflash-avx2"] = Timing(0.011, 0.018, True)
    assert pick(table) == "dflash-avx2"
    assert pick({"onednn-bf16": Timing(0.001, 0.001, False)}) is None  # nothing keeps rows exact
    assert pick({}) is None


def _fake_candidates(calls: list[str]):
    """Two fake paths over one weight: "batched" is fast but its rows depend on the row count,
    "exact" is slower and computes each row alone."""
    w = torch.randn(32, 48)

    def batched(x: torch.Tensor) -> torch.Tensor:
        return x @ w.T + 1e-3 * x.shape[0]

    def exact(x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.002)
        return torch.cat([r[None] @ w.T for r in x])

    fns = {"batched": batched, "exact": exact}

    def build(name: str) -> Candidate:
        calls.append(name)
        return Candidate([(fns[name], 48, 2.0)], torch.float32, lambda: row_independent(fns[name], 48, torch.float32))

    return build


def test_a_path_whose_rows_differ_is_never_chosen_and_the_choice_is_cached(tmp_path):
    calls: list[str] = []
    build = _fake_candidates(calls)
    file = tmp_path / "kernel-choice.json"
    got = cached_choice("shapes-a", ["batched", "exact"], build, file)
    assert got.chosen == "exact"
    assert got.timings["batched"].verify_s < got.timings["exact"].verify_s  # it was faster
    assert not got.timings["batched"].row_independent and got.timings["exact"].row_independent
    assert sorted(calls) == ["batched", "exact"]
    stored, problem = read_choices(file)
    assert problem is None and [c.chosen for c in stored.values()] == ["exact"]
    again = cached_choice("shapes-a", ["batched", "exact"], build, file)
    assert again.chosen == "exact" and sorted(calls) == ["batched", "exact"]  # read, not measured
    cached_choice("shapes-b", ["batched", "exact"], build, file)  # other weight shapes: measured
    assert len(calls) == 4 and len(read_choices(file)[0]) == 2


@pytest.mark.parametrize(
    "junk",
    [
        b"not json",
        b"[1, 2]",
        b'{"k": {"chosen": "exact", "timings": {"exact": {"one_token_s": "fast"}}}}',
        # a chosen path whose rows differ (or that was never timed): a tampered file
        b'{"k": {"chosen": "x", "timings": {"x": {"one_token_s": 1.0, "verify_s": 1.0, "row_independent": false}}}}',
        b'{"k": {"chosen": "y", "timings": {}}}',
        b"\xff\xfe",
    ],
)
def test_a_junk_choice_file_is_ignored_with_one_line_and_replaced(tmp_path, capsys, junk):
    file = tmp_path / "kernel-choice.json"
    file.write_bytes(junk)
    calls: list[str] = []
    got = cached_choice("s", ["batched", "exact"], _fake_candidates(calls), file)
    assert got.chosen == "exact" and calls
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and str(file) in err[0] and "measuring the bf16 kernels again" in err[0], err
    assert read_choices(file)[1] is None  # replaced by a good file


def test_a_folder_in_place_of_the_file_is_ignored(tmp_path, capsys):
    file = tmp_path / "kernel-choice.json"
    file.mkdir()
    got = cached_choice("s", ["batched", "exact"], _fake_candidates([]), file)
    assert got.chosen == "exact"
    assert "a folder" in capsys.readouterr().err


# -- a bf16 target ------------------------------------------------------------------------------


def _bf16_target(seed: int = 5):
    """A bf16 target whose MLP is 4,864 wide (the embedded target's: where oneDNN's bf16 verify
    rows differ from its one-token rows)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_target_config("qwen3", vocab_size=96, layers=2)
    cfg.intermediate_size = 4864
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval().to(torch.bfloat16)


def _only(path: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offer only ``path`` (None: every path this machine runs) to the choice."""
    if path is None:
        return
    _path_fn(path)
    monkeypatch.setattr(linear, "bf16_candidates", lambda: [path])


@pytest.mark.parametrize("path", [None, *PATHS], ids=["chosen", *PATHS])
def test_a_bf16_targets_verify_rows_equal_its_one_token_rows(path, monkeypatch):
    """An 8-token verify forward gives, row for row, the logits and tapped features of eight
    one-token forwards from the same cache (the contract greedy DFlash's losslessness rests on)."""
    from runtime.engine.models.lean_target import LeanTarget

    _only(path, monkeypatch)
    lean = LeanTarget(_bf16_target())
    if lean.dtype == torch.bfloat16 and not lean.packed:
        pytest.skip("no bf16 path runs on this CPU")
    lean.set_taps([0, 1])
    prompt = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    block = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        c1, c2 = lean.new_cache(), lean.new_cache()
        lean.forward(prompt, c1, logits_to_keep=1)
        lean.forward(prompt, c2, logits_to_keep=1)
        logits, feats = lean.forward(block, c1)
        for i in range(8):
            one, f1 = lean.forward(block[:, i : i + 1], c2)
            assert torch.equal(logits[i : i + 1], one), i
            assert torch.equal(feats[:, i : i + 1], f1), i


@pytest.mark.parametrize("path", [None, *PATHS], ids=["chosen", *PATHS])
def test_tiny_pair_in_bf16_dflash_equals_plain_greedy(tiny_pair, path, monkeypatch):
    """The tiny pair loaded in bf16 on the CPU: greedy DFlash gives plain greedy's tokens with the
    path chosen by measurement (and with each path this machine runs, forced)."""
    from runtime import LoadOptions, ModelRef, RuntimeConfig, load_pipeline

    _only(path, monkeypatch)
    t, d = tiny_pair
    pipe = load_pipeline(
        ModelRef(target=str(t), drafter=str(d)), RuntimeConfig(device="cpu", dtype="bfloat16"), LoadOptions()
    )
    chosen = linear.current_bf16_path()
    if path is not None:
        assert chosen == path
    stored, _ = read_choices(choice.choice_file())
    if stored:  # a machine where a bf16 path runs: the choice was measured, and keeps rows exact
        (entry,) = stored.values()
        assert entry.chosen == chosen and entry.timings[chosen].row_independent
    rng = random.Random(7)
    for _ in range(3):
        prompt = [rng.randrange(300) for _ in range(rng.randint(2, 9))]
        plain, spec = greedy_pair(pipe.target, pipe.drafter, prompt, 24, block_size=4)
        assert spec == plain


def test_doctor_shows_the_choice_and_the_times(tmp_path, monkeypatch):
    """`dflash doctor` (after --speed, or any bf16 load) shows the chosen path and the measured times."""
    from runtime import LoadOptions, ModelRef, RuntimeConfig
    from runtime.doctor.run import run_doctor
    from runtime.engine.models.kernels.choice import machine_key

    file = tmp_path / "kernel-choice.json"
    runtime = RuntimeConfig(device="cpu", dtype="float32")
    (before,) = [c for c in run_doctor(ModelRef(), runtime, LoadOptions(), kernel_file=file) if c.area == "kernels"]
    assert "not measured" in before.message and "--speed" in before.fix
    entry = {
        "chosen": "dflash-avx512bf16",
        "timings": {
            "dflash-avx512bf16": {"one_token_s": 0.0121, "verify_s": 0.0154, "row_independent": True},
            "onednn-bf16": {"one_token_s": 0.0201, "verify_s": 0.0133, "row_independent": False},
        },
        "shapes": "L24:1152x896,896x896,9728x896,896x4864|head:151936x896",
        "measured_at": time.time(),
    }
    file.write_text(json.dumps({f"{machine_key()}|{entry['shapes']}": entry, "another machine|x": entry}))
    (check,) = [c for c in run_doctor(ModelRef(), runtime, LoadOptions(), kernel_file=file) if c.area == "kernels"]
    assert "dflash-avx512bf16 chosen by measurement" in check.message
    assert "12.10 / 15.40 ms" in check.message and "20.10 / 13.30 ms" in check.message
    assert "verify rows differ" in check.message and "L24:" in check.message


def _library_built_with(tmp_path, define: str):
    """The kernels compiled into ``tmp_path`` with one more ``-D`` (as an older compiler builds them),
    loaded; skipped where they do not build here."""
    import ctypes
    import subprocess

    cc = kernels._compiler()
    if cc is None or kernels._cpu_ok() is not None:
        pytest.skip(f"the native kernels do not build here: {kernels._cpu_ok() or 'no C compiler'}")
    lib_path = tmp_path / "gemm.so"
    cmd = [cc, *kernels.FLAGS, define, *(str(s) for s in kernels.SOURCES), "-o", str(lib_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return ctypes.CDLL(str(lib_path))


def test_the_library_builds_and_runs_without_the_avx512bf16_path(tmp_path):
    """A compiler without AVX-512-BF16 intrinsics (GCC < 10, clang < 9; forced here with
    -DHAVE_BF16DP=0) still builds the kernels: the path reports itself unsupported and its entry
    point computes what dflash's float32-activation kernel computes (never an illegal instruction);
    the AMX entry point, which falls back to it, too."""
    lib = _library_built_with(tmp_path, "-DHAVE_BF16DP=0")
    assert lib.dflash_bf16dp_supported() == 0
    wrap = kernels._wrap_float(torch.bfloat16, returns_rc=True)
    dp, plain = wrap(lib.dflash_bf16dp_gemm), kernels._wrap_float(torch.bfloat16)(lib.dflash_bf16_gemm)
    amx = wrap(lib.dflash_bf16amx_gemm)
    w = torch.randn(37, 77).to(torch.bfloat16)
    x = torch.randn(5, 77)
    assert torch.equal(dp(x, w, None), plain(x, w, None))
    assert torch.equal(amx(x, w, None), plain(x, w, None))


def test_the_library_builds_and_runs_without_the_amx_path(tmp_path):
    """A compiler without AMX intrinsics (GCC < 11, clang < 12; forced here with -DHAVE_AMX=0) still
    builds the kernels: the AMX path reports itself unsupported and its entry point computes what the
    AVX-512-BF16 entry point computes (never an illegal instruction)."""
    lib = _library_built_with(tmp_path, "-DHAVE_AMX=0")
    assert lib.dflash_bf16amx_supported() == 0
    wrap = kernels._wrap_float(torch.bfloat16, returns_rc=True)
    amx, dp = wrap(lib.dflash_bf16amx_gemm), wrap(lib.dflash_bf16dp_gemm)
    w = torch.randn(48, 896).to(torch.bfloat16)
    x = torch.randn(5, 896)
    assert torch.equal(amx(x, w, None), dp(x, w, None))


def test_a_stored_choice_is_read_and_doctor_speed_measures_again(tmp_path):
    """The second load of a bf16 target reads its stored choice; after ``remeasure_bf16`` (what
    `dflash doctor --speed` calls) the paths are timed again."""
    if not linear.bf16_candidates():
        pytest.skip("no bf16 path runs on this CPU")
    from runtime.engine.models.lean_target import _one_layer_forward as one_layer

    model = _bf16_target()
    first = bf16_choice.choose_bf16(model, one_layer)
    assert first is not None and first.chosen == linear.current_bf16_path()
    assert bf16_choice.choose_bf16(model, one_layer).measured_at == first.measured_at  # read, not measured
    bf16_choice.remeasure_bf16()
    again = bf16_choice.choose_bf16(model, one_layer)
    assert again.measured_at > first.measured_at
    (stored,) = read_choices(choice.choice_file())[0].values()
    assert stored.measured_at == again.measured_at
