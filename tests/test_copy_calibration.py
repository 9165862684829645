"""Copy-trust calibration (``runtime.train.calibrate``, ``dflash train --calibrate-copy``): one scale
of the copy pointer's bias, the grid value with the best teacher-forced tau on a calibration set,
folded into the drafter; never worse than no scaling on that set; recorded in the checkpoint and the
model card; the OOD evaluation set and drafters without copy inputs are refused before anything
is loaded."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from dflash_cli.app import app
from runtime.engine.drafter import add_copy_inputs
from runtime.errors import ConfigError
from runtime.train.calibrate import SCALES, calibrate_copy
from runtime.train.trainer import TrainConfig, Trainer
from tests.fakes import make_drafter, make_target

VOCAB = 48


class Sequences:
    """The trainer's view of a dataset: fixed token sequences with random features, the target's
    choice at every position = the next token."""

    has_topk = False

    def __init__(self, seqs: list[list[int]], width: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.seqs = [torch.tensor(s) for s in seqs]
        self.feats = [torch.randn(len(s), width, generator=g) for s in seqs]

    def __len__(self) -> int:
        return len(self.seqs)

    def get(self, i, max_len):
        return self.seqs[i][:max_len], self.feats[i][:max_len], 4

    def get_topk(self, i, max_len):
        return None

    def get_labels(self, i, max_len):
        return None


@pytest.fixture(scope="module")
def model():
    return make_target("qwen3", vocab_size=VOCAB, seed=3)


def _copying_drafter(model):
    """A drafter whose pointer trusts copies a little (bias 1 at every matched size)."""
    d = add_copy_inputs(make_drafter(model.config, seed=1, block_size=4, taps=[0, 2]), (1, 3)).float()
    with torch.no_grad():
        d.copy_bias[1:] = 1.0
    return d


def _weights(model):
    return model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()


def _tau(drafter, model, data):
    embed, head = _weights(model)
    cfg = TrainConfig(steps=1, anchors=4096, bf16=False)
    return Trainer(drafter, embed, head, data, None, cfg, "unused", "cpu").validate(max_seqs=64, dataset=data)["tau_tf"]


def test_calibration_trusts_copies_where_they_are_right(model):
    """Answers that repeat a motif: the lookup's proposal is always the next token, so the best
    scale is the largest and tau rises; the bias is multiplied by exactly that scale."""
    drafter = _copying_drafter(model)
    motifs = [[3, 9, 14, 21, 30], [5, 7, 40, 2], [11, 12, 13, 17, 19, 23]]
    data = Sequences([(m * 12)[:48] for m in motifs], 2 * model.config.hidden_size)
    before = drafter.copy_bias.detach().clone()
    rec = calibrate_copy(drafter, *_weights(model), data)
    assert rec["scale"] == max(SCALES)
    assert rec["tau_tf_after"] > rec["tau_tf_before"] and rec["slot1_after"] > rec["slot1_before"]
    assert rec["positions"] > 100 and len(rec["grid"]) == len(SCALES)
    after = drafter.copy_bias.detach()
    assert torch.allclose(after, before * rec["scale"])
    assert _tau(drafter, model, data) == pytest.approx(rec["tau_tf_after"])  # the drafter as left scores that


def test_calibration_never_does_worse_than_no_scaling(model):
    """Random answers: copies are wrong, and the chosen scale's tau is at least the unscaled one's
    (ties go to the scale nearest 1)."""
    drafter = _copying_drafter(model)
    g = torch.Generator().manual_seed(5)
    data = Sequences(
        [torch.randint(0, VOCAB, (40,), generator=g).tolist() for _ in range(4)], 2 * model.config.hidden_size
    )
    rec = calibrate_copy(drafter, *_weights(model), data)
    assert rec["tau_tf_after"] >= rec["tau_tf_before"]
    best = max(r["tau_tf"] for r in rec["grid"])
    ties = [r["scale"] for r in rec["grid"] if round(r["tau_tf"], 3) == round(best, 3)]
    assert abs(math.log(rec["scale"])) == min(abs(math.log(s)) for s in ties)


def test_a_drafter_without_copy_inputs_is_refused(model):
    d = make_drafter(model.config, seed=1, block_size=4, taps=[0, 2]).float()
    data = Sequences([[1, 2, 3] * 10], 2 * model.config.hidden_size)
    with pytest.raises(ConfigError, match="no copy inputs"):
        calibrate_copy(d, *_weights(model), data)


def test_cli_calibrates_after_training_and_records_it(tmp_path):
    """``dflash train --copy-inputs --calibrate-copy FILE``: the target answers the file's prompts
    once (OUT/eval-data/calibration-NAME), the exported drafter's pointer is the trained one plus the
    recorded scale, and the card and the config say what was done."""
    from runtime import ModelRef, RuntimeConfig, load_pipeline
    from runtime.train.api import DataSpec, prepare_data
    from tests.fakes import save_pair

    target_dir, source = save_pair(tmp_path / "pair", block_size=4)
    pipe = load_pipeline(ModelRef(target=str(target_dir), drafter="none"), RuntimeConfig(dtype="float32"))
    data = tmp_path / "data"
    spec = DataSpec(num_prompts=8, max_new_tokens=32, batch_size=4)
    prepare_data(pipe.target, pipe.tokenizer, data, [1, 2], spec, pipe.stop_token_ids)
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": p, "mode": "raw"}) for p in ["def add(a, b):", "class Stack:", "import os\n"])
    )
    out = tmp_path / "run"
    args = ["train", "--target", str(target_dir), "--data", str(data), "--out", str(out), "--no-eval"]
    args += ["--no-ood-eval", "--dtype", "float32", "--anchors", "8", "--draft-vocab", "full", "--steps", "10"]
    args += ["--from-drafter", str(source), "--copy-inputs", "--calibrate-copy", str(prompts)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "copy pointer calibrated on mine.jsonl" in r.output
    assert (out / "eval-data" / "calibration-mine-jsonl" / "dataset.json").is_file()
    rec = json.loads((out / "drafter" / "config.json").read_text())["dflash_training"]["copy_calibration"]
    assert rec["prompts"] == "mine.jsonl" and rec["scale"] in SCALES and rec["total_scale"] == rec["scale"]
    assert rec["tau_tf_after"] >= rec["tau_tf_before"]
    assert "copy pointer calibrated on mine.jsonl" in (out / "drafter" / "README.md").read_text()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--calibrate-copy", "ood-chat"], "OOD evaluation set"),
        (["--calibrate-copy", "no-such-set"], "neither a dataset"),
        (["--calibrate-copy", "chat-coding"], "needs a drafter with copy inputs"),
    ],
)
def test_cli_refuses_bad_calibration_before_loading_anything(tmp_path, extra, message):
    r = CliRunner().invoke(
        app, ["train", "--out", str(tmp_path / "run"), "--target", str(tmp_path / "none"), "--steps", "1", *extra]
    )
    assert r.exit_code == 2, r.output
    assert message in " ".join(r.output.replace("│", " ").split())
    assert not (tmp_path / "run").exists()
