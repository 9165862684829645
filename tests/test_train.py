"""dflash train on a tiny random target: data with features, loss falls, a trained drafter beats an
untrained one on tau, checkpoints save/resume/extend, the exported drafter loads in the runtime,
and the draft vocabulary round-trips."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from typer.testing import CliRunner

from dflash_cli.app import app
from runtime import ModelRef, RuntimeConfig, SamplingParams, load_pipeline
from runtime.engine.drafter import load_draft_model, save_draft_model
from runtime.train.api import DataSpec, DrafterSpec, fit, prepare_data
from runtime.train.data import load_shard
from runtime.train.state import load_trainer_state
from runtime.train.trainer import TrainConfig
from tests.fakes import collect_ids, make_target, make_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target with a tokenizer and a generated dataset (the target's own answers)."""
    root = tmp_path_factory.mktemp("train")
    target_dir = root / "target"
    target_dir.mkdir()
    tok = make_tokenizer(target_dir)
    model = make_target("qwen3", vocab_size=len(tok) + 8, seed=0, eos_token_id=tok.eos_token_id, initializer_range=0.05)
    model.save_pretrained(str(target_dir))
    pipe = load_pipeline(ModelRef(target=str(target_dir), drafter="none"), RuntimeConfig(dtype="float32"))
    data_dir = root / "data"
    prepare_data(
        pipe.target,
        pipe.tokenizer,
        data_dir,
        [1, 2, 3],
        DataSpec(num_prompts=48, max_new_tokens=48, batch_size=16),
        pipe.stop_token_ids,
    )
    return pipe, target_dir, data_dir, root


def test_dataset_holds_tokens_features_and_target_answers(tiny):
    pipe, _, data_dir, _ = tiny
    meta = json.loads((data_dir / "dataset.json").read_text())
    assert meta["taps"] == [1, 2, 3]
    shard = load_shard(sorted(data_dir.glob("shard-*.safetensors"))[0])
    assert shard.features[0:4].shape == (4, 3 * pipe.target.hidden_size)
    a, b = int(shard.offsets[0]), int(shard.offsets[1])
    seq = shard.tokens[a:b].tolist()
    plen = int(shard.prompt_len[0])
    # the answer is exactly the target's greedy continuation of the prompt
    events = list(pipe.stream(seq[:plen], SamplingParams(max_new_tokens=len(seq) - plen)))
    assert collect_ids(events) == seq[plen:]


def _tau(pipe, drafter_dir, prompts):
    p = load_pipeline(
        ModelRef(target=str(pipe.pair.target_dir), drafter=str(drafter_dir)), RuntimeConfig(dtype="float32")
    )
    taus = []
    from runtime import DecodeOptions

    for ids in prompts:
        ev = list(p.stream(ids, SamplingParams(max_new_tokens=32), DecodeOptions(verify_length=3)))
        taus.append(ev[-1].stats.tau)
    return sum(taus) / len(taus), p


def test_training_loss_falls_and_beats_untrained(tiny, tmp_path):
    pipe, _, data_dir, _ = tiny
    spec = DrafterSpec(num_layers=1, block_size=4, draft_vocab=200)
    cfg = TrainConfig(steps=300, lr=3e-3, anchors=16, eval_every=100, checkpoint_every=1e9, seed=0)
    trainer = fit(pipe.target, pipe.tokenizer, data_dir, tmp_path, spec, cfg)
    hist = trainer.state.history
    assert hist[0]["step"] == 0 and hist[-1]["val_loss"] < hist[0]["val_loss"] * 0.7
    ckpt = tmp_path / "checkpoint"
    trained = load_draft_model(ckpt)
    assert trained.draft_vocab_ids is not None and trained.draft_vocab_ids.numel() <= 200
    # untrained drafter of the same shape
    from runtime.train.model_init import init_drafter

    untrained = init_drafter(dict(trained.config.raw))
    untrained.draft_vocab_ids = trained.draft_vocab_ids
    save_draft_model(untrained, tmp_path / "untrained")
    from runtime.train.prompts import build_prompts

    held_out = build_prompts(seed=0)[60:68]  # the dataset used the first 48
    prompts = [pipe.encode(p.text, chat=p.chat) for p in held_out]
    tau_trained, p = _tau(pipe, ckpt, prompts)
    tau_untrained, _ = _tau(pipe, tmp_path / "untrained", prompts)
    assert tau_trained > tau_untrained + 0.2, (tau_trained, tau_untrained)
    # lossless with the trained drafter in float32
    for ids in prompts:
        a = collect_ids(list(p.stream(ids, SamplingParams(max_new_tokens=32))))
        from runtime import DecodeOptions

        b = collect_ids(list(p.stream(ids, SamplingParams(max_new_tokens=32), DecodeOptions(decoder="ar"))))
        assert a == b


