"""Loading like the engines do (issue 43, point 4), checked on the CPU: drafters built directly in
their dtype, the GPU placement of a target (one GPU, or layers spread over several), the lean
forward's answer for a split model, and bad --device values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from typer.testing import CliRunner

from dflash_cli.app import app
from runtime.engine.models.drafter_io import load_draft_model, read_safetensors, save_draft_model
from tests.fakes import make_drafter, one_line_error, tiny_target_config

runner = CliRunner()


class Float32Allocations(TorchDispatchMode):
    """Records the size of every float32 tensor an op creates off the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and not t.is_meta:
                self.sizes.append(t.numel())
        return out


@pytest.fixture
def bf16_drafter(tmp_path: Path) -> Path:
    drafter = make_drafter(tiny_target_config(), taps=[1, 2]).to(torch.bfloat16)
    save_draft_model(drafter, tmp_path / "drafter")
    return tmp_path / "drafter"


def test_a_bf16_drafter_is_built_in_bf16_without_a_float32_copy(bf16_drafter: Path):
    smallest_weight = 64 * 16  # the tiny drafter's smallest projection (k_proj: 2 heads x 16 by 64)
    with Float32Allocations() as seen:
        drafter = load_draft_model(bf16_drafter, "cpu", torch.bfloat16)
    assert not [n for n in seen.sizes if n >= smallest_weight], seen.sizes  # only rotary frequencies
    assert {p.dtype for p in drafter.parameters()} == {torch.bfloat16}
    assert not any(p.is_meta for p in drafter.parameters())
    on_disk = read_safetensors(bf16_drafter)
    for name, p in drafter.named_parameters():
        assert torch.equal(p, on_disk[name]), name  # the file's values, bit for bit
    assert all(p.requires_grad for p in drafter.parameters())  # training resumes from such a load


def test_a_drafter_converts_to_the_requested_dtype_as_it_loads(bf16_drafter: Path):
    drafter = load_draft_model(bf16_drafter, "cpu", torch.float32)
    on_disk = read_safetensors(bf16_drafter)
    assert {p.dtype for p in drafter.parameters()} == {torch.float32}
    for name, p in drafter.named_parameters():
        assert torch.equal(p, on_disk[name].float()), name
    h = torch.randn(1, 4, 64)
    ctx = torch.randn(1, 3, 64)
    pos = torch.arange(7)[None]
    assert torch.isfinite(drafter(h, ctx, pos)).all()  # rotary built on the CPU, not on the meta device


def test_a_gpu_that_does_not_exist_exits_2_with_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    r = runner.invoke(app, ["run", "--device", "cuda:7", "--target", str(tmp_path), "hi"])
    one_line_error(r, 2, "cuda:7", "2 GPU(s)", "cuda:0 to cuda:1")


# -- where the target goes -------------------------------------------------------------------------


def test_layers_fill_the_gpus_in_order_up_to_the_headroom():
    from runtime.models.placement import split_layers

    # budgets are 90% of the free bytes: 27 and 90; the first GPU also holds 5 (embedding, head...)
    assert split_layers([10, 10, 10, 10], 5, [30, 100]) == [0, 0, 1, 1]
    assert split_layers([10, 10], 5, [30, 100]) == [0, 0]  # fits the first GPU
    assert split_layers([10] * 5, 5, [30, 30]) is None  # 55 bytes for 54 of budget
    assert split_layers([14, 14, 14], 0, [30, 30]) is None  # 42 bytes fit 54, but a layer never splits
    assert split_layers([1], 28, [30, 100]) is None  # the first GPU cannot even hold the embedding and head


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, free: list[int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(free))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (free[int(i)], 80 * 10**9))


