"""dflash train on a tiny random target: data with features, loss falls, a trained drafter beats an
untrained one on tau, checkpoints save/resume/extend, the exported drafter loads in the runtime,
and the draft vocabulary round-trips."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from dflash_cli.app import app
from runtime import ModelRef, RuntimeConfig, SamplingParams, load_pipeline
from runtime.engine.models.drafter_io import load_draft_model, save_draft_model
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
    model = make_target(
        "qwen3",
        vocab_size=len(tok) + 8,
        seed=0,
        eos_token_id=tok.eos_token_id,
        initializer_range=0.05,
        max_position_embeddings=4096,  # the OOD set's multi-turn prompts are long in a 320-token vocabulary
    )
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
    assert hist[0]["step"] == 0 and hist[-1]["val_loss"] < hist[0]["val_loss"] * 0.75
    ckpt = tmp_path / "checkpoint"
    trained = load_draft_model(ckpt)
    assert trained.draft_vocab_ids is not None and trained.draft_vocab_ids.numel() <= 200
    # untrained drafter of the same shape
    from runtime.train.model_init import init_drafter

    untrained = init_drafter(dict(trained.config.raw))
    untrained.draft_vocab_ids = trained.draft_vocab_ids
    save_draft_model(untrained, tmp_path / "untrained")
    from runtime.train.evaluate import encode
    from runtime.train.prompt_sources import build_prompts

    held_out = build_prompts(seed=0)[60:]  # the dataset used the first 48
    prompts = [ids for ids in (encode(pipe, p) for p in held_out) if len(ids) < 200][:8]
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
        "--eval-every",
        "30",
        "--lr",
        "3e-4",
        "--answer-tokens",
        "16",
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
    assert "| tau_walk (whole block, as the decoder walks) |" in card  # next to tau_tf, for both sets
    # the continue line names the run folder as the commands above it do (they run from one folder)
    trained = next(line for line in card.splitlines() if line.startswith("dflash train --target"))
    cont = next(line for line in card.splitlines() if "--resume --extend" in line)
    assert cont.split("--out ")[1].split()[0] == trained.split("--out ")[1].split()[0]
    assert "answered prompts in" in card  # the dataset's size
    # in-distribution and OOD side by side, top-k coverage per slot, OOV share, the data mix
    assert "| | in_distribution | ood |" in card and "pooled tau" in card
    assert "slot 1: top-1 / 2 / 4 / 8" in card and "slot 3: top-1 / 2 / 4 / 8" in card and "OOV share" in card
    assert "| kind | prompts | answer tokens |" in card
    assert str(tmp_path) not in card and str(target_dir) not in card  # no machine-specific paths
    assert "dataset:" in r.stderr and "draft vocabulary:" in r.stderr  # mix and coverage reports printed
    report = json.loads((out / "data-report.json").read_text())
    assert report["sequences"] > 0 and sum(v["sequences"] for v in report["mix"].values()) == report["sequences"]
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 30]  # --eval-every 30: logged as training goes
    for e in evals:
        for name in ("in_distribution", "ood"):
            assert set(e[name]["topk_coverage"]) == {"top1", "top2", "top4", "top8"} and "oov_share" in e[name]
    exported = json.loads((drafter_dir / "config.json").read_text())
    ev = exported["dflash_training"]["evaluation"]
    assert set(ev["sets"]) == {"in_distribution", "ood"} and set(ev["teacher_forced"]) == {"in_distribution", "ood"}
    assert ev["sets"]["ood"]["prompts"] >= 1 and "pooled_tau" in ev["sets"]["ood"]
    assert not exported["dflash_training"]["dataset"].startswith("/")
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
    # --resume --extend keeps the run's hyper-parameters (lr 3e-4, anchors 8, eval every 30), not the
    # flags' defaults; only what is typed now changes (--seqs-per-step 1) and the new schedule (--steps 4)
    # --resume without --data trains on the run's own datasets (a run older than data-sources.json:
    # read from its training command), never on a fresh OUT/data
    assert json.loads((out / "data-sources.json").read_text())["data"] == str(data_dir.resolve())
    (out / "data-sources.json").unlink()
    more = ["train", "--target", str(target_dir), "--out", str(out), "--resume"]
    more += ["--extend", "--steps", "4", "--seqs-per-step", "1", "--no-eval", "--dtype", "float32"]
    r = CliRunner().invoke(app, more)
    assert r.exit_code == 0, r.output
    assert f"dataset {data_dir}" in r.stderr and not (out / "data").exists()
    assert json.loads((out / "data-sources.json").read_text())["data"] == str(data_dir.resolve())
    saved = load_trainer_state(out / "checkpoint")
    cfg = saved["config"]
    assert (cfg["lr"], cfg["anchors"], cfg["eval_every"], cfg["seqs_per_step"], cfg["steps"]) == (3e-4, 8, 30, 1, 4)
    assert saved["state"]["step"] == 34 and saved["state"]["segments"] == 2


def test_cli_train_needs_a_budget(tmp_path):
    r = CliRunner().invoke(app, ["train", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--steps" in r.output


# -- issue 13: soft labels, init from the target, vocabulary coverage, prompt mix, OOD set --------


def test_topk_soft_labels_match_target_logits(tiny):
    """The stored top-k ids and log-probabilities are the target's own distribution at each answer
    position (recomputed here with one teacher-forced forward)."""
    pipe, _, data_dir, _ = tiny
    assert json.loads((data_dir / "dataset.json").read_text())["topk"] == 8
    shard = load_shard(sorted(data_dir.glob("shard-*.safetensors"))[0])
    assert shard.topk_ids.dtype == torch.int32 and shard.topk_logp.dtype == torch.float16  # compact
    answers = int(shard.tokens.numel() - shard.prompt_len.sum())
    assert shard.topk_ids.shape == (answers, 8)
    for j in (0, 1):
        a, b = int(shard.offsets[j]), int(shard.offsets[j + 1])
        seq, plen = shard.tokens[a:b], int(shard.prompt_len[j])
        with torch.no_grad():
            logits = pipe.target.model(input_ids=seq[None]).logits[0].float()
        logp = logits.log_softmax(-1)[plen - 1 : b - a - 1]  # the distribution of each answer token
        ref_lp, ref_ids = logp.topk(8, dim=-1)
        r0 = shard.answer_start(j)
        ids = shard.topk_ids[r0 : r0 + b - a - plen].long()
        lp = shard.topk_logp[r0 : r0 + b - a - plen].float()
        assert torch.equal(ids[:, 0], seq[plen:])  # greedy answers: top-1 is the answer token
        assert (ids == ref_ids).float().mean() > 0.98  # (near-ties may swap in the tail)
        torch.testing.assert_close(lp, ref_lp, atol=2e-2, rtol=1e-2)


def test_soft_distillation_trains(tiny, tmp_path):
    pipe, _, data_dir, _ = tiny
    spec = DrafterSpec(num_layers=1, block_size=4, draft_vocab=0)
    cfg = TrainConfig(steps=150, lr=3e-3, anchors=16, eval_every=50, distill="soft", soft_weight=0.7, seed=0)
    trainer = fit(pipe.target, pipe.tokenizer, data_dir, tmp_path, spec, cfg)
    hist = trainer.state.history
    assert "val_soft" in hist[0] and hist[-1]["val_soft"] < hist[0]["val_soft"] - 0.5
    assert hist[-1]["val_kl"] < hist[0]["val_kl"] - 0.4, hist  # closer to the target's distribution
    assert hist[-1]["val_loss"] < hist[0]["val_loss"] * 0.8  # the hard CE falls as well
    # at equal steps, the soft term brings the drafter closer to the target's distribution than hard labels
    hard_cfg = TrainConfig(steps=150, lr=3e-3, anchors=16, eval_every=50, distill="hard", seed=0)
    hard = fit(pipe.target, pipe.tokenizer, data_dir, tmp_path / "hard", spec, hard_cfg).state.history
    assert hist[-1]["val_kl"] < hard[-1]["val_kl"], (hist[-1], hard[-1])
    assert hist[-1]["topk_coverage"]["top8"][0] >= hist[-1]["topk_coverage"]["top1"][0]
    # the trainer's loss is exactly (1 - w) * hard CE + w * soft CE against the renormalised top-k
    # distribution, computed here from full logits
    import dataclasses
    import random

    from runtime.train.trainer import build_batch

    data = trainer.train_data
    trainer.cfg = dataclasses.replace(trainer.cfg, bf16=False)
    trainer.head, trainer.embed = trainer.head.float(), trainer.embed.float()
    batch = build_batch([data.get(0, 4096)], 4, 4, trainer.mask_id, random.Random(0), [data.get_topk(0, 4096)])
    loss, m = trainer._forward(batch)
    with torch.no_grad():
        ctx = trainer.drafter.fuse_context(batch["features"].float())
        hid = trainer.drafter(trainer.embed[batch["block_ids"]], ctx, batch["positions"], mask=batch["mask"])
        n, a, _ = batch["labels"].shape
        hid = hid.view(n, a, trainer.block, -1)[:, :, 1:].reshape(n * a * (trainer.block - 1), -1)
        logp = (hid @ trainer.head.T).log_softmax(-1)
    w = trainer.weights.repeat(n * a)
    target = batch["labels"].view(-1)  # full vocabulary (draft_vocab=0)
    hard = -(logp.gather(1, target.clamp(min=0)[:, None])[:, 0] * w * (target >= 0)).sum() / (w * (target >= 0)).sum()
    ids, lp = batch["soft_ids"].view(-1, 8), batch["soft_logp"].view(-1, 8)
    q = lp.exp() * (ids >= 0)
    has = q.sum(-1) > 0
    q = q / q.sum(-1, keepdim=True).clamp(min=1e-12)
    per = -(q * logp.gather(1, ids.clamp(min=0))).sum(-1)
    soft = (per * w * has).sum() / (w * has).sum()
    torch.testing.assert_close(m["hard"], float(hard), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m["soft"], float(soft), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(float(loss.detach()), float(0.3 * hard + 0.7 * soft), rtol=1e-5, atol=1e-5)


def test_soft_distillation_needs_topk(tiny, tmp_path):
    import dataclasses

    from runtime.errors import ConfigError
    from runtime.train.api import open_datasets
    from runtime.train.model_init import init_drafter, make_drafter_config
    from runtime.train.trainer import Trainer

    pipe, _, data_dir, _ = tiny
    train, val = open_datasets(data_dir, [1, 2, 3], pipe.target.hidden_size)
    train.shards = [dataclasses.replace(s, topk_ids=None, topk_logp=None) for s in train.shards]
    d = init_drafter(make_drafter_config(pipe.target.config, block_size=4, target_layer_ids=[1, 2, 3], mask_token_id=5))
    embed, head = pipe.target.embed.weight, pipe.target.lm_head.weight
    with pytest.raises(ConfigError, match="top-k"):
        Trainer(d, embed, head, train, val, TrainConfig(steps=1, distill="soft"), tmp_path)
    Trainer(d, embed, head, train, val, TrainConfig(steps=1, distill="hard"), tmp_path)  # hard labels are fine


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_init_from_target(arch, tmp_path):
    """Drafter layer <- the target's last layer: projections, MLP and norms copied; Qwen2's q/k/v
    biases copied (the drafter gets attention_bias), qk-norm copied from Qwen3 and left at 1 for
    Qwen2; a narrower MLP keeps the target's strongest neurons; the result saves and loads."""
    from runtime.train.model_init import init_drafter, init_from_target, make_drafter_config, target_has_attention_bias

    target = make_target(arch, vocab_size=64, seed=1)
    last = target.model.layers[-1]
    assert target_has_attention_bias(target) == (arch == "qwen2")
    cfg = make_drafter_config(
        target.config, block_size=4, target_layer_ids=[1, 2], mask_token_id=63, intermediate_size=128
    )
    cfg["attention_bias"] = target_has_attention_bias(target)
    d = init_drafter(cfg)
    rep = init_from_target(d, target)
    assert rep["source_layers"] == [3] and not rep["skipped"] and not rep["pruned"]
    dl = d.layers[0]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert torch.equal(getattr(dl.self_attn, name).weight, getattr(last.self_attn, name).weight)
    if arch == "qwen2":
        for name in ("q_proj", "k_proj", "v_proj"):
            assert torch.equal(getattr(dl.self_attn, name).bias, getattr(last.self_attn, name).bias)
        assert torch.equal(dl.self_attn.q_norm.weight, torch.ones(16)) and any("q_norm" in n for n in rep["notes"])
    else:
        assert torch.equal(dl.self_attn.q_norm.weight, last.self_attn.q_norm.weight)
    x = torch.randn(3, 64)
    torch.testing.assert_close(dl.mlp(x), last.mlp(x))  # the MLP is the target's exactly
    torch.testing.assert_close(dl.input_layernorm(x), last.input_layernorm(x))
    save_draft_model(d, tmp_path / "d")
    back = load_draft_model(tmp_path / "d")
    assert torch.equal(back.layers[0].self_attn.q_proj.weight, last.self_attn.q_proj.weight)
    # a narrower MLP: the 64 strongest of the target's 128 neurons, in order
    cfg["intermediate_size"] = 64
    d2 = init_drafter(cfg)
    rep2 = init_from_target(d2, target)
    assert rep2["pruned"] and "64 of 128" in rep2["pruned"][0]
    rows = {tuple(r.tolist()) for r in last.mlp.gate_proj.weight}
    assert all(tuple(r.tolist()) in rows for r in d2.layers[0].mlp.gate_proj.weight)


