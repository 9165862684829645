"""Shared fixtures. Tests run on the CPU with few threads (2-core machines oversubscribe easily)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
torch.set_num_threads(1)

FIXTURE = Path(__file__).parent / "fixtures" / "zlab-tiny-b8"


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test gets its own DFLASH_HOME and HF cache (never the user's)."""
    home = tmp_path_factory.mktemp("dflash-home")
    monkeypatch.setenv("DFLASH_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hf"))


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    """The reference fixture copied into the repo (target/, drafter/, golden.json)."""
    return FIXTURE


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny qwen3 target with a tokenizer + a matching random drafter, saved to folders."""
    from tests.fakes import save_pair

    return save_pair(tmp_path_factory.mktemp("pair"), block_size=4)
