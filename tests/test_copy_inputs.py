"""Drafter copy inputs (``dflash_config.copy_ngram``): each slot of a drafted block is also shown the
token a context n-gram lookup proposes for it. Zero-initialised inputs draft exactly as before;
trained (here: large random) ones change the drafts but never the output; training builds the
same proposals the decoders compute; the key round-trips through save/load and ``dflash train
--copy-inputs`` trains, resumes and exports them."""

from __future__ import annotations

import json
import random

import pytest
import torch
from typer.testing import CliRunner

from dflash_cli.app import app
from runtime.config import SamplingParams
from runtime.engine import chain_decoder, tree_decoder
from runtime.engine import propose as propose_module
from runtime.engine.events import BlockVerified
from runtime.engine.models.drafter_io import load_draft_model, save_draft_model
from runtime.engine.models.drafter_surgery import add_copy_inputs
from runtime.engine.models.target import TargetModel
from runtime.engine.ngram import NgramIndex, block_copies
from runtime.errors import ConfigError, ModelLoadError
from runtime.train.trainer import build_batch
from tests.fakes import collect_ids, greedy_reference, make_drafter, make_target

VOCAB = 48  # a small vocabulary: random targets repeat themselves, so the lookup finds matches


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 5))]
        out.append((motif * 4)[: rng.randint(6, 20)])  # repeated motifs: the context has n-grams to copy
    return out


def _drafts(decoder, prompt, n=24):
    events = list(decoder.stream(prompt, SamplingParams(max_new_tokens=n)))
    return collect_ids(events), [e.draft for e in events if isinstance(e, BlockVerified)]


@pytest.fixture(scope="module")
def pair():
    model = make_target("qwen3", vocab_size=VOCAB, seed=3)
    return model, TargetModel(model)


def test_zero_initialised_copy_inputs_draft_exactly_as_before(pair):
    model, target = pair
    plain = make_drafter(model.config, block_size=4, taps=[0, 2, 3])
    copy = add_copy_inputs(make_drafter(model.config, block_size=4, taps=[0, 2, 3]), (1, 4))
    assert copy.copy_scale is not None and not copy.copy_scale.any()
    for p in _prompts(6):
        want = _drafts(chain_decoder(target, plain, block_size=4), p)
        assert _drafts(chain_decoder(target, copy, block_size=4), p) == want


@pytest.mark.parametrize("decoder", ["dflash", "tree"])
def test_trained_copy_inputs_change_drafts_never_the_output(pair, decoder):
    model, target = pair
    plain = make_drafter(model.config, block_size=4, taps=[0, 2, 3])
    copy = add_copy_inputs(make_drafter(model.config, block_size=4, taps=[0, 2, 3]), (1, 4))
    with torch.no_grad():
        copy.copy_scale.copy_(torch.randn_like(copy.copy_scale) * 50)

    def make(d):
        return tree_decoder(target, d, block_size=4) if decoder == "tree" else chain_decoder(target, d, block_size=4)

    changed = 0
    for p in _prompts(8, seed=1):
        ref = greedy_reference(model, p, 24)
        ids, drafts = _drafts(make(copy), p)
        assert ids == ref, p  # lossless in float32
        changed += drafts != _drafts(make(plain), p)[1]
    assert changed, "the copy inputs never changed a draft"


def _pointer_drafter(model, bias: float):
    """A copy-input drafter with a reduced draft vocabulary (even ids only) and ``bias`` on its pointer."""
    d = add_copy_inputs(make_drafter(model.config, block_size=4, taps=[0, 2, 3]), (1, 4))
    d.draft_vocab_ids = torch.arange(0, VOCAB, 2)
    with torch.no_grad():
        d.copy_bias.fill_(bias)
    return d


