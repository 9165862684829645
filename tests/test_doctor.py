"""`dflash doctor`: device, dtype, memory, files and pair compatibility, with fixes and exit codes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dflash_cli.app import app
from runtime.models import embedded
from tests.hubfakes import FIXTURE, build_cached_repo, fixture_files

runner = CliRunner()
CPU = ["--device", "cpu", "--dtype", "float32"]


def doctor(*args: str) -> tuple[int, dict[str, dict]]:
    r = runner.invoke(app, ["doctor", *args, "--json"])
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == r.exit_code
    return r.exit_code, {c["area"]: c for c in doc["checks"]}


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    """Copies of the reference fixture's target and drafter folders (safe to edit)."""
    t, d = tmp_path / "target", tmp_path / "drafter"
    shutil.copytree(FIXTURE / "target", t)
    shutil.copytree(FIXTURE / "drafter", d)
    return t, d


def edit_json(path: Path, **changes: object) -> None:
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if key == "dflash_config":
            cfg[key].update(value)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def test_matching_pair_is_ready(pair):
    t, d = pair
    code, checks = doctor("--target", str(t), "--drafter", str(d), *CPU)
    assert code == 0
    for area in ("device", "dtype", "target", "drafter", "vocab", "hidden size", "layer ids", "mask id", "memory"):
        assert checks[area]["status"] == "ok", checks[area]
    assert "[1, 3, 5] of 8" in checks["layer ids"]["message"]
    assert checks["dtype"]["message"].startswith("float32")
    assert checks["tokenizer"]["status"] == "warn"  # the fixture has no tokenizer: only --prompt-ids works

    r = runner.invoke(app, ["doctor", "--target", str(t), "--drafter", str(d), *CPU])
    assert r.exit_code == 0
    assert any(line.startswith("✓ vocab") for line in r.stdout.splitlines())
    assert "ready to run" in r.stderr


def test_incompatible_pair_names_every_mismatch_and_its_fix(pair):
    t, d = pair
    edit_json(
        d / "config.json",
        hidden_size=32,
        vocab_size=30,
        dflash_config={"target_layer_ids": [1, 9], "mask_token_id": 40},
    )
    code, checks = doctor("--target", str(t), "--drafter", str(d), *CPU)
    assert code == 5
    assert "drafter hidden size 32 != target hidden size 64" in checks["hidden size"]["message"]
    assert "drafter vocab 30 != target vocab 24" in checks["vocab"]["message"]
    assert "[9]" in checks["layer ids"]["message"] and "8 layers" in checks["layer ids"]["message"]
    assert "mask id 40" in checks["mask id"]["message"]
    for area in ("vocab", "hidden size", "layer ids", "mask id"):
        assert checks[area]["status"] == "fail" and "dflash train" in checks[area]["fix"]

    r = runner.invoke(app, ["doctor", "--target", str(t), "--drafter", str(d), *CPU])
    assert r.exit_code == 5
    assert r.stdout.count("fix: use the drafter trained for this target") == 4
    assert "4 problems to fix" in r.stderr


def test_models_missing_from_the_cache_say_how_to_get_them(pair):
    _t, d = pair
    code, checks = doctor("--target", "org/not-downloaded", "--drafter", str(d), *CPU)
    assert code == 3
    assert (
        checks["target"]["status"] == "fail" and checks["target"]["fix"] == "run `dflash download org/not-downloaded`"
    )
    assert checks["drafter"]["status"] == "ok"


def test_truncated_weights_in_the_cache_exit_4():
    t = fixture_files("target")
    t["model.safetensors"] = t["model.safetensors"][:5000]
    build_cached_repo(Path(os.environ["HF_HUB_CACHE"]), "org/cut-target", t)
    code, checks = doctor("--target", "org/cut-target", "--drafter", "none", *CPU)
    assert code == 4
    assert "truncated" in checks["target"]["message"] and "dflash download org/cut-target" in checks["target"]["fix"]
    assert checks["drafter"]["status"] == "warn"  # no drafter: plain decoding only


THINKING_SWITCH = "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>{% endif %}"


@pytest.mark.parametrize(
    ("template", "area", "status"),
    [
        (THINKING_SWITCH, "thinking mode", "ok"),
        ("{{ messages[0]['content'] }}<think>\n", "thinking mode", "warn"),
        ("{{ messages[0]['content'] }}", "thinking mode", "ok"),
        (None, "chat template", "warn"),
    ],
)
def test_chat_template_and_thinking_mode(pair, template, area, status):
    t, d = pair
    tok_cfg: dict[str, object] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None:
        tok_cfg["chat_template"] = template
    (t / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    code, checks = doctor("--target", str(t), "--drafter", str(d), *CPU)
    assert checks["tokenizer"]["status"] == "ok"
    assert checks[area]["status"] == status, checks[area]
    if status == "warn":
        assert checks[area]["fix"]
    assert code == 0  # warnings do not fail


def test_without_a_model_it_checks_the_embedded_pair(pair, monkeypatch):
    t, d = pair
    models = Path(os.environ["DFLASH_HOME"]) / "models"
    shutil.copytree(t, models / embedded.TARGET_DIRNAME)
    (models / embedded.TARGET_DIRNAME / "dflash-embedded.json").write_text("{}")  # marks a finished conversion
    monkeypatch.setattr(embedded, "DRAFTER_DIR", d)
    code, checks = doctor(*CPU)
    assert code == 0, checks
    assert embedded.TARGET_NAME in checks["target"]["message"]
    assert checks["vocab"]["status"] == "ok" and checks["layer ids"]["status"] == "ok"


def test_memory_shortage_fails_with_the_oom_exit_code(pair, monkeypatch):
    from runtime.doctor import memory as doctor_memory

    t, d = pair
    monkeypatch.setattr(doctor_memory, "device_memory", lambda device: (2_000_000, 1_000_000))
    code, checks = doctor("--target", str(t), "--drafter", str(d), *CPU)
    assert code == 6
    assert checks["memory"]["status"] == "fail" and "--quantize" in checks["memory"]["fix"]

    monkeypatch.setattr(doctor_memory, "device_memory", lambda device: (10**12, 1_000_000))
    code, checks = doctor("--target", str(t), "--drafter", str(d), *CPU)
    assert code == 0 and checks["memory"]["status"] == "warn"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_unavailable_device_and_bad_dtype_exit_2(pair):
    t, d = pair
    code, checks = doctor("--target", str(t), "--drafter", str(d), "--device", "cuda")
    assert code == 2
    assert "CUDA is not available" in checks["device"]["message"] and "--device cpu" in checks["device"]["fix"]

    code, checks = doctor("--target", str(t), "--drafter", str(d), "--device", "cpu", "--dtype", "float16")
    assert code == 2 and checks["dtype"]["status"] == "fail" and "float32" in checks["dtype"]["fix"]
