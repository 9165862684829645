"""The drafter's corpus table (``dflash_config.copy_corpus``, ``runtime.engine.models.corpus``): where the
context has no 2-token match, the copy inputs show what the target most often wrote after the last
tokens in the training answers. The table keeps the most frequent continuation seen at least twice;
training leaves a sequence and its near-duplicates out; the decoders and the trainer build the same
copy inputs; the table round-trips next to the weights; the output never changes; ``dflash train
--copy-corpus`` trains, resumes and exports it."""

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
from runtime.engine.models.corpus import CORPUS_FILE, CorpusCounts, CorpusTable, corpus_chain
from runtime.engine.models.drafter_io import load_draft_model, save_draft_model
from runtime.engine.models.drafter_surgery import add_copy_corpus, add_copy_inputs
from runtime.engine.models.target import TargetModel
from runtime.engine.ngram import NgramIndex, block_copies
from runtime.errors import ConfigError, ModelLoadError
from runtime.train.trainer import CorpusSource, build_batch
from tests.fakes import collect_ids, greedy_reference, make_drafter, make_target, pair_with_data

VOCAB = 48


def _counts(seqs, ngram=(2, 3)):
    c = CorpusCounts(ngram)
    for s in seqs:
        c.add(s, 1)
    return c


def test_table_keeps_the_most_frequent_continuation_seen_twice():
    # after (1, 2): 3 three times, 4 once; after (5, 6): 7 once only; after (8, 9): 10 and 11 twice each;
    # the level says how often the best continuation follows
    c = _counts([[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 4], [0, 5, 6, 7], [0, 8, 9, 11], [0, 8, 9, 11]])
    c.add([0, 8, 9, 10], 1)
    c.add([0, 8, 9, 10], 1)
    t = c.table()
    assert t.query(2, [1, 2]) == (3, 1)  # 3 of 4: level 1 (>= 1/2)
    assert t.query(2, [5, 6]) is None  # seen once
    assert t.query(2, [8, 9]) == (10, 1)  # a tie goes to the smaller id; 2 of 4 is half
    assert t.query(3, [0, 1, 2]) == (3, 1)
    c.add([0, 1, 2, 3], 1)
    assert c.table().query(2, [1, 2]) == (3, 2)  # 4 of 5: level 2 (>= 4/5)
    c.add([0, 1, 2, 4], 1)
    c.add([0, 1, 2, 5], 1)
    c.add([0, 1, 2, 5], 1)
    assert c.table().query(2, [1, 2]) == (3, 1)  # 4 of 8 is half
    c.add([0, 1, 2, 6], 1)
    assert c.table().query(2, [1, 2]) == (3, 0)  # 4 of 9: level 0
    # prompt tokens are context, never counted as continuations
    p = CorpusCounts((2, 2))
    p.add([1, 2, 3, 1, 2, 3], 3)
    p.add([1, 2, 3, 1, 2, 3], 3)
    assert p.table().query(2, [1, 2]) == (3, 2) and p.table().query(2, [2, 3]) == (1, 2)
    assert p.answer_tokens == 6


def test_scored_text_counts_the_targets_own_choice_after_the_texts_ngrams():
    """Teacher-forced text: the key is the text, the continuation is what the target would have
    written there (its label), not the text's next token; unlabelled positions (-1) are skipped."""
    c = CorpusCounts((2, 2))
    for _ in range(2):
        c.add([0, 1, 2, 3, 4], 1, labels=[1, 2, 7, -1])  # the target would write 7 after (1, 2)
    t = c.table()
    assert t.query(2, [1, 2]) == (7, 2)  # not the text's 3
    assert t.query(2, [2, 3]) is None  # label -1: nothing counted


def test_table_round_trips_through_its_file(tmp_path):
    c = _counts([[0, 1, 2, 3, 4]] * 2 + [[0, 7, 2, 3, 9]] * 3)
    t = c.table()
    t.save(tmp_path)
    back = CorpusTable.load(tmp_path, (2, 3))
    assert back.tables == t.tables and len(back) == len(t) > 0
    with pytest.raises(ValueError, match="4-grams"):
        CorpusTable.load(tmp_path, (2, 4))
    with pytest.raises(FileNotFoundError):
        CorpusTable.load(tmp_path / "none", (2, 3))


