"""The capturable decode step (the CUDA path, run here on the CPU): bucketed verifies equal the
unpadded ones bit for bit, greedy decoding on it equals plain greedy for chains and trees, its
forwards compile with ``fullgraph=True`` (no graph breaks: no host reads, fixed shapes), its caches
are reused across requests, and the masked grouped-query attention it runs takes a fused kernel."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.config import SamplingParams
from runtime.engine import chain_decoder, tree_decoder
from runtime.engine.models.attention import attention_kernel, grouped_attention
from runtime.engine.models.bucketed_drafter import BucketedDrafter
from runtime.engine.models.bucketed_target import BucketedTarget
from runtime.engine.models.buckets import VerifyBuckets
from runtime.engine.models.lean_target import LeanTarget
from runtime.engine.propose_bucketed import BucketedProposer
from tests.fakes import collect_ids, greedy_reference, make_drafter, make_target

PROMPT = [5, 6, 7, 5, 6, 7, 8, 5, 6]


@pytest.fixture(scope="module")
def model():
    return make_target("qwen3", vocab_size=96, seed=3)


@pytest.fixture(scope="module")
def drafter(model):
    return make_drafter(model.config, block_size=4, taps=[0, 2, 3])


def _verify(target, rows, tree=None, ids=None):
    """Prefill PROMPT, then verify ``rows`` new ids (a chain, or ``tree`` = (positions, mask))."""
    target.set_taps([0, 2, 3])
    cache = target.new_cache(64)
    with torch.inference_mode():
        target.forward(torch.tensor([PROMPT]), cache, logits_to_keep=1)
        ids = ids if ids is not None else torch.arange(10, 10 + rows).unsqueeze(0)
        positions, mask = tree if tree is not None else (None, None)
        return target.forward(ids, cache, positions=positions, tree_mask=mask)


@pytest.mark.parametrize("rows", [3, 5, 17])
def test_padding_rows_do_not_change_the_real_rows_bit_for_bit(model, rows):
    """The padding contract: whatever the padding rows hold (ids, positions), the real rows' logits
    and features are the same bits (they never see the padding); and they equal the unpadded
    verify's to float32 rounding."""
    target = BucketedTarget(model)  # 3 -> 4 rows, 5 -> 8, 17 -> 32
    width = target.buckets.width(rows)
    assert width is not None and width > rows
    target.set_taps([0, 2, 3])
    cache = target.new_cache(64)
    g = torch.Generator().manual_seed(rows)
    with torch.inference_mode():
        target.forward(torch.tensor([PROMPT]), cache, logits_to_keep=1)
        mask = VerifyBuckets.block_mask(rows, None, target._causal, torch.zeros(width, width, dtype=torch.bool))
        real = torch.randint(0, 96, (1, rows), generator=g)
        outs = []
        for pad in (0, 1):
            ids = (
                torch.cat([real, torch.randint(0, 96, (1, width - rows), generator=g)], dim=1)
                if pad
                else (torch.cat([real, torch.zeros(1, width - rows, dtype=torch.long)], dim=1))
            )
            positions = torch.arange(width) + cache.length
            positions[rows:] = torch.randint(0, 40, (width - rows,), generator=g) if pad else positions[rows:]
            args = (ids, positions, mask, cache.length_dev, cache.k, cache.v, target._columns, (0, 2, 3))
            logits, feats = target._bucket_body(*args)
            assert feats is not None
            outs.append((logits[:rows], feats[:, :rows]))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        exact = BucketedTarget(model, VerifyBuckets(range(1, 65)))  # every width its own bucket: no padding
        le, fe = _verify(exact, rows, ids=real)
        lp, fp = _verify(BucketedTarget(model), rows, ids=real)
    # a CPU GEMM of 3 rows rounds differently from one of 4 (MKL's small-row kernels, measured): close, not equal
    torch.testing.assert_close(lp, le, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fp, fe, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lp, outs[0][0], rtol=0, atol=0)
    ll, fl = _verify(LeanTarget(model, pack=False), rows, ids=real)  # the eager forward over [0, end) only
    torch.testing.assert_close(lp, ll, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fp, fl, rtol=1e-4, atol=1e-4)


def test_a_padded_tree_verify_equals_the_unpadded_one(model):
    parents = [-1, 0, 0, 1, 1]  # anchor, two children, two grandchildren under the first
    depth = [0, 1, 1, 2, 2]
    mask = torch.zeros(5, 5, dtype=torch.bool)
    for i in range(5):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    tree = (torch.tensor([len(PROMPT) + d for d in depth]), mask)
    lp, fp = _verify(BucketedTarget(model), 5, tree=tree)
    le, fe = _verify(BucketedTarget(model, VerifyBuckets(range(1, 65))), 5, tree=tree)
    torch.testing.assert_close(lp, le, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fp, fe, rtol=1e-4, atol=1e-4)
    ll, fl = _verify(LeanTarget(model, pack=False), 5, tree=tree)
    torch.testing.assert_close(lp, ll, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["chain", "tree", "tree+lookup"])