def test_fit_with_init_target_and_auto_vocab(tiny, tmp_path):
    pipe, _, data_dir, _ = tiny
    spec = DrafterSpec(num_layers=1, block_size=4, draft_vocab="auto", max_oov=0.02, init="target")
    fit(pipe.target, pipe.tokenizer, data_dir, tmp_path, spec, TrainConfig(steps=5, anchors=8, eval_every=5))
    init = json.loads((tmp_path / "init-report.json").read_text())
    assert init["source_layers"] == [pipe.target.num_layers - 1] and init["copied"]
    cov = json.loads((tmp_path / "vocab-coverage.json").read_text())
    rows = cov["rows"]
    assert rows[-1]["n"] == pipe.target.vocab_size and rows[-1]["oov_share"] == 0.0  # the full vocabulary
    assert all(a["oov_share"] >= b["oov_share"] for a, b in zip(rows, rows[1:], strict=False))
    assert all(a["head_mflops_per_slot"] < b["head_mflops_per_slot"] for a, b in zip(rows, rows[1:], strict=False))
    chosen = cov["chosen"]
    assert chosen["full"] or chosen["oov_share"] <= 0.02
    rec = json.loads((tmp_path / "checkpoint" / "config.json").read_text())["dflash_training"]
    assert rec["init"]["kind"] == "target" and rec["draft_vocab"]["n"] == chosen["n"]