def test_training_leaves_a_sequence_and_its_near_duplicates_out():
    rng = random.Random(0)
    shared = [rng.randrange(1000, 2000) for _ in range(40)]  # code two sequences both hold
    a = [0, *shared, 5, 6, 7]
    b = [1, *shared, 8, 9]  # a near-duplicate of a
    common = [[0, 3, 4, 5], [1, 3, 4, 5]]  # (3, 4) -> 5 in two unrelated sequences
    c = _counts([a, b, *common])
    assert c.link_near_duplicates() > 0
    key = shared[10:12]
    assert c.query_for()(2, key) == (shared[12], 2)  # the whole corpus: a and b agree
    assert c.query_for(a)(2, key) is None  # a's own and b's n-grams left out: nobody else saw it
    assert c.query_for(common[0])(2, [3, 4]) is None  # one other sequence: seen once
    assert c.query_for([9, 9, 9])(2, [3, 4]) == (5, 2)  # not counted: nothing left out


def test_chain_follows_the_table_and_block_copies_prefer_a_two_token_context_match():
    t = _counts([[0, 1, 2, 3, 4, 5]] * 2).table()
    ids, rows = corpus_chain(t.query, [9, 1, 2], (2, 3), 5, 10)
    assert ids == [3, 4, 5] and rows == [12, 15, 15]  # the 2-gram (1, 2), then 3-grams; all level 2
    ids, rows = corpus_chain(t.query, [0, 1, 2], (2, 3), 2, 10)
    assert ids == [3, 4] and rows == [15, 15]  # 3-grams: row 10 + 3 * (3 - 2) + level
    # the context has (1, 2) -> 7 as a 2-gram match: the context's copy is shown
    index = NgramIndex(1, 4)
    index.extend([1, 2, 7, 1, 2])
    assert block_copies(index, 4, 99, t.query, (2, 3)) == ([99, 7, 1, 2], [0, 2, 2, 2])
    # only a 1-gram context match: the corpus chain, padded where it ends
    index = NgramIndex(1, 4)
    index.extend([9, 2, 8, 1, 2])
    # rows after the context's 0..4: 5 + 3 * (n - 2) + level
    assert block_copies(index, 6, 99, t.query, (2, 3)) == ([99, 3, 4, 5, 99, 99], [0, 7, 10, 10, 0, 0])
    # no corpus proposal: the context's 1-gram copy stays
    index = NgramIndex(1, 4)
    index.extend([9, 5, 8, 6, 5])
    assert block_copies(index, 4, 99, t.query, (2, 3)) == block_copies(index, 4, 99)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(4, 12))] for _ in range(n)]


@pytest.fixture(scope="module")
def pair():
    model = make_target("qwen3", vocab_size=VOCAB, seed=5)
    return model, TargetModel(model)


def _corpus_drafter(model, answers):
    d = add_copy_inputs(make_drafter(model.config, block_size=4, taps=[0, 2, 3]), (1, 4))
    counts = CorpusCounts((2, 3))
    for prompt, ids in answers:
        counts.add(prompt + ids, len(prompt))
        counts.add(prompt + ids, len(prompt))
    return add_copy_corpus(d, (2, 3), counts.table())


def _drafts(decoder, prompt, n=24):
    events = list(decoder.stream(prompt, SamplingParams(max_new_tokens=n)))
    return collect_ids(events), [e.draft for e in events if isinstance(e, BlockVerified)]


@pytest.mark.parametrize("decoder", ["dflash", "tree"])
def test_corpus_proposals_change_drafts_never_the_output(pair, decoder):
    """A corpus of the target's own answers makes a strong pointer draft them; the output stays
    the target's greedy output."""
    model, target = pair
    answers = [(p, greedy_reference(model, p, 24)) for p in _prompts(6, seed=7)]
    d = _corpus_drafter(model, answers)
    plain = add_copy_inputs(make_drafter(model.config, block_size=4, taps=[0, 2, 3]), (1, 4))
    with torch.no_grad():
        for m in (d, plain):
            m.copy_bias.fill_(1e4)

    def make(m):
        return tree_decoder(target, m, block_size=4) if decoder == "tree" else chain_decoder(target, m, block_size=4)

    changed = 0
    for p, ref in answers + [(p, greedy_reference(model, p, 24)) for p in _prompts(4, seed=8)]:
        ids, drafts = _drafts(make(d), p)
        assert ids == ref, p
        changed += drafts != _drafts(make(plain), p)[1]
    assert changed, "the corpus never changed a draft"