def test_greedy_decoding_on_the_bucketed_step_equals_plain_greedy(model, drafter, kind):
    target = BucketedTarget(model)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    if kind == "chain":
        decoder = chain_decoder(target, drafter, block_size=4)
    else:
        decoder = tree_decoder(target, drafter, block_size=4, tree_budget=6, lookup=8 if "lookup" in kind else 0)
    assert isinstance(decoder.proposer, BucketedProposer)
    assert collect_ids(list(decoder.stream(PROMPT, params))) == greedy_reference(model, PROMPT, 24)


def test_caches_are_allocated_once_and_reused_by_the_next_request(model, drafter):
    target = BucketedTarget(model)
    step = BucketedDrafter(drafter)
    seen: list[tuple[int, int]] = []
    real_new_cache = target.new_cache

    def new_cache(capacity=512):
        cache = real_new_cache(capacity)
        seen.append((cache.k[0].data_ptr(), cache.length_dev.data_ptr()))
        return cache

    target.new_cache = new_cache  # type: ignore[method-assign]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    drafted: list[int] = []
    for prompt in (PROMPT, [9, 8, 7, 6]):
        decoder = chain_decoder(target, drafter, block_size=4, proposer=BucketedProposer(target, drafter, 4, step))
        collect_ids(list(decoder.stream(prompt, params)))
        drafted.append(step.pool.free[0][1].k[0].data_ptr())
    assert len(seen) == 2 and seen[0] == seen[1]  # the second request got the first one's buffers
    assert target.pool.allocated == 1 and step.pool.allocated == 1
    assert drafted[0] == drafted[1]


HOST_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}


def _checked_backend(gm, example_inputs):
    """A torch.compile backend that fails on a host read inside the captured graph (dynamo keeps
    ``.item()`` in the graph instead of breaking it) and runs the graph as traced."""
    for node in gm.graph.nodes:
        bad = (node.op == "call_method" and node.target in HOST_READS) or "local_scalar_dense" in str(node.target)
        assert not bad, f"host read in the captured step: {node.format_node()}"
    return gm.forward


def _compiles_whole(fn, *args):
    """``fn(*args)`` through ``torch.compile(fullgraph=True)`` (dynamo's capture: a graph break
    raises; the backend fails on a host read); returns the compiled result."""
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=_checked_backend)(*args)


def _no_graph_breaks(fn, *args):
    """As ``_compiles_whole``, and the compiled result equals the eager one."""
    out = _compiles_whole(fn, *args)
    ref = fn(*args)
    for a, b in zip(out, ref, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_the_bucketed_verify_and_drafter_forwards_compile_without_graph_breaks(model, drafter):
    target = BucketedTarget(model)
    target.set_taps([0, 2, 3])
    cache = target.new_cache(32)
    with torch.inference_mode():
        _, feats = target.forward(torch.tensor([PROMPT]), cache, logits_to_keep=1)
        assert feats is not None
        ids = torch.zeros((1, 4), dtype=torch.long)
        positions = torch.arange(4) + cache.length
        mask = VerifyBuckets.block_mask(3, None, target._causal, torch.zeros(4, 4, dtype=torch.bool))
        args = (ids, positions, mask, cache.length_dev, cache.k, cache.v, target._columns, (0, 2, 3))
        _no_graph_breaks(target._bucket_body, *args)
        step = BucketedDrafter(drafter)
        d_cache = step.new_cache(32)
        rows = torch.zeros((1, 16, feats.shape[2]))
        rows[:, : feats.shape[1]] = feats
        ctx_args = (rows, d_cache.length_dev, d_cache.k, d_cache.v, step._cos, step._sin)
        _compiles_whole(step._context_body, *ctx_args)
        d_cache.length_dev.fill_(len(PROMPT))
        embeds = target.embed(torch.tensor([[7, 95, 95, 95]]))
        _no_graph_breaks(
            step._block_body, embeds, d_cache.length_dev, d_cache.k, d_cache.v, step._cos, step._sin, step._columns
        )


def test_a_failed_compilation_runs_eagerly_with_one_line(model, drafter, capsys, monkeypatch):
    import runtime.engine.models.compiled_step as compiled_step

    monkeypatch.setattr(compiled_step, "_said", [False])
    target = BucketedTarget(model)

    def broken(fn, **kw):
        def run(*a, **k):
            raise RuntimeError("inductor: no C++ compiler\nlong traceback")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    target.compile("reduce-overhead")
    step = BucketedDrafter(drafter)
    step.compile("default")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    decoder = chain_decoder(target, drafter, block_size=4, proposer=BucketedProposer(target, drafter, 4, step))
    assert collect_ids(list(decoder.stream(PROMPT, params))) == greedy_reference(model, PROMPT, 12)
    err = capsys.readouterr().err.splitlines()
    assert err == ["dflash: torch.compile failed (RuntimeError: inductor: no C++ compiler); running eagerly"]
    assert target.verify_step.compiled is None and step.block_step.compiled is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_grouped_attention_takes_a_fused_kernel_and_equals_repeated_kv(dtype):
    cpu = torch.device("cpu")
    assert attention_kernel(cpu, dtype, masked=True, gqa=True) == "flash"
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 5, 16, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, 12, 16, generator=g).to(dtype) for _ in range(2))
    mask = torch.rand(5, 12, generator=g) > 0.3
    mask[:, 0] = True
    out = grouped_attention(q, k, v, mask, 0.25)
    rep = torch.nn.functional.scaled_dot_product_attention(
        q[None].float(),
        k.repeat_interleave(2, 1).float(),
        v.repeat_interleave(2, 1).float(),
        attn_mask=mask,
        scale=0.25,
    )[0]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), rep, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_the_folded_layout_avoids_the_math_kernel(dtype):
    cuda = torch.device("cuda")
    assert attention_kernel(cuda, dtype, masked=True, gqa=True, folded=False) == "math"  # why it folds
    assert attention_kernel(cuda, dtype, masked=True, gqa=True) == "efficient"


