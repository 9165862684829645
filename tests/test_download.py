"""`dflash download` against a local Hub stand-in (tests/hubfakes.FakeHub on 127.0.0.1).

The stand-in answers the endpoints huggingface_hub's ``snapshot_download`` uses, so these tests
run the real download code: which files are fetched, the pair check before the weights, errors,
and resuming after a dropped connection or a failed run.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_cli.app import app
from tests.hubfakes import FakeHub, build_cached_repo, fixture_files

runner = CliRunner()
TARGET, DRAFTER = "Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16"  # the qwen3-4b preset's ids
ROOT = Path(__file__).parent.parent


def cache() -> Path:
    return Path(os.environ["HF_HUB_CACHE"])


def folders(stdout: str) -> dict[str, Path]:
    """``target<TAB>folder`` / ``drafter<TAB>folder`` lines of stdout."""
    return {k: Path(v) for k, v in (line.split("\t") for line in stdout.splitlines())}


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch):
    """A running FakeHub with the network allowed (the test session defaults to offline)."""
    import huggingface_hub.constants as hf_constants

    fake = FakeHub()
    with fake.serve():
        monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)  # read once at import by huggingface_hub
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        for var in ("NO_PROXY", "no_proxy"):  # a proxy configured on the machine must not see 127.0.0.1
            monkeypatch.setenv(var, "127.0.0.1,localhost")
        yield fake


def with_extras(files: dict[str, bytes]) -> dict[str, bytes]:
    """A repo as published: weights in safetensors and as a pickle, plus a README."""
    return {**files, "pytorch_model.bin": b"\x80\x04pickle", "README.md": b"# model card\n"}


def test_preset_pair_downloads_safetensors_only_and_is_listed(hub):
    hub.add(TARGET, with_extras(fixture_files("target")))
    hub.add(DRAFTER, with_extras(fixture_files("drafter")))
    r = runner.invoke(app, ["download", "qwen3-4b"])
    assert r.exit_code == 0, r.output
    got = folders(r.stdout)
    assert set(got) == {"target", "drafter"}
    for which, folder in got.items():
        names = {p.name for p in folder.iterdir()}
        assert {"config.json", "model.safetensors", "README.md"} <= names
        assert "pytorch_model.bin" not in names
        assert (folder / "model.safetensors").read_bytes() == fixture_files(which)["model.safetensors"]
    assert hub.fetched(".bin") == []  # pickle weights are never requested
    assert "pair checked" in r.stderr and "vocab 24" in r.stderr
    assert "dflash chat --model qwen3-4b" in r.stderr

    pairs = json.loads(runner.invoke(app, ["models", "--json"]).stdout)["pairs"]
    assert [(p["name"], p["target"], p["drafter"], p["ok"]) for p in pairs] == [("qwen3-4b", TARGET, DRAFTER, True)]

    # a second download finds everything in the cache and fetches no file again
    before = len(hub.fetched(""))
    r = runner.invoke(app, ["download", "qwen3-4b"])
    assert r.exit_code == 0, r.output
    assert folders(r.stdout) == got and len(hub.fetched("")) == before


def test_incompatible_pair_fails_before_any_weights(hub):
    d = fixture_files("drafter")
    cfg = json.loads(d["config.json"])
    cfg["hidden_size"] = 32
    d["config.json"] = json.dumps(cfg).encode()
    hub.add("org/target", fixture_files("target"))
    hub.add("org/other-drafter", d)
    r = runner.invoke(app, ["download", "org/target", "--drafter", "org/other-drafter"])
    assert r.exit_code == 5
    assert "hidden size 32 != target hidden size 64" in r.stderr
    assert hub.fetched(".safetensors") == []
    assert r.stdout == ""


def test_unknown_and_gated_repos_exit_3(hub):
    r = runner.invoke(app, ["download", "org/does-not-exist"])
    assert r.exit_code == 3
    assert "does not exist on the Hugging Face Hub" in r.stderr

    hub.add("org/gated", fixture_files("target"), gated=True)
    r = runner.invoke(app, ["download", "org/gated"])
    assert r.exit_code == 3
    assert "gated" in r.stderr and "HF_TOKEN" in r.stderr


def test_a_drafter_named_as_the_target_is_explained(hub):
    hub.add("org/some-dflash-drafter", fixture_files("drafter"))
    r = runner.invoke(app, ["download", "org/some-dflash-drafter"])
    assert r.exit_code == 2
    assert "is a DFlash drafter, not a target" in r.stderr and "--drafter org/some-dflash-drafter" in r.stderr


def test_failed_download_resumes_on_the_next_run_without_refetching(hub):
    hub.add("org/target", fixture_files("target"))
    hub.add("org/drafter", fixture_files("drafter"))
    hub.fail.add("org/drafter/model.safetensors")  # the server errors on the drafter's weights
    args = ["download", "org/target", "--drafter", "org/drafter"]
    r = runner.invoke(app, args)
    assert r.exit_code == 3
    assert "run the same command again to resume" in r.stderr

    # what is on disk is known to be partial: offline use says so and names the fix
    state = {m["name"]: m for m in json.loads(runner.invoke(app, ["models", "--json"]).stdout)["models"]}
    assert state["org/target"]["ok"]
    assert state["org/drafter"]["problems"] == ["model.safetensors is missing"]
    run = ["run", "--target", "org/target", "--drafter", "org/drafter", "--offline", "--prompt-ids", "1,2"]
    r = runner.invoke(app, run)
    assert r.exit_code == 3 and "only partly downloaded" in r.stderr and "dflash download org/drafter" in r.stderr

    hub.fail.clear()
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert len(hub.gets("org/target", "model.safetensors")) == 1  # fetched once, kept
    assert len(hub.gets("org/drafter", "model.safetensors")) == 2
    d = folders(r.stdout)["drafter"]
    assert (d / "model.safetensors").read_bytes() == fixture_files("drafter")["model.safetensors"]


def big_safetensors(n_bytes: int) -> bytes:
    """A valid safetensors file holding one uint8 tensor of ``n_bytes`` (deterministic content)."""
    header = json.dumps({"pad": {"dtype": "U8", "shape": [n_bytes], "data_offsets": [0, n_bytes]}}).encode()
    body = hashlib.sha256(b"seed").digest() * (n_bytes // 32 + 1)
    return struct.pack("<Q", len(header)) + header + body[:n_bytes]


def test_dropped_connection_resumes_from_the_byte_it_reached(tmp_path):
    """End to end in a real process: HF_ENDPOINT, no offline flag, the connection cut mid-file.

    huggingface_hub writes a download in 10 MiB chunks and, when the connection drops, asks for
    the rest with ``Range: bytes=<written>-``; the file must come out whole.
    """
    weights = big_safetensors(11_000_000)
    fake = FakeHub()
    fake.add("org/big", {"config.json": fixture_files("target")["config.json"], "model.safetensors": weights})
    fake.cut_once["org/big/model.safetensors"] = 10_600_000
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PYTEST"))}
    env.update(
        HF_HUB_CACHE=str(tmp_path / "hf"),
        DFLASH_HOME=str(tmp_path / "home"),
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        OMP_NUM_THREADS="1",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    with fake.serve():
        env["HF_ENDPOINT"] = fake.url
        out = subprocess.run(
            [sys.executable, "-m", "dflash_cli", "download", "org/big", "--drafter", "none"],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=120,
        )
    assert out.returncode == 0, out.stderr
    assert fake.gets("org/big", "model.safetensors") == [None, f"bytes={10 * 1024 * 1024}-"]
    assert "resume" in out.stderr.lower()
    folder = folders(out.stdout)["target"]
    assert hashlib.sha256((folder / "model.safetensors").read_bytes()).digest() == hashlib.sha256(weights).digest()


def test_offline_download_checks_the_cached_pair():
    build_cached_repo(cache(), "org/target", fixture_files("target"))
    build_cached_repo(cache(), "org/drafter", fixture_files("drafter"))
    r = runner.invoke(app, ["download", "org/target", "--drafter", "org/drafter", "--offline"])
    assert r.exit_code == 0, r.output
    assert set(folders(r.stdout)) == {"target", "drafter"}

    r = runner.invoke(app, ["download", "org/not-cached", "--offline"])
    assert r.exit_code == 3 and "offline" in r.stderr

    d = fixture_files("drafter")
    d["model.safetensors"] = d["model.safetensors"][:1000]
    build_cached_repo(cache(), "org/cut", d)
    r = runner.invoke(app, ["download", "org/target", "--drafter", "org/cut", "--offline"])
    assert r.exit_code == 4
    assert "truncated" in r.stderr and r.stdout == ""


def test_what_a_name_downloads():
    from runtime.models.download import PairRequest, plan_download

    assert plan_download("qwen3-4b") == PairRequest(TARGET, DRAFTER, "qwen3-4b")
    assert plan_download(DRAFTER) == PairRequest(TARGET, DRAFTER, "qwen3-4b")  # a preset's drafter brings its target
    assert plan_download(TARGET, "none") == PairRequest(TARGET, None, "qwen3-4b")
    assert plan_download("org/any", "org/its-drafter") == PairRequest("org/any", "org/its-drafter")
    assert plan_download("org/any") == PairRequest("org/any", None)  # no drafter known: the target alone
    assert plan_download(None).target == "embedded"
    r = runner.invoke(app, ["download", "not a repo id"])
    assert r.exit_code == 3 and "neither a preset" in r.stderr
