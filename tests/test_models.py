"""`dflash models` and `dflash models rm` against a hand-built offline Hub cache (no network)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_cli.app import app
from dflash_cli.commands.models import human_size
from runtime.models import presets
from tests.hubfakes import build_cached_repo, fixture_files

runner = CliRunner()
TARGET, DRAFTER = "Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16"  # the qwen3-4b preset's ids


def cache() -> Path:
    return Path(os.environ["HF_HUB_CACHE"])


def models_json() -> dict:
    r = runner.invoke(app, ["models", "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def repo_dir(repo_id: str) -> Path:
    return cache() / ("models--" + repo_id.replace("/", "--"))


@pytest.fixture
def preset_pair() -> tuple[dict, dict]:
    """The qwen3-4b preset's two repos, cached with the tiny fixture's files."""
    t, d = fixture_files("target"), fixture_files("drafter")
    build_cached_repo(cache(), TARGET, t)
    build_cached_repo(cache(), DRAFTER, d)
    return t, d


def test_empty_cache_says_how_to_get_a_pair():
    r = runner.invoke(app, ["models"])
    assert r.exit_code == 0
    assert r.stdout == ""
    assert "no models on disk" in r.stderr and "dflash download" in r.stderr


def test_lists_pairs_and_models_with_disk_size_and_last_use(preset_pair):
    t_files, d_files = preset_pair
    doc = models_json()
    by_name = {m["name"]: m for m in doc["models"]}
    assert by_name[TARGET]["kind"] == "target" and by_name[DRAFTER]["kind"] == "drafter"
    for name, files in ((TARGET, t_files), (DRAFTER, d_files)):
        blobs = sum(len(b) for b in files.values())
        # disk use: every blob once (snapshot links are not counted again), plus the small refs file
        assert blobs <= by_name[name]["size_bytes"] < blobs + 4096
        assert by_name[name]["ok"] and by_name[name]["last_used"] is not None
    (pair,) = doc["pairs"]
    assert (pair["name"], pair["target"], pair["drafter"]) == ("qwen3-4b", TARGET, DRAFTER)
    assert pair["size_bytes"] == by_name[TARGET]["size_bytes"] + by_name[DRAFTER]["size_bytes"]

    r = runner.invoke(app, ["models"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["PAIR", "TARGET", "DRAFTER", "SIZE", "LAST", "USED", "STATE"]
    row = next(line for line in lines if line.startswith("qwen3-4b"))
    assert TARGET in row and DRAFTER in row and human_size(pair["size_bytes"]) in row and row.endswith("ok")
    target_row = next(line for line in lines if line.startswith(TARGET))
    assert "target" in target_row and human_size(by_name[TARGET]["size_bytes"]) in target_row
    assert "just now" in target_row  # written a moment ago, never used: the download time


def test_missing_and_truncated_files_are_reported():
    t = fixture_files("target")
    weights = t.pop("model.safetensors")
    # a sharded target whose second shard never arrived
    index = {
        "metadata": {},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    build_cached_repo(
        cache(),
        "org/sharded",
        {**t, "model.safetensors.index.json": json.dumps(index).encode(), "model-00001-of-00002.safetensors": weights},
    )
    # a drafter whose weights were cut short
    d = fixture_files("drafter")
    d["model.safetensors"] = d["model.safetensors"][: len(d["model.safetensors"]) // 2]
    build_cached_repo(cache(), "org/cut-drafter", d)
    # a repo whose Hub tree listing (kept by huggingface_hub) names a file the snapshot lacks
    snap = build_cached_repo(cache(), "org/no-tokenizer", fixture_files("target"))
    listing = {n: {"size": 1, "blob_id": "0" * 40} for n in [*fixture_files("target"), "tokenizer.json", "x.bin"]}
    (repo_dir("org/no-tokenizer") / "trees").mkdir()
    (repo_dir("org/no-tokenizer") / "trees" / f"{snap.name}.json").write_text(
        json.dumps({"format_version": 1, "files": listing})
    )

    by_name = {m["name"]: m for m in models_json()["models"]}
    assert by_name["org/sharded"]["problems"] == ["model-00002-of-00002.safetensors is missing"]
    assert not by_name["org/cut-drafter"]["ok"] and "truncated" in by_name["org/cut-drafter"]["problems"][0]
    # pickle files listed on the Hub are never expected
    assert by_name["org/no-tokenizer"]["problems"] == ["tokenizer.json is missing"]

    r = runner.invoke(app, ["models"])
    row = next(line for line in r.stdout.splitlines() if line.startswith("org/sharded"))
    assert "incomplete: model-00002-of-00002.safetensors is missing" in row


def test_last_use_and_pair_are_recorded_when_a_pair_runs():
    build_cached_repo(cache(), "org/tiny-target", fixture_files("target"))
    build_cached_repo(cache(), "org/tiny-drafter", fixture_files("drafter"))
    old = time.time() - 3 * 86400
    for name in ("org/tiny-target", "org/tiny-drafter"):  # downloaded three days ago
        os.utime(next((repo_dir(name) / "snapshots").iterdir()), (old, old))
    before = {m["name"]: m for m in models_json()["models"]}
    assert before["org/tiny-target"]["last_used"] == pytest.approx(old)
    assert models_json()["pairs"] == []  # two unrelated repos as far as anyone knows

    t0 = time.time()
    args = ["run", "--target", "org/tiny-target", "--drafter", "org/tiny-drafter", "--offline"]
    r = runner.invoke(app, [*args, "--prompt-ids", "1,2,3", "-n", "4", "--dtype", "float32"])
    assert r.exit_code == 0, r.output

    doc = models_json()
    after = {m["name"]: m for m in doc["models"]}
    assert after["org/tiny-target"]["last_used"] >= t0 and after["org/tiny-drafter"]["last_used"] >= t0
    assert [(p["target"], p["drafter"]) for p in doc["pairs"]] == [("org/tiny-target", "org/tiny-drafter")]
    r = runner.invoke(app, ["models"])
    assert "org/tiny-target + org/tiny-drafter" in r.stdout


def test_presets_are_listed_with_what_is_on_disk():
    build_cached_repo(cache(), TARGET, fixture_files("target"))
    r = runner.invoke(app, ["models", "--presets", "--json"])
    assert r.exit_code == 0, r.output
    rows = {p["name"]: p for p in json.loads(r.stdout)}
    assert list(rows) == list(presets.PRESETS)
    assert rows["qwen3-4b"]["on_disk"] == "target only" and rows["qwen3-8b"]["on_disk"] == "no"
    r = runner.invoke(app, ["models", "--presets"])
    for name in presets.PRESETS:
        assert any(line.startswith(name + " ") for line in r.stdout.splitlines())


def test_rm_asks_and_keeps_everything_on_no(preset_pair):
    r = runner.invoke(app, ["models", "rm", "qwen3-4b"], input="n\n")
    assert r.exit_code == 0, r.output
    assert "Remove 2 models" in r.stderr and "nothing removed" in r.stderr
    assert repo_dir(TARGET).is_dir() and repo_dir(DRAFTER).is_dir()


def test_rm_without_an_answer_removes_nothing(preset_pair):
    r = runner.invoke(app, ["models", "rm", TARGET], input="")
    assert r.exit_code == 1
    assert "--yes" in r.stderr
    assert repo_dir(TARGET).is_dir()


def test_rm_preset_removes_both_models_on_yes(preset_pair):
    size = models_json()["pairs"][0]["size_bytes"]
    r = runner.invoke(app, ["models", "rm", "qwen3-4b"], input="y\n")
    assert r.exit_code == 0, r.output
    assert f"freed {human_size(size)}" in r.stderr
    assert not repo_dir(TARGET).exists() and not repo_dir(DRAFTER).exists()
    assert models_json() == {"pairs": [], "models": []}


def test_rm_yes_does_not_ask_and_unknown_names_remove_nothing(preset_pair):
    r = runner.invoke(app, ["models", "rm", DRAFTER, "org/never-downloaded", "--yes"])
    assert r.exit_code == 3
    assert "org/never-downloaded" in r.stderr
    assert repo_dir(DRAFTER).is_dir()

    r = runner.invoke(app, ["models", "rm", DRAFTER, "--yes"])
    assert r.exit_code == 0, r.output
    assert "Remove" not in r.stderr
    assert not repo_dir(DRAFTER).exists() and repo_dir(TARGET).is_dir()
    assert [m["name"] for m in models_json()["models"]] == [TARGET]


def test_an_unreadable_usage_log_loses_nothing(preset_pair):
    from dflash_cli.common import usage_log_path

    usage_log_path().parent.mkdir(parents=True, exist_ok=True)
    usage_log_path().write_text('{"used": [1, 2], "pairs": "oops"')
    doc = models_json()
    assert [p["name"] for p in doc["pairs"]] == ["qwen3-4b"] and len(doc["models"]) == 2