def test_a_strong_pointer_drafts_the_lookups_proposal_even_outside_the_draft_vocab(pair, monkeypatch):
    """With a large ``copy_bias`` each drafted slot with a match is the lookup's proposal, odd ids
    (outside the reduced vocabulary, scored from the full head) included; without a match the
    draft stays inside the draft vocabulary."""
    model, target = pair
    seen = []

    def recording(index, b, fill, **kw):
        out = block_copies(index, b, fill, **kw)
        seen.append(out)
        return out

    monkeypatch.setattr(propose_module, "block_copies", recording)
    dec = chain_decoder(target, _pointer_drafter(model, 1e4), block_size=4)
    outside = matched_steps = 0
    for p in _prompts(6, seed=4):
        seen.clear()
        events = list(dec.stream(p, SamplingParams(max_new_tokens=24)))
        drafts = [e.draft for e in events if isinstance(e, BlockVerified) and e.draft]  # k = 0 drafts nothing
        assert len(drafts) == len(seen)
        for draft, (ids, matched) in zip(drafts, seen, strict=True):
            if matched[1]:
                assert list(draft) == ids[1 : 1 + len(draft)]
                matched_steps += 1
                outside += any(t % 2 for t in draft)
            else:
                assert all(t % 2 == 0 for t in draft)
    assert matched_steps and outside, "the test never drafted a proposal outside the draft vocabulary"


@pytest.mark.parametrize("decoder", ["dflash", "tree"])
@pytest.mark.parametrize("bias", [3.0, 1e4])
def test_the_pointer_never_changes_the_output(pair, decoder, bias):
    model, target = pair
    d = _pointer_drafter(model, bias)

    def make():
        return tree_decoder(target, d, block_size=4) if decoder == "tree" else chain_decoder(target, d, block_size=4)

    for p in _prompts(6, seed=5):
        assert _drafts(make(), p)[0] == greedy_reference(model, p, 24), p


def test_trainer_points_at_proposals_and_learns_their_bias(pair):
    """The trainer's loss gives each proposal its n-gram's bias, scores proposals outside the draft
    vocabulary from the full head (a label only such a proposal names becomes trainable), and
    gradient steps move ``copy_bias``."""
    from runtime.train.trainer import TrainConfig, Trainer

    model, _ = pair
    d = _pointer_drafter(model, 0.0)
    embed = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings().weight.detach()
    seq = torch.tensor(([3, 8, 5, 12, 7] * 12)[:56])  # a repeated motif with odd (out-of-vocab) ids
    feats = torch.randn(56, 3 * model.config.hidden_size)
    batch = build_batch([(seq, feats, 6)], 12, 4, d.dflash.mask_token_id, random.Random(1), copy_ngram=(1, 4))
    assert batch is not None
    tr = Trainer(d, embed, head, None, None, TrainConfig(steps=1, bf16=False), "unused", "cpu")
    labels = batch["labels"]
    target = tr.vocab.map(labels).view(-1)
    rows = torch.randn(target.numel(), model.config.hidden_size)
    args, extra_ids, mapped = tr._pointer(batch, rows, target, labels)
    cid = batch["copy_ids"].view(-1, 4)[:, 1:].reshape(-1)
    has = batch["copy_n"].view(-1, 4)[:, 1:].reshape(-1) > 0
    odd = has & (cid % 2 == 1)
    assert odd.any() and torch.equal(extra_ids, cid)
    assert torch.isfinite(args["extra"]).eq(odd).all()
    torch.testing.assert_close(args["extra"][odd], (rows[odd] * head[cid[odd]]).sum(-1))  # bias 0 yet
    named = odd & (labels.view(-1) == cid)
    assert named.any() and (mapped[named] == tr.head.shape[0]).all()
    assert torch.equal(mapped[~named], target[~named])
    before = d.copy_bias.detach().clone()
    loss, _ = tr._forward(batch)
    loss.backward()
    tr.opt.step()
    assert not torch.equal(d.copy_bias.detach(), before)