def test_a_target_that_does_not_fit_one_gpu_is_spread_and_its_map_covers_every_weight(
    tiny_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
):
    from transformers import AutoModelForCausalLM

    from runtime.models.configs import read_target_config
    from runtime.models.footprint import DEFAULT_CONTEXT
    from runtime.models.placement import sized_for
    from runtime.pipeline import ResolvedPair, place_target

    target_dir, drafter_dir = tiny_pair
    pair = ResolvedPair(target_dir, drafter_dir, "tiny", "tiny-drafter")
    cuda = torch.device("cuda")
    weights = sized_for(read_target_config(target_dir), torch.bfloat16, DEFAULT_CONTEXT)
    assert weights is not None and len(weights.layer_bytes) == 4
    room = sum(weights.layer_bytes) + weights.other_bytes + 10**6  # drafter and its cache: well below 1 MB more

    _fake_gpus(monkeypatch, [int(room / 0.9) + 1, 10**12])
    assert place_target(pair, cuda, torch.bfloat16, None, None).device_map == "cuda"  # one GPU holds it

    _fake_gpus(monkeypatch, [int(room / 0.9 / 2), 10**12])
    plan = place_target(pair, cuda, torch.bfloat16, None, None)
    assert isinstance(plan.device_map, dict) and plan.gpus == 2 and "2 GPUs" in plan.note
    layers = [plan.device_map[f"model.layers.{i}"] for i in range(4)]
    assert layers[0] == 0 and layers[-1] == 1 and layers == sorted(layers)
    for shared in ("model.embed_tokens", "lm_head", "model.norm"):  # the drafter borrows them on GPU 0
        assert plan.device_map[shared] == 0

    assert place_target(pair, torch.device("cuda:1"), torch.bfloat16, None, None).device_map == "cuda:1"
    staged = place_target(pair, cuda, torch.bfloat16, "int8", None)
    assert staged.device_map is None and staged.quantize_onto == cuda  # float model waits in host RAM

    # transformers accepts the map's keys as they are: every weight is covered (loaded here on the CPU)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), device_map=dict.fromkeys(plan.device_map, "cpu"))
    assert not any(p.is_meta for p in model.parameters())


def test_the_lean_forward_declines_a_split_model_and_transformers_runs_it():
    from runtime.engine.models.lean_target import LeanTarget, lean_supported
    from runtime.errors import ConfigError
    from runtime.pipeline import make_target
    from tests.fakes import make_target as make_tiny

    model = make_tiny()
    assert lean_supported(model) is None
    assert isinstance(make_target(model, "auto"), LeanTarget)
    model.model.layers[3].to("meta")  # stands in for a second GPU
    why = lean_supported(model)
    assert why == "its layers are spread over cpu, meta and the lean forward runs on one device"
    said: list[str] = []
    target = make_target(model, "auto", said.append)
    assert not isinstance(target, LeanTarget)
    assert said == [f"transformers forward for this target ({why})"]
    with pytest.raises(ConfigError, match="--engine lean cannot run this target: its layers are spread over"):
        make_target(model, "lean")


def test_what_quantizing_leaves_behind_moves_one_tensor_at_a_time_with_ties_kept():
    from runtime.models.placement import move_rest
    from tests.fakes import make_target as make_tiny

    model = make_tiny()
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as in Qwen2.5-0.5B
    on_meta = model.model.layers[0].mlp.down_proj.weight.to("meta")  # stands in for a quantized Linear
    model.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(on_meta)
    kept = model.model.layers[0].mlp.down_proj.weight
    move_rest(model, torch.device("meta"))
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still one tensor, not two
    assert model.model.layers[0].mlp.down_proj.weight is kept  # already there: untouched


# -- the doctor's memory figures, by hand for Qwen2.5-Coder-0.5B -----------------------------------
# 24 layers, hidden 896, MLP 4864, 14 heads of 64, 2 KV heads, 151936 tokens, tied embeddings.
# Linear weights per layer: q, o 896x896; k, v 128x896; gate, up 4864x896; down 896x4864
LINEAR = 2 * 896 * 896 + 2 * 128 * 896 + 3 * 896 * 4864  # 14,909,440
ROWS = 896 + 128 + 128 + 896 + 4864 + 4864 + 896  # output rows: one int8 scale each
FLOAT_PARAMS = 151936 * 896 + 24 * (896 + 128 + 128 + 2 * 896) + 896  # embedding(=head), biases, norms
PARAMS = 24 * LINEAR + FLOAT_PARAMS  # 494,032,768: the published 0.49B
KV = 2 * 24 * 2 * 64 * 2 * 4096  # K and V, 24 layers, 2 KV heads of 64, bf16, 4096 tokens
LARGEST = 896 * 4864 * 2  # gate_proj in bf16


@pytest.fixture
def coder_05b(tmp_path: Path) -> Path:
    from transformers import Qwen2Config

    folder = tmp_path / "qwen2.5-coder-0.5b"
    Qwen2Config(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ).save_pretrained(folder)
    return folder