def test_decoder_and_trainer_build_the_same_corpus_copies(pair, monkeypatch):
    model, target = pair
    answers = [(p, greedy_reference(model, p, 24)) for p in _prompts(4, seed=9)]
    d = _corpus_drafter(model, answers)
    assert d.corpus is not None
    seen = []

    def recording(index, b, fill, *corpus, **kw):
        out = block_copies(index, b, fill, *corpus, **kw)
        seen.append((list(index.tokens), out))
        return out

    monkeypatch.setattr(propose_module, "block_copies", recording)
    dec = chain_decoder(target, d, block_size=4)
    for p, _ in answers:
        _drafts(dec, p)
    assert any(r > 4 for _, (_, rows) in seen for r in rows), "no corpus proposal was shown"
    for tokens, out in seen:  # what a fresh index and the table give
        fresh = NgramIndex(1, 4)
        fresh.extend(tokens)
        assert out == block_copies(fresh, 4, d.dflash.mask_token_id, d.corpus.query, (2, 3))
    # training: the same copies over the sequence up to each anchor
    prompt, ids = answers[0]
    seq = torch.tensor(prompt + ids)
    src = CorpusSource((2, 3), table=d.corpus)
    batch = build_batch(
        [(seq, torch.randn(seq.numel(), 8), len(prompt))], 8, 4, 99, random.Random(1), None, None, (1, 4), src
    )
    assert batch is not None
    pos = batch["positions"][0, seq.numel() - 1 :].view(-1, 4)[:, 0].tolist()
    anchors = batch["block_ids"][0].view(-1, 4)[:, 0].tolist()
    for j, (tok, a) in enumerate(zip(anchors, pos, strict=True)):
        if tok == 99:
            continue
        fresh = NgramIndex(1, 4)
        fresh.extend(seq[: a + 1].tolist())
        want = block_copies(fresh, 4, 99, d.corpus.query, (2, 3))
        assert (
            batch["copy_ids"][0, j * 4 : (j + 1) * 4].tolist(),
            batch["copy_n"][0, j * 4 : (j + 1) * 4].tolist(),
        ) == want


def test_corpus_round_trips_with_the_drafter_and_is_validated(pair, tmp_path):
    model, _ = pair
    d = _corpus_drafter(model, [([1, 2, 3], [4, 5, 6, 7])])
    assert d.copy_bias.shape[0] == 5 + 6  # rows 0..4 for context matches, 2 sizes x 3 confidence levels
    with torch.no_grad():
        d.copy_bias.copy_(torch.arange(11, dtype=torch.float32))
    save_draft_model(d, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["dflash_config"]["copy_corpus"] == [2, 3] and (tmp_path / "d" / CORPUS_FILE).exists()
    back = load_draft_model(tmp_path / "d", "cpu", torch.float32)
    assert back.dflash.copy_corpus == (2, 3) and torch.equal(back.copy_bias, d.copy_bias)
    assert back.corpus is not None and back.corpus.tables == d.corpus.tables
    with pytest.raises(ConfigError, match="corpus of \\[2, 3\\]"):
        add_copy_corpus(back, (2, 4), back.corpus)
    with pytest.raises(ConfigError, match="copy inputs"):
        add_copy_corpus(make_drafter(model.config, block_size=4, taps=[0, 2, 3]), (2, 3), back.corpus)
    (tmp_path / "d" / CORPUS_FILE).unlink()
    with pytest.raises(ModelLoadError, match="no corpus.safetensors"):
        load_draft_model(tmp_path / "d")
    (tmp_path / "d" / CORPUS_FILE).write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match="corrupt"):
        load_draft_model(tmp_path / "d")
    # a drafter saved without a corpus drops a stale corpus file from the folder
    save_draft_model(add_copy_inputs(make_drafter(model.config, block_size=4, taps=[0, 2, 3]), (1, 4)), tmp_path / "d")
    assert not (tmp_path / "d" / CORPUS_FILE).exists()


