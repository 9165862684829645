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