def test_vocab_choice_rules():
    from collections import Counter

    from runtime.train import vocab

    train = Counter({i: 1000 - i for i in range(1000)})  # id i is the (i+1)-th most frequent
    held = Counter({i: 1 for i in range(100)}) + Counter({5000: 1})  # 1 of 101 never seen in training
    assert vocab.choose_size(train, held, 150_000, max_oov=0.02) == 512  # 100 ids suffice, rounded up
    assert vocab.choose_size(train, held, 150_000, max_oov=0.001) == 0  # unreachable: full vocabulary
    assert vocab.oov_share(vocab.ranked_tokens(train), held, 50) == pytest.approx(51 / 101)
    rep = vocab.coverage_report(train, held, 150_000, 64, 10_000, sizes=(10, 100))
    assert [r["n"] for r in rep["rows"]] == [10, 100, 1000, 150_000]
    assert rep["rows"][1]["oov_share"] == pytest.approx(1 / 101, abs=1e-4)
    assert vocab.vocab_ids(train, 10, always=[999]).tolist() == [*range(9), 999]
    # a fine-tune ranks its source drafter's ids first (here rare or unseen in this run's data)
    prior = [998, 5000]
    assert vocab.ranked_tokens(train, prior)[:3] == [998, 5000, 0]
    assert vocab.vocab_ids(train, 5, prior=prior).tolist() == [0, 1, 2, 998, 5000]
    assert vocab.oov_share(vocab.ranked_tokens(train, prior), held, 102) == 0.0  # 5000 is covered now
    assert vocab.choose_size(train, held, 150_000, max_oov=0.001, prior=prior) == 512


