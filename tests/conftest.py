"""Shared fixtures. Tests run on the CPU with few threads (2-core machines oversubscribe easily)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
torch.set_num_threads(1)

FIXTURE = Path(__file__).parent / "fixtures" / "zlab-tiny-b8"


@pytest.fixture(autouse=True)
def _one_thread() -> object:
    """Every test starts on one thread, whatever the test before it set (an in-process `--threads 2`
    run changes torch's global count): results that depend on the reduction order then do not
    depend on the order the tests ran in."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _isolated_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The whole test process keeps out of the user's dflash folders, not only each test: module-
    and session-scoped fixtures (which run before a test's own DFLASH_HOME is set) and threads that
    outlive a test get a DFLASH_HOME and HF cache of the process, and the native kernels are compiled
    once per process into a folder of its own with the kernel choices measured on tiny models beside
    them (the runtime API defaults to ~/.cache/dflash and reads no DFLASH_HOME)."""
    from runtime.engine.models import kernels

    home = tmp_path_factory.mktemp("session-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_HOME", str(home))
        mp.setenv("HF_HUB_CACHE", str(home / "hf"))
        kernels.configure(cache=tmp_path_factory.mktemp("kernels") / "kernels")
        yield
        kernels.configure()


@pytest.fixture
def kernel_settings() -> Iterator[None]:
    """Restore the process-wide kernel settings (and forget the loaded library) after the test."""
    from runtime.engine.models import kernels

    enabled, cache, amx = kernels.settings()
    yield
    kernels.configure(enabled, cache, amx)


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


@pytest.fixture
def pair_copy(tiny_pair: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    """A private copy of ``tiny_pair`` in this test's folder, for a test that changes its files."""
    import shutil

    t, d = tiny_pair
    return shutil.copytree(t, tmp_path / "pair" / "target"), shutil.copytree(d, tmp_path / "pair" / "drafter")


@pytest.fixture(scope="session")
def fim_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny pair with Qwen's fill-in-the-middle tokens in its tokenizer (``save_pair(fim="qwen")``)."""
    from tests.fakes import save_pair

    return save_pair(tmp_path_factory.mktemp("fimpair"), block_size=4, fim="qwen")


@pytest.fixture(scope="session")
def answers_data(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A generated training dataset of ``tiny_pair``'s target answers (taps 1-3, 16 prompts of 12
    tokens): (target_dir, data_dir). Read it only; a test that changes it copies it first."""
    from runtime import ModelRef, RuntimeConfig, load_pipeline
    from runtime.train.api import DataSpec, prepare_data

    target_dir = tiny_pair[0]
    pipe = load_pipeline(ModelRef(target=str(target_dir), drafter="none"), RuntimeConfig(dtype="float32"))
    data = tmp_path_factory.mktemp("answers-data") / "v2"
    spec = DataSpec(num_prompts=16, max_new_tokens=12, batch_size=8)
    prepare_data(pipe.target, pipe.tokenizer, data, [1, 2, 3], spec, pipe.stop_token_ids)
    return target_dir, data


@pytest.fixture(scope="session")
def pair_data(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """``tiny_pair`` and a dataset of its target's answers (taps 1, 2; 12 prompts of 32 tokens), as
    ``fakes.pair_with_data`` builds them: (target_dir, drafter_dir, data_dir). Read them only."""
    from runtime import ModelRef, RuntimeConfig, load_pipeline
    from runtime.train.api import DataSpec, prepare_data

    target_dir, drafter_dir = tiny_pair
    pipe = load_pipeline(ModelRef(target=str(target_dir), drafter="none"), RuntimeConfig(dtype="float32"))
    data = tmp_path_factory.mktemp("pair-data") / "data"
    spec = DataSpec(num_prompts=12, max_new_tokens=32, batch_size=4)
    prepare_data(pipe.target, pipe.tokenizer, data, [1, 2], spec, pipe.stop_token_ids)
    return target_dir, drafter_dir, data


class ServePool:
    """`dflash serve` subprocesses shared by the test session, started on first use (several at once
    in parallel) and stopped with Ctrl-C at its end."""

    def __init__(self, specs: dict[str, list[str]], home: pytest.TempPathFactory) -> None:
        self.specs, self.home = specs, home
        self.procs: dict = {}

    def get(self, *names: str) -> list:
        """The servers called ``names``, ready (those not running yet start together)."""
        from tests.http_helpers import ServeProcess

        for name in names:
            if name not in self.procs:
                self.procs[name] = ServeProcess(self.specs[name], self.home.mktemp("srv"), wait=False)
        return [self.procs[name].wait_ready() for name in names]

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.interrupt()
        codes = [proc.stop() for proc in self.procs.values()]
        logs = "".join(line for proc in self.procs.values() for line in proc.lines[-20:])
        assert all(c == 0 for c in codes), logs  # Ctrl-C shuts them down cleanly


@pytest.fixture(scope="session")
def serve_pool(tiny_pair: tuple[Path, Path], fixture_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Real `dflash serve` processes on loopback ports: "tiny" (the tiny pair, with a tokenizer) and
    "fixture" (the reference fixture: token ids, a drafter whose drafts get accepted)."""
    t, d = tiny_pair
    common = ["--dtype", "float32", "--device", "cpu", "--log-level", "warning"]
    pool = ServePool(
        {
            # the tiny pair's drafter is random: with the confidence cut, whether a step drafts at all
            # would depend on the verify costs measured on a busy machine; its serving tests count drafts
            "tiny": [
                "--target",
                str(t),
                "--drafter",
                str(d),
                "--max-tokens-limit",
                "64",
                "--no-confidence-cut",
                *common,
            ],
            "fixture": ["--target", str(fixture_dir / "target"), "--drafter", str(fixture_dir / "drafter"), *common],
        },
        tmp_path_factory,
    )
    try:
        yield pool
    finally:
        pool.stop()


@pytest.fixture(scope="session")
def server(serve_pool: ServePool):
    """`dflash serve` of the tiny pair (``.url`` is its root)."""
    return serve_pool.get("tiny")[0]


@pytest.fixture(scope="session")
def fixture_server(serve_pool: ServePool):
    """`dflash serve` of the reference fixture."""
    return serve_pool.get("fixture")[0]