def _estimate(folder: Path, scheme: str | None, device: str = "cpu", context: int = 4096):  # type: ignore[no-untyped-def]
    from runtime.doctor.memory import estimate
    from runtime.models.configs import read_target_config

    cfg = read_target_config(folder)
    return estimate(torch.device(device), torch.bfloat16, cfg, 0, None, 0, scheme, scheme is not None, context)


def test_doctor_counts_bf16_weights_and_the_kv_cache_at_the_context(coder_05b: Path):
    e = _estimate(coder_05b, None)
    assert PARAMS == 494_032_768
    assert e.target.total == e.target.float_total == 2 * PARAMS and e.target.quantized == 0
    assert e.target_kv == KV == 50_331_648
    assert e.load_peak == 2 * PARAMS  # streamed straight onto the device: no second copy
    assert e.need == int((2 * PARAMS + KV) * 1.1)
    assert _estimate(coder_05b, None, context=32768).target_kv == 8 * KV


def test_doctor_counts_quantized_weights_per_scheme_and_the_loading_peak(coder_05b: Path):
    int8 = _estimate(coder_05b, "int8")
    assert int8.target.quantized == 24 * (LINEAR + ROWS * 2)  # one byte a weight + a bf16 scale a row
    assert int8.target.floating == 2 * FLOAT_PARAMS  # embedding (the head too), norms, biases stay bf16
    # on the CPU the whole bf16 model is there before its first Linear is quantized
    assert int8.load_peak == 2 * PARAMS + LARGEST and int8.host_peak == 0
    assert int8.need == int((2 * PARAMS + LARGEST) * 1.1)

    int4 = _estimate(coder_05b, "int4")
    groups = 2 * 896 * 7 + 2 * 128 * 7 + 2 * 4864 * 7 + 896 * 38  # out rows x in/128 groups per Linear
    assert int4.target.quantized == 24 * (LINEAR // 2 + groups * 2 * 2)  # half a byte + bf16 scale, zero

    nf4 = _estimate(coder_05b, "bnb-nf4", device="cuda")
    assert nf4.target.quantized < int8.target.quantized < 2 * 24 * LINEAR
    # onto a GPU: quantized weights + one Linear in bf16 and its temporaries; the bf16 model waits in host RAM
    assert nf4.load_peak == nf4.target.total + 2 * LARGEST and nf4.host_peak == 2 * PARAMS
    assert nf4.need == int(nf4.running * 1.1)  # running (caches included) outweighs the peak


def test_doctor_counts_the_drafter_and_its_cache(coder_05b: Path):
    from runtime.doctor.memory import estimate
    from runtime.engine.models.drafter_config import DraftModelConfig
    from runtime.models.configs import read_target_config
    from tests.fakes import drafter_config_dict

    cfg = read_target_config(coder_05b)
    draft = DraftModelConfig.from_dict(drafter_config_dict(cfg, block_size=16, layers=5))
    e = estimate(torch.device("cpu"), torch.bfloat16, cfg, 0, draft, 1_000_000, None, False, 4096)
    assert e.drafter == 2_000_000
    assert e.drafter_kv == 2 * 5 * 2 * 16 * (4096 + 16) * 2  # 5 layers, 2 KV heads of 16, context + a block
    assert e.running == 2 * PARAMS + 2_000_000 + KV + e.drafter_kv


def test_the_doctor_memory_line(coder_05b: Path, monkeypatch: pytest.MonkeyPatch):
    import json

    from runtime.doctor import memory as doctor_memory

    monkeypatch.setattr(doctor_memory, "device_memory", lambda device: (16 * 10**9, 8 * 10**9))
    args = ["doctor", "--target", str(coder_05b), "--drafter", "none", "--device", "cpu", "--dtype", "bfloat16"]
    r = runner.invoke(app, [*args, "--quantize", "int8", "--context", "8192", "--json"])
    checks = {c["area"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["quantize"]["status"] == "ok"
    assert checks["memory"]["status"] == "ok"
    assert checks["memory"]["message"] == (
        "needs about 1.1 GB: 631 MB target weights (int8: 358 MB quantized + 272 MB float) + 0 MB drafter "
        "+ KV caches at 8192 tokens (101 MB target + 0 MB drafter); loading peaks at 997 MB; cpu has 16.0 GB, 8.0 GB free"
    )
    r = runner.invoke(app, [*args, "--quantize", "int3", "--json"])
    assert r.exit_code == 2
    assert "unknown quantization scheme 'int3'" in {c["area"]: c for c in json.loads(r.stdout)["checks"]}["quantize"]["message"]