def test_prompt_generator_kinds_mix_and_dedupe():
    from runtime.train.dedupe import EvalIndex, evaluation_index, prompt_text
    from runtime.train.generator import MIX, build_prompts_v2, mix_counts
    from runtime.train.prompts import LANGUAGES

    prompts = build_prompts_v2(seed=0)
    counts = mix_counts(prompts)
    assert set(counts) == set(MIX) and len(prompts) > 10_000
    head = mix_counts(prompts[:1000])  # any prefix keeps the mix
    for kind, share in MIX.items():
        assert abs(head[kind] / 1000 - share) < 0.01, (kind, head[kind])
    by_kind = {k: [p for p in prompts if p.kind == k] for k in MIX}
    assert all(
        p.messages and len(p.messages) == 3 and p.messages[1]["role"] == "assistant" for p in by_kind["multi-turn"]
    )
    assert all("```python" in p.text for k in MIX if k.startswith("edit-") for p in by_kind[k][:50])
    assert all(not p.chat for p in by_kind["raw-file"] + by_kind["stdlib-raw"])
    assert {p.source.split(":")[1] for p in by_kind["task"]} == set(LANGUAGES)  # every language of the task list
    assert any("python" in p.source for p in by_kind["raw-file"])
    # nothing generated duplicates an evaluation prompt (bench sets, held-out, OOD)
    index = evaluation_index()
    assert len(index) > 200
    assert not any(index.matches(prompt_text(p)) for p in prompts[:3000])
    # the index catches exact, reworded and embedded copies, not mere topic overlap
    idx = EvalIndex(["Write a Python function that flattens an arbitrarily nested list."])
    assert idx.matches("write a python function that FLATTENS an arbitrarily nested list!")
    assert idx.matches("Write a JavaScript function that flattens an arbitrarily nested list.")
    assert idx.matches("Here is some context.\nWrite a Python function that flattens an arbitrarily nested list")
    assert not idx.matches("Write a Python function that reverses a linked list.")