def test_decoder_copies_are_the_lookup_over_everything_committed(pair, monkeypatch):
    """The decoder's incrementally extended index proposes what a fresh index over the prompt and
    the committed tokens (ending with the block's anchor) proposes."""
    model, target = pair
    copy = add_copy_inputs(make_drafter(model.config, block_size=4, taps=[0, 2, 3]), (1, 4))
    seen = []

    def recording(index, b, fill, **kw):
        out = block_copies(index, b, fill, **kw)
        seen.append((list(index.tokens), out))
        return out

    monkeypatch.setattr(propose_module, "block_copies", recording)
    dec = chain_decoder(target, copy, block_size=4)
    for p in _prompts(4, seed=2):
        seen.clear()
        ids, _ = _drafts(dec, p)
        full = p + ids
        assert seen
        for tokens, out in seen:
            assert tokens == full[: len(tokens)] and len(tokens) > len(p)  # prompt + committed
            fresh = NgramIndex(1, 4)
            fresh.extend(tokens)
            assert out == block_copies(fresh, 4, copy.dflash.mask_token_id)
        assert any(m for _, (_, matched) in seen for m in matched)


def test_training_batches_carry_the_decoders_copies():
    rng = random.Random(0)
    seq = torch.tensor([rng.randrange(12) for _ in range(60)])
    feats = torch.randn(60, 8)
    b, mask = 4, 99
    batch = build_batch([(seq, feats, 10)], 6, b, mask, random.Random(1), copy_ngram=(1, 4))
    assert batch is not None
    anchors = batch["block_ids"][0].view(-1, b)[:, 0].tolist()
    pos = batch["positions"][0, seq.numel() - 1 :].view(-1, b)[:, 0].tolist()  # block positions: anchor index
    checked = 0
    for j, (a_tok, a) in enumerate(zip(anchors, pos, strict=True)):
        if a_tok == mask:  # padding
            continue
        assert int(seq[a]) == a_tok
        index = NgramIndex(1, 4)
        index.extend(seq[: a + 1].tolist())
        ids, matched = block_copies(index, b, mask)
        assert batch["copy_ids"][0, j * b : (j + 1) * b].tolist() == ids
        assert batch["copy_n"][0, j * b : (j + 1) * b].tolist() == matched
        checked += 1
    assert checked >= 3
    assert "copy_ids" not in build_batch([(seq, feats, 10)], 6, b, mask, random.Random(1))


def test_copy_ngram_round_trips_and_is_validated(pair, tmp_path):
    model, _ = pair
    d = add_copy_inputs(make_drafter(model.config, block_size=4, taps=[0, 2, 3]), (2, 3))
    with torch.no_grad():
        d.copy_scale.copy_(torch.arange(d.copy_scale.numel(), dtype=torch.float32).view_as(d.copy_scale))
    save_draft_model(d, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["dflash_config"]["copy_ngram"] == [2, 3]
    back = load_draft_model(tmp_path / "d", "cpu", torch.float32)
    assert back.dflash.copy_ngram == (2, 3) and torch.equal(back.copy_scale, d.copy_scale)
    assert add_copy_inputs(back, (2, 3)) is back
    with pytest.raises(ConfigError, match="copy inputs for \\[2, 3\\]"):
        add_copy_inputs(back, (1, 4))
    with pytest.raises(ConfigError, match="copy_ngram"):
        add_copy_inputs(make_drafter(model.config, block_size=4, taps=[0, 2, 3]), (3, 2))
    cfg["dflash_config"]["copy_ngram"] = 4
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="copy_ngram"):
        load_draft_model(tmp_path / "d")