def test_the_cli_runs_the_bucketed_step_and_refuses_an_unknown_compile_mode(fixture_dir):
    from typer.testing import CliRunner

    from dflash_cli.app import app

    pair = ["--target", str(fixture_dir / "target"), "--drafter", str(fixture_dir / "drafter")]
    common = ["run", *pair, "--prompt-ids", "1,2,3,4,5", "-n", "16", "--dtype", "float32", "--json"]
    runner = CliRunner()
    outs = {}
    for engine in ("lean", "bucketed"):
        r = runner.invoke(app, [*common, "--engine", engine])
        assert r.exit_code == 0, r.output
        events = [json.loads(line) for line in r.stdout.splitlines()]
        outs[engine] = [t["id"] for e in events for t in e.get("tokens", [])]
    assert len(outs["lean"]) == 16 and outs["bucketed"] == outs["lean"]
    bad = runner.invoke(app, [*common, "--compile", "fast"])
    assert bad.exit_code == 2
    assert (
        bad.stderr.strip()
        == "dflash: error: unknown compile setting 'fast'; use auto, off, on, default, reduce-overhead"
    )


def test_the_calibration_key_names_the_bucketed_engine_and_its_compiled_step(model):
    """Verify costs are measured per engine: the bucketed step's are its own (not the lean or
    transformers forward's), and its compiled step's are labelled "+compiled", apart from eager."""
    from runtime.engine.calibrate import cache_key
    from runtime.engine.models.target import TargetModel

    class Pipe:
        drafter = None
        block_size = 1

        def __init__(self, target):
            self.target = target

        def describe(self):
            return {"target": "t", "device": "cpu", "dtype": "float32", "quantization": None}

    eager, compiled = BucketedTarget(model), BucketedTarget(model)
    compiled.compile()
    keys = [cache_key(Pipe(t)) for t in (eager, compiled, LeanTarget(model), TargetModel(model))]
    engines = [k.split("|")[2] for k in keys]
    assert engines[1] == engines[0] + "+compiled" and "compiled" not in engines[0], engines
    assert len(set(engines)) == 4, engines


@pytest.mark.parametrize("command", ["bench", "chat", "serve"])
def test_bench_chat_and_serve_take_compile_and_refuse_an_unknown_mode(fixture_dir, command):
    """``--compile`` on bench, chat and serve as on run (not only DFLASH_COMPILE): a bad value exits 2
    with one line, before any model loads."""
    from typer.testing import CliRunner

    from dflash_cli.app import app

    pair = ["--target", str(fixture_dir / "target"), "--drafter", str(fixture_dir / "drafter")]
    bad = CliRunner().invoke(app, [command, *pair, "--compile", "fast"])
    assert bad.exit_code == 2, bad.output
    assert bad.stdout == ""
    assert (
        bad.stderr.strip()
        == "dflash: error: unknown compile setting 'fast'; use auto, off, on, default, reduce-overhead"
    )