def test_generation_batches_hold_prompts_of_similar_length(tmp_path):
    from runtime.train.prompt_list import TrainPrompt
    from runtime.train.prompt_sources import BUCKET_BATCHES, _prompt_chars, bucket_by_length, stored_prompts

    rng = __import__("random").Random(1)
    prompts = [TrainPrompt("x" * int(rng.lognormvariate(5, 1)), True, f"k{i % 5}:{i}") for i in range(300)]
    out = bucket_by_length(prompts, 8, seed=0)
    assert sorted(p.source for p in out) == sorted(p.source for p in prompts)  # same prompts, once each

    def padded(ps):  # prefill work of left-padded batches of 8
        return sum(max(map(_prompt_chars, ps[i : i + 8])) * len(ps[i : i + 8]) for i in range(0, len(ps), 8))

    useful = sum(map(_prompt_chars, prompts))
    assert padded(prompts) > 2 * useful and padded(out) < 0.6 * padded(prompts)  # long-tailed, as the generator's
    window = 8 * BUCKET_BATCHES  # each window keeps its own prompts (the kind mix of any prefix stays)
    assert {p.source for p in out[:window]} == {p.source for p in prompts[:window]}
    assert out == bucket_by_length(prompts, 8, seed=0)  # deterministic: shards resume

    # a dataset extended later keeps its stored prompts in place and orders only the new ones
    spec = DataSpec(num_prompts=40, batch_size=8, generator="v1")
    first = stored_prompts(tmp_path, spec)
    more = stored_prompts(tmp_path, DataSpec(num_prompts=90, batch_size=8, generator="v1"))
    assert len(first) == 40 and len(more) == 90 and more[:40] == first
    assert stored_prompts(tmp_path, DataSpec(num_prompts=90, batch_size=8, generator="v1")) == more


def test_ood_set_loads_and_is_held_out():
    from runtime.bench.datasets import load_dataset
    from runtime.train.dedupe import evaluation_texts
    from runtime.train.heldout import ood_prompts

    ood = load_dataset("ood-chat")
    assert len(ood.prompts) >= 16 and all(p.mode == "chat" and p.messages for p in ood.prompts)
    assert sum(len(p.messages) > 1 for p in ood.prompts) >= 3  # multi-turn
    text = " ".join(m["content"] for p in ood.prompts for m in p.messages).lower()
    for lang in ("go", "rust", "sql", "bash", "javascript", "python"):
        assert lang in text
    tp = ood_prompts()
    assert len(tp) == len(ood.prompts) and all(p.kind == "ood" for p in tp)
    assert len([t for t in evaluation_texts() if "deepEqual" in t]) == 1  # part of every dedupe
    tok = make_tokenizer()
    from runtime.train.data import encode_prompt

    ids = encode_prompt(tok, tp[0].text, True, tp[0].messages)
    assert tok.decode(ids).count("<|im_start|>") == len(tp[0].messages) + 1
    r = CliRunner().invoke(app, ["bench", "--help"])
    assert "ood-chat" in r.output