@pytest.mark.parametrize(
    ("flags", "ngram"), [(["--copy-inputs"], (1, 4)), (["--copy-ngram", "2,6", "--copy-lr", "0.02"], (2, 6))]
)
def test_cli_trains_resumes_and_exports_copy_inputs(tmp_path, flags, ngram, pair_data):
    """``dflash train --copy-inputs`` (or ``--copy-ngram``) on a tiny target: the exported drafter has
    trained copy scales, the card says so, a resume keeps them, and the drafter runs losslessly in
    ``dflash run``."""
    target_dir, source, data = pair_data
    out = tmp_path / "run"
    base = ["train", "--target", str(target_dir), "--data", str(data), "--out", str(out), "--no-eval"]
    base += ["--no-ood-eval", "--dtype", "float32", "--anchors", "8", "--draft-vocab", "full"]
    r = CliRunner().invoke(app, [*base, "--from-drafter", str(source), *flags, "--steps", "30"])
    assert r.exit_code == 0, r.output
    d = load_draft_model(out / "drafter", "cpu", torch.float32)
    assert d.dflash.copy_ngram == ngram and d.copy_scale is not None and d.copy_scale[ngram[0] :].abs().sum() > 0
    card = (out / "drafter" / "README.md").read_text()
    assert f"copy inputs: each slot also sees the token a {ngram[0]}-{ngram[1]}-gram lookup" in card
    r = CliRunner().invoke(
        app,
        [
            "train",
            "--out",
            str(out),
            "--target",
            str(target_dir),
            "--data",
            str(data),
            "--no-eval",
            "--no-ood-eval",
            "--resume",
            "--extend",
            "--steps",
            "5",
        ],
    )
    assert r.exit_code == 0, r.output
    resumed = load_draft_model(out / "drafter", "cpu", torch.float32)
    assert resumed.dflash.copy_ngram == ngram and not torch.equal(resumed.copy_scale, d.copy_scale)
    prompt = "def fib(n):"
    runs = [
        CliRunner().invoke(
            app,
            [
                "run",
                "--target",
                str(target_dir),
                "--drafter",
                str(out / "drafter"),
                "--raw",
                "-n",
                "24",
                "--dtype",
                "float32",
                *extra,
                prompt,
            ],
        )
        for extra in ([], ["--decoder", "ar"])
    ]
    assert runs[0].exit_code == 0 and runs[1].exit_code == 0, runs[0].output + runs[1].output
    assert runs[0].stdout == runs[1].stdout


@pytest.mark.parametrize("copy_lr", [None, 5e-2])
def test_copy_inputs_learn_at_their_own_rate(pair, copy_lr):
    """``TrainConfig.copy_lr`` (``--copy-lr``) is the copy inputs' peak rate on the run's schedule;
    by default 100 x ``lr``; the drafter's layers keep ``lr``. A bad value is a ConfigError."""
    from runtime.train.trainer import COPY_LR_SCALE, TrainConfig, Trainer

    model, _ = pair
    d = _pointer_drafter(model, 0.0)
    embed = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings().weight.detach()
    cfg = TrainConfig(steps=10, bf16=False, lr=1e-4, copy_lr=copy_lr, warmup=0.0)
    seq, feats = torch.tensor([3, 8, 5, 12] * 10), torch.randn(40, 3 * model.config.hidden_size)

    class OneSequence:  # the trainer's view of a dataset, with one sequence
        has_topk = False

        def __len__(self):
            return 1

        def get(self, i, max_len):
            return seq, feats, 4

        def get_topk(self, i, max_len):
            return None

        def get_labels(self, i, max_len):
            return None

    tr = Trainer(d, embed, head, OneSequence(), None, cfg, "unused", "cpu")
    tr.step()
    rates = {id(p): g["lr"] for g in tr.opt.param_groups for p in g["params"]}
    body = rates[id(next(d.layers.parameters()))]
    want = (copy_lr if copy_lr is not None else COPY_LR_SCALE * 1e-4) / 1e-4
    assert rates[id(d.copy_bias)] == pytest.approx(body * want)
    assert rates[id(d.copy_scale)] == pytest.approx(body * want)
    with pytest.raises(ConfigError, match="copy_lr"):
        TrainConfig(steps=1, copy_lr=0.0)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("4,1", "1 <= shortest <= longest <= 16"),
        ("0,3", "1 <= shortest"),
        ("1-4", "SHORTEST,LONGEST"),
        ("2", "SHORTEST"),
    ],
)
def test_cli_rejects_bad_copy_ngram_before_loading_anything(tmp_path, value, message):
    r = CliRunner().invoke(
        app,
        [
            "train",
            "--out",
            str(tmp_path / "run"),
            "--target",
            str(tmp_path / "none"),
            "--steps",
            "1",
            "--copy-ngram",
            value,
        ],
    )
    assert r.exit_code == 2, r.output
    assert message in " ".join(r.output.split())
    assert not (tmp_path / "run").exists()  # nothing written