def test_checkpoint_resume_and_extend(tiny, tmp_path):
    pipe, _, data_dir, _ = tiny
    spec = DrafterSpec(num_layers=1, block_size=4, draft_vocab=0)
    fit(pipe.target, pipe.tokenizer, data_dir, tmp_path, spec, TrainConfig(steps=20, anchors=8, eval_every=10))
    assert not list((tmp_path / "checkpoint").glob("*.pt"))  # no pickle in a run folder
    state = load_trainer_state(tmp_path / "checkpoint")["state"]
    assert state["step"] == 20
    with pytest.raises(Exception, match="--resume"):
        fit(pipe.target, pipe.tokenizer, data_dir, tmp_path, spec, TrainConfig(steps=20))
    # same schedule already complete: resume runs no more steps; extend starts a new segment
    tr = fit(pipe.target, pipe.tokenizer, data_dir, tmp_path, spec, None, resume=True)  # keeps the run's schedule
    assert tr.state.step == 20 and tr.cfg.steps == 20 and tr.cfg.anchors == 8
    tr = fit(
        pipe.target,
        pipe.tokenizer,
        data_dir,
        tmp_path,
        spec,
        TrainConfig(steps=15, anchors=8),
        resume=True,
        extend=True,
    )
    assert tr.state.step == 35 and tr.state.segments == 2
    assert load_draft_model(tmp_path / "checkpoint").draft_vocab_ids is None


def test_draft_vocab_round_trip(tmp_path):
    from tests.fakes import make_drafter

    model = make_target("qwen3", vocab_size=64)
    d = make_drafter(model.config, block_size=4)
    d.draft_vocab_ids = torch.tensor([3, 5, 9, 40])
    save_draft_model(d, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["dflash_config"]["draft_vocab_size"] == 4
    back = load_draft_model(tmp_path)
    assert back.draft_vocab_ids.tolist() == [3, 5, 9, 40]
    for k, v in d.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v)


def test_cli_train_end_to_end(tiny, tmp_path, monkeypatch):
    _, target_dir, data_dir, _ = tiny
    out = tmp_path / "run"
    args = [
        "train",
        "--target",
        str(target_dir),
        "--out",
        str(out),
        "--data",
        str(data_dir),
        "--taps",
        "1,2,3",
        "--steps",
        "30",
        "--block-size",
        "4",
        "--anchors",
        "8",
        "--draft-vocab",
        "100",
        "--eval-prompts",
        "2",
        "--eval-tokens",
        "12",
        "--dtype",
        "float32",
    ]
    monkeypatch.setattr(sys, "argv", ["dflash", *args])  # what the model card quotes
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    drafter_dir = out / "drafter"
    assert r.stdout.strip() == str(drafter_dir)
    card = (drafter_dir / "README.md").read_text()
    assert "median tau" in card and "Reproduce" in card
    assert "dflash train --target" in card and "--steps 30" in card
    assert "answered prompts in" in card  # the dataset's size
    # re-evaluating and re-exporting keeps the training command in the card (not the --eval-only one)
    again = [
        "train",
        "--target",
        str(target_dir),
        "--out",
        str(out),
        "--eval-only",
        "--eval-prompts",
        "1",
        "--eval-tokens",
        "8",
        "--dtype",
        "float32",
    ]
    monkeypatch.setattr(sys, "argv", ["dflash", *again])
    r = CliRunner().invoke(app, again)
    assert r.exit_code == 0, r.output
    card = (drafter_dir / "README.md").read_text()
    assert "--steps 30" in card and "--eval-only" not in card and "answered prompts in" in card
    cfg = json.loads((drafter_dir / "config.json").read_text())
    assert len(cfg["dflash_config"]["acceptance_conditional"]) == 3
    run = CliRunner().invoke(
        app, ["run", "--target", str(target_dir), "--drafter", str(drafter_dir), "--raw", "-n", "8", "def"]
    )
    assert run.exit_code == 0, run.output


def test_cli_train_needs_a_budget(tmp_path):
    r = CliRunner().invoke(app, ["train", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--steps" in r.output
