"""A damaged drafter folder stops `dflash run` at load with exit code 4 and one line naming the file
and the field (issue 46, defect 5): its config.json, its weight index, its draft vocabulary and its
corpus table are validated where they are read, never at the first decode step."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from dflash_cli.app import app
from runtime.engine.models.corpus import CORPUS_FILE, CorpusTable
from runtime.engine.models.drafter_io import load_draft_model, save_draft_model
from runtime.engine.models.drafter_surgery import add_copy_corpus, add_copy_inputs
from runtime.errors import ModelLoadError
from tests.fakes import one_line_error

runner = CliRunner()
F32 = ["--dtype", "float32", "--device", "cpu"]


def run(target: Path, drafter: Path) -> Any:
    return runner.invoke(
        app, ["run", "--target", str(target), "--drafter", str(drafter), *F32, "--raw", "-n", "4", "hi"]
    )


def damaged(tiny_pair: tuple[Path, Path], tmp_path: Path, edit: Callable[[Path], None]) -> tuple[Path, Path]:
    t, d = tiny_pair
    bad = tmp_path / "drafter"
    shutil.copytree(d, bad)
    edit(bad)
    return t, bad


def edit_config(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        change(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))

    return edit


def nested(**kw: Any) -> Callable[[dict[str, Any]], None]:
    return lambda c: c["dflash_config"].update(kw)


# -- config.json ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change,field",
    [
        (nested(rank_coverage="abc"), "dflash_config.rank_coverage"),
        (nested(rank_coverage=5), "dflash_config.rank_coverage"),
        (nested(rank_coverage=[0.5, 0.2]), "dflash_config.rank_coverage"),
        (nested(rank_coverage=[[0.5, None]]), "dflash_config.rank_coverage"),
        (nested(rank_coverage=[[0.5, 7.0]]), "dflash_config.rank_coverage"),
        (nested(acceptance_conditional="high"), "dflash_config.acceptance_conditional"),
        (nested(acceptance_conditional=[0.9, None]), "dflash_config.acceptance_conditional"),
        (nested(acceptance_conditional=[0.9, -1]), "dflash_config.acceptance_conditional"),
        (lambda c: c.update(block_size=True), "block_size"),
        (lambda c: c.update(block_size=2.5), "block_size"),
        (nested(block_size=2), "block_size"),  # the top-level 4 disagrees with the nested 2
        (nested(mask_token_id="7"), "dflash_config.mask_token_id"),
        (nested(target_layer_ids=[1, "x"]), "dflash_config.target_layer_ids"),
        (lambda c: c.update(layer_types=["nope"]), "layer_types"),
        (lambda c: c.update(rms_norm_eps="small"), "rms_norm_eps"),
        (lambda c: c.update(hidden_size=-64), "hidden_size"),
        (lambda c: c.update(dflash_config=[1, 2]), "dflash_config"),
    ],
    ids=[
        "rank_coverage string",
        "rank_coverage number",
        "rank_coverage flat list",
        "rank_coverage null inside",
        "rank_coverage above 1",
        "acceptance_conditional string",
        "acceptance_conditional null inside",
        "acceptance_conditional negative",
        "block_size true",
        "block_size float",
        "block_size disagrees",
        "mask_token_id string",
        "target_layer_ids string inside",
        "layer_types unknown",
        "rms_norm_eps string",
        "hidden_size negative",
        "dflash_config list",
    ],
)
def test_bad_config_field_is_exit_4_naming_file_and_field(tiny_pair, tmp_path, change, field):
    t, bad = damaged(tiny_pair, tmp_path, edit_config(change))
    r = run(t, bad)
    one_line_error(r, ModelLoadError.exit_code, str(bad / "config.json"), field)
    assert r.stdout == ""


def test_config_that_is_not_utf8_or_not_an_object_is_exit_4(tiny_pair, tmp_path):
    def latin1(folder: Path) -> None:
        cfg = (folder / "config.json").read_text().replace('"qwen3"', '"qw\u00e9n3"')
        (folder / "config.json").write_bytes(cfg.encode("latin-1"))

    t, bad = damaged(tiny_pair, tmp_path, latin1)
    one_line_error(run(t, bad), 4, str(bad / "config.json"), "UTF-8")
    (bad / "config.json").write_text("[1, 2, 3]")
    one_line_error(run(t, bad), 4, str(bad / "config.json"), "JSON object")


# -- model.safetensors.index.json ------------------------------------------------------------------------
def test_truncated_or_malformed_weight_index_is_exit_4_naming_it(tiny_pair, tmp_path):
    def with_index(folder: Path) -> None:
        keys = load_file(str(folder / "model.safetensors")).keys()
        index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in keys}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))

    t, bad = damaged(tiny_pair, tmp_path, with_index)
    index = bad / "model.safetensors.index.json"
    assert run(t, bad).exit_code == 0  # a good index loads
    text = index.read_text()
    index.write_text(text[: len(text) // 2])
    one_line_error(run(t, bad), 4, str(index), "not valid JSON")
    index.write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    one_line_error(run(t, bad), 4, str(index), "weight_map")
    index.write_text(json.dumps({"weight_map": {"fc.weight": "../../etc/passwd"}}))
    one_line_error(run(t, bad), 4, str(index), "weight_map")


# -- draft_vocab_ids -----------------------------------------------------------------------------------
def with_vocab_ids(ids: torch.Tensor) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        state = load_file(str(folder / "model.safetensors"))
        state["draft_vocab_ids"] = ids
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        edit_config(nested(draft_vocab_size=int(ids.numel())))(folder)

    return edit


@pytest.mark.parametrize(
    "ids,needle",
    [
        (torch.tensor([[1, 2], [3, 4]]), "1-D"),
        (torch.tensor([1, 2, 100_000]), "100000"),
        (torch.tensor([1, -5, 3]), "-5"),
        (torch.tensor([1.0, 2.0]), "integer"),
    ],
    ids=["2-D", "beyond the vocabulary", "negative", "float"],
)
def test_bad_draft_vocab_ids_are_exit_4_naming_file_and_field(tiny_pair, tmp_path, ids, needle):
    t, bad = damaged(tiny_pair, tmp_path, with_vocab_ids(ids))
    r = run(t, bad)
    one_line_error(r, 4, str(bad / "model.safetensors"), "draft_vocab_ids", needle)


def test_good_draft_vocab_ids_still_load(tiny_pair, tmp_path):
    t, good = damaged(tiny_pair, tmp_path, with_vocab_ids(torch.arange(0, 40)))
    r = run(t, good)
    assert r.exit_code == 0, r.output


# -- corpus.safetensors ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus_pair(tiny_pair, tmp_path_factory):
    """The tiny pair's drafter with copy inputs and a corpus table (2..3-grams) that loads and runs."""
    t, d = tiny_pair
    drafter = add_copy_inputs(load_draft_model(d), (1, 4))
    table = CorpusTable((2, 3), {2: {11: (5, 2), 12: (6, 1)}, 3: {13: (7, 0)}})
    drafter = add_copy_corpus(drafter, (2, 3), table)
    folder = tmp_path_factory.mktemp("corpus") / "drafter"
    save_draft_model(drafter, folder)
    assert run(t, folder).exit_code == 0
    return t, folder


def with_corpus_tensor(name: str, values: list[int], dtype: torch.dtype) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        path = folder / CORPUS_FILE
        state = load_file(str(path))
        state[name] = torch.tensor(values, dtype=dtype)
        save_file(state, str(path), metadata={"ngram": "2,3"})

    return edit


@pytest.mark.parametrize(
    "name,values,dtype,needle",
    [
        ("next_2", [5, 1_000_000], torch.int32, "1000000"),
        ("next_2", [5, -5], torch.int32, "-5"),
        ("next_3", [5, 6], torch.int32, "entries"),  # one key, two next ids
        ("level_2", [2, 3], torch.uint8, "3"),
        ("keys_2", [11, 12], torch.float32, "integer"),
    ],
    ids=["next id beyond the vocabulary", "negative next id", "length mismatch", "level out of range", "float keys"],
)
def test_bad_corpus_table_is_exit_4_naming_file_and_field(corpus_pair, tmp_path, name, values, dtype, needle):
    t, d = corpus_pair
    _, bad = damaged((t, d), tmp_path, with_corpus_tensor(name, values, dtype))
    r = run(t, bad)
    one_line_error(r, 4, str(bad / CORPUS_FILE), name, needle)