def test_cli_train_soft_target_init_auto_vocab(tiny, tmp_path, monkeypatch):
    _, target_dir, data_dir, _ = tiny
    out = tmp_path / "run"
    args = ["train", "--target", str(target_dir), "--out", str(out), "--data", str(data_dir), "--taps", "1,2,3"]
    args += ["--steps", "10", "-b", "4", "--anchors", "8", "--no-eval", "--no-ood-eval", "--dtype", "float32"]
    args += ["--distill", "soft", "--soft-weight", "0.6", "--init", "target", "--draft-vocab", "auto"]
    monkeypatch.setattr(sys, "argv", ["dflash", *args])
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    card = (out / "drafter" / "README.md").read_text()
    assert "initialisation: target (target layers [3]" in card and "labels: soft" in card
    assert "auto: smallest N with held-out OOV share <= 1.0%" in card
    from runtime.train.state import load_trainer_state

    state = load_trainer_state(out / "checkpoint")
    assert state["config"]["distill"] == "soft" and state["config"]["soft_weight"] == 0.6
    bad = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "x"), "--steps", "1", "--draft-vocab", "lots"])
    assert bad.exit_code == 2 and "--draft-vocab" in bad.output


def test_cli_train_from_an_existing_drafter(tiny, tmp_path, monkeypatch):
    """--from-drafter fine-tunes an existing drafter: its weights are the starting point (the first
    validation loss is that drafter's, not a fresh one's), its architecture is kept, the draft
    vocabulary is chosen anew, and the card says where it came from. Bad sources exit 2."""
    _, target_dir, data_dir, _ = tiny
    base = ["train", "--target", str(target_dir), "--data", str(data_dir), "--no-eval", "--no-ood-eval"]
    base += ["--dtype", "float32", "--anchors", "8", "--eval-every", "1"]
    first = tmp_path / "first"
    args = [*base, "--out", str(first), "--taps", "1,3", "-b", "4", "--steps", "40", "--draft-vocab", "full"]
    monkeypatch.setattr(sys, "argv", ["dflash", *args])
    assert CliRunner().invoke(app, args).exit_code == 0
    from runtime.train.state import load_trainer_state

    def history(run):
        return load_trainer_state(run / "checkpoint")["state"]["history"]

    fresh_loss, trained_loss = history(first)[0]["val_loss"], history(first)[-1]["val_loss"]
    assert history(first)[0]["step"] == 0 and trained_loss < fresh_loss

    second = tmp_path / "second"
    args = [*base, "--out", str(second), "--from-drafter", str(first / "drafter"), "--steps", "2"]
    args += ["--draft-vocab", "auto", "--train-precision", "fp32"]
    monkeypatch.setattr(sys, "argv", ["dflash", *args])
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    start_loss = history(second)[0]["val_loss"]  # step 0: before any update
    assert load_trainer_state(second / "checkpoint")["config"]["bf16"] is False
    assert start_loss < (fresh_loss + trained_loss) / 2  # starts where the first run ended, not from scratch
    cfg = json.loads((second / "drafter" / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3] and cfg["block_size"] == 4
    assert cfg["dflash_training"]["init"]["kind"] == "drafter"
    assert "acceptance_conditional" not in cfg["dflash_config"] or cfg["dflash_training"].get("evaluation")
    card = (second / "drafter" / "README.md").read_text()
    assert "fine-tuned from the drafter `first/drafter`" in card

    # fine-tuning a drafter with a reduced vocabulary into a larger one keeps every source id
    def vocab_of(run, source, n):
        args = [*base, "--out", str(run), "--from-drafter", str(source / "drafter"), "--steps", "1"]
        r = CliRunner().invoke(app, [*args, "--draft-vocab", str(n)])
        assert r.exit_code == 0, r.output
        return set(load_file(str(run / "drafter" / "model.safetensors"))["draft_vocab_ids"].tolist())

    narrow = vocab_of(tmp_path / "narrow", first, 24)
    wider = vocab_of(tmp_path / "wider", tmp_path / "narrow", 36)  # the tiny data has ~40 distinct tokens
    assert len(narrow) == 24 and len(wider) == 36 and narrow < wider

    bad = CliRunner().invoke(
        app, [*base, "--out", str(tmp_path / "x"), "--from-drafter", str(tmp_path), "--steps", "1"]
    )
    assert bad.exit_code == 2 and "--from-drafter" in bad.output and "no config.json" in bad.output
    clash = [
        *base,
        "--out",
        str(tmp_path / "y"),
        "--from-drafter",
        str(first / "drafter"),
        "--taps",
        "1,2",
        "--steps",
        "1",
    ]
    bad = CliRunner().invoke(app, clash)
    assert bad.exit_code == 2 and "differs from --from-drafter" in bad.output


def test_cli_data_seed_draws_other_prompts(tiny, tmp_path):
    """--data-seed samples a new dataset's prompts with another seed (a second dataset for more
    breadth); the dataset records it, and extending it later keeps drawing with that seed."""
    from runtime.train.prompt_list import PROMPTS_FILE

    _, target_dir, _, _ = tiny
    base = ["train", "--target", str(target_dir), "--taps", "1,2,3", "--data-only", "--dtype", "float32"]
    base += ["--prompts", "8", "--gen-batch", "8", "--answer-tokens", "4"]
    texts = {}
    for seed in (0, 5):
        out = tmp_path / f"s{seed}"
        r = CliRunner().invoke(app, [*base, "--out", str(out), "--data-seed", str(seed)])
        assert r.exit_code == 0, r.output
        meta = json.loads((out / "data" / "dataset.json").read_text())
        assert meta["spec"]["seed"] == seed
        rows = (out / "data" / PROMPTS_FILE).read_text().splitlines()
        texts[seed] = [json.loads(line)["text"] for line in rows]
        assert len(texts[seed]) == 8
    assert set(texts[0]) != set(texts[5])


def test_grown_drafter_starts_as_its_source_then_trains(tiny, tmp_path):
    """--from-drafter with more --layers appends identity layers: before any update the grown
    drafter's hidden states (hence its drafts) equal the source's; training then uses the new
    layer, the card says so, and the grown drafter loads and runs. Fewer layers than the source's
    exits 2."""
    from runtime.train.model_init import grow_layers

    _, target_dir, data_dir, _ = tiny
    base = ["train", "--target", str(target_dir), "--data", str(data_dir), "--no-eval", "--no-ood-eval"]
    base += ["--dtype", "float32", "--anchors", "8", "--taps", "1,3", "-b", "4", "--draft-vocab", "full"]
    first = tmp_path / "first"
    assert CliRunner().invoke(app, [*base, "--out", str(first), "--steps", "20"]).exit_code == 0
    source = load_draft_model(first / "drafter", "cpu", torch.float32)
    grown = grow_layers(source, 3)
    assert len(grown.layers) == 3 and grown.config.num_hidden_layers == 3
    torch.manual_seed(0)
    ctx = torch.randn(1, 6, 2 * source.config.hidden_size)  # two taps
    noise = torch.randn(1, 4, source.config.hidden_size)
    with torch.no_grad():
        pos = torch.arange(10).unsqueeze(0)
        want = source(noise, source.fuse_context(ctx), pos)
        got = grown(noise, grown.fuse_context(ctx), pos)
    assert torch.allclose(want, got, atol=1e-6)

    second = tmp_path / "second"
    args = [*base, "--out", str(second), "--from-drafter", str(first / "drafter"), "--layers", "2", "--steps", "10"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    cfg = json.loads((second / "drafter" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and len(cfg["layer_types"]) == 2
    assert "grown from 1 to 2 layers" in (second / "drafter" / "README.md").read_text()
    trained = load_draft_model(second / "drafter", "cpu", torch.float32)
    assert trained.layers[1].self_attn.o_proj.weight.abs().sum() > 0  # the new layer learnt
    run = CliRunner().invoke(
        app, ["run", "--target", str(target_dir), "--drafter", str(second / "drafter"), "--raw", "-n", "8", "def"]
    )
    assert run.exit_code == 0, run.output
    fewer = [*base, "--out", str(tmp_path / "x"), "--from-drafter", str(second / "drafter"), "--layers", "1"]
    bad = CliRunner().invoke(app, [*fewer, "--steps", "1"])
    assert bad.exit_code == 2 and "a fine-tune can only add layers" in bad.output


def test_recorded_out_reads_the_last_command() -> None:
    from runtime.train.run_folder import recorded_out

    assert recorded_out(["dflash train --out runs/a --data d", "dflash train --out runs/a --eval-only"]) == "runs/a"
    assert recorded_out(["dflash train --out=runs/b"]) == "runs/b"
    assert recorded_out(["dflash train -o runs/c --steps 3"]) == "runs/c"
    assert recorded_out(["dflash train --data d"]) is None


def test_walk_follows_the_decoder_steps():
    from runtime.train.metrics import walk

    # anchors 10..19 of a 21-token sequence: a run of 2 at 10 commits 11, 12 and the target's 13;
    # 13 has a run of 0 -> 14; a run of 1 -> 16; the runs at 11, 12, 15 are never drafted
    runs = [2, 5, 5, 0, 1, 0, 3, 0, 0, 0]
    assert walk(runs, 10, 20) == [2, 0, 1, 3]  # 16 + 3 + 1 = 20: done
    assert walk([7] * 10, 10, 20) == [7, 1]  # the last step commits the answer's last two tokens


def test_tau_walk_predicts_the_chain_decoder(tiny, tmp_path):
    """tau_walk (teacher-forced drafts at every anchor, walked) equals the decoder's own tau on the
    same held-out answers: chain of the whole block, no lookup, float32."""
    from runtime import DecodeOptions

    pipe, _, data_dir, _ = tiny
    spec = DrafterSpec(num_layers=1, block_size=4, draft_vocab=0)
    cfg = TrainConfig(steps=150, lr=3e-3, anchors=16, eval_every=1000, checkpoint_every=1e9, seed=0, bf16=False)
    trainer = fit(pipe.target, pipe.tokenizer, data_dir, tmp_path, spec, cfg)
    val = trainer.validate()
    assert 1.0 < val["tau_walk"] < 4.0 and 0.0 <= val["walk_top1"] <= 1.0
    p = load_pipeline(
        ModelRef(target=str(pipe.pair.target_dir), drafter=str(tmp_path / "checkpoint")), RuntimeConfig(dtype="float32")
    )
    opts = DecodeOptions(verify_length=3, tree_budget=0, lookup=0, confidence_cut=False)
    steps = committed = 0
    data = trainer.val_data
    for i in range(min(16, len(data))):
        tokens, _, plen = data.get(i, 640)
        want = tokens[plen:].tolist()
        ev = list(p.stream(tokens[:plen].tolist(), SamplingParams(max_new_tokens=len(want)), opts))
        assert collect_ids(ev) == want  # the same text the walk was measured on
        steps += ev[-1].stats.verify_steps
        committed += ev[-1].stats.accepted_tokens + ev[-1].stats.verify_steps
    assert abs(committed / steps - val["tau_walk"]) < 0.02, (committed / steps, val["tau_walk"], val["tau_tf"])


def test_walk_anchor_sampling_trains_on_the_decoder_anchors(tiny, tmp_path):
    import random

    from runtime.train.batching import build_batch
    from runtime.train.metrics import walk_rows

    pipe, _, data_dir, _ = tiny
    tokens = torch.arange(20)
    feats = torch.zeros(20, 4)
    b = build_batch([(tokens, feats, 5)], 48, 4, 0, random.Random(0), candidates=[[5, 9, 14, 30]])
    assert b["block_ids"][0, ::4].tolist() == [5, 9, 14]  # only the candidates inside the answer
    # a window entered at its first anchor: 0 (run 2) -> 3 (run 0) -> 4 (run 1) -> 6; the second
    # sequence's window holds 3 anchors
    runs = torch.tensor([[2, 3, 3, 0, 1, 2, 0, 0], [0, 7, 0, 5, 5, 5, 5, 5]])
    anchored = torch.tensor([[True] * 8, [True] * 3 + [False] * 5])
    assert walk_rows(runs, anchored).long().tolist() == [[1, 0, 0, 1, 1, 0, 1, 1], [1, 1, 0, 0, 0, 0, 0, 0]]
    spec = DrafterSpec(num_layers=1, block_size=4, draft_vocab=0)
    cfg = TrainConfig(steps=60, lr=3e-3, anchors=16, eval_every=30, checkpoint_every=1e9, anchor_sampling="walk")
    trainer = fit(pipe.target, pipe.tokenizer, data_dir, tmp_path, spec, cfg)
    hist = trainer.state.history
    assert hist[-1]["val_loss"] < hist[0]["val_loss"]
    with pytest.raises(Exception, match="anchor_sampling"):
        TrainConfig(steps=1, anchor_sampling="random")
    res = CliRunner().invoke(
        app, ["train", "--out", str(tmp_path / "x"), "--steps", "1", "--anchor-sampling", "random"]
    )
    assert res.exit_code == 2 and "--anchor-sampling takes uniform or walk" in res.output
    assert not (tmp_path / "x").exists()