def test_new_corpus_rows_start_from_the_one_gram_row(pair):
    model, _ = pair
    d = add_copy_inputs(make_drafter(model.config, block_size=4, taps=[0, 2, 3]), (1, 4))
    with torch.no_grad():
        d.copy_bias.copy_(torch.arange(5, dtype=torch.float32))
        d.copy_scale.normal_()
    d = add_copy_corpus(d, (2, 3), CorpusTable((2, 3), {}))
    assert d.copy_bias.tolist() == [0, 1, 2, 3, 4, 1, 1, 1, 1, 1, 1]
    assert all(torch.equal(d.copy_scale[r], d.copy_scale[1]) for r in range(5, 11))


def test_cli_trains_resumes_and_exports_a_corpus(tmp_path, pair_data):
    """``dflash train --copy-corpus 2,3`` on a tiny target: the drafter ships its table, the card
    says so, a resume keeps it, and ``dflash run`` with it equals plain decoding."""
    target_dir, source, data = pair_data
    out = tmp_path / "run"
    base = ["train", "--target", str(target_dir), "--data", str(data), "--out", str(out), "--no-eval"]
    base += ["--no-ood-eval", "--dtype", "float32", "--anchors", "8", "--draft-vocab", "full"]
    flags = ["--from-drafter", str(source), "--copy-ngram", "1,4", "--copy-corpus", "2,3", "--steps", "20"]
    r = CliRunner().invoke(app, [*base, *flags, "--corpus-data", str(data)])  # counted twice: not trained on
    assert r.exit_code == 0, r.output
    d = load_draft_model(out / "drafter", "cpu", torch.float32)
    assert d.dflash.copy_corpus == (2, 3) and d.corpus is not None and len(d.corpus) > 0
    record = json.loads((out / "drafter" / "config.json").read_text())["dflash_training"]
    (where,) = record["corpus_datasets"]  # recorded without machine-specific paths
    assert where.endswith("data") and not where.startswith("/") and record["corpus"]["entries"] == len(d.corpus)
    assert "corpus table (corpus.safetensors" in (out / "drafter" / "README.md").read_text()
    resume = ["train", "--out", str(out), "--target", str(target_dir), "--data", str(data)]
    r = CliRunner().invoke(app, [*resume, "--no-eval", "--no-ood-eval", "--resume", "--extend", "--steps", "5"])
    assert r.exit_code == 0, r.output
    back = load_draft_model(out / "drafter", "cpu", torch.float32)
    assert back.dflash.copy_corpus == (2, 3) and back.corpus.tables == d.corpus.tables
    outs = []
    for extra in ([], ["--decoder", "ar"]):
        cmd = ["run", "--target", str(target_dir), "--drafter", str(out / "drafter"), "--raw", "-n", "24"]
        r = CliRunner().invoke(app, [*cmd, "--dtype", "float32", *extra, "def fib(n):"])
        assert r.exit_code == 0, r.output
        outs.append(r.stdout)
    assert outs[0] == outs[1]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--copy-corpus", "3,2"], "--copy-corpus needs 1 <= shortest"),
        (["--copy-corpus", "x"], "--copy-corpus takes SHORTEST,LONGEST"),
    ],
)
def test_cli_rejects_a_bad_corpus_before_loading_anything(tmp_path, flags, message):
    r = CliRunner().invoke(
        app, ["train", "--out", str(tmp_path / "run"), "--target", str(tmp_path / "none"), "--steps", "1", *flags]
    )
    assert r.exit_code == 2, r.output
    assert message in " ".join(r.output.split())
    assert not (tmp_path / "run").exists()


def test_cli_refuses_a_corpus_for_a_drafter_without_copy_inputs(tmp_path):
    target_dir, source, data = pair_with_data(tmp_path, num_prompts=8, max_new_tokens=16)
    cmd = ["train", "--target", str(target_dir), "--data", str(data), "--no-eval"]
    cmd += ["--no-ood-eval", "--from-drafter", str(source), "--steps", "2"]
    r = CliRunner().invoke(app, [*cmd, "--out", str(tmp_path / "run1"), "--copy-corpus", "2,3"])
    assert r.exit_code == 2, r.output
    assert "copy inputs" in " ".join(r.output.split())
    r = CliRunner().invoke(
        app, [*cmd, "--out", str(tmp_path / "run2"), "--copy-ngram", "1,4", "--corpus-data", str(data)]
    )
    assert r.exit_code == 2, r.output
    assert "--corpus-data fills a corpus table" in " ".join(r.output.split())
    assert not (tmp_path / "run2").exists()  # refused before anything was written
