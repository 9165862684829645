"""Teacher-forced text datasets (generator "text", --text-from): real source files scored by the
target in one forward pass, labels = the target's argmax, deeper slots only while the text follows
the target."""

from __future__ import annotations

import json
import random

import pytest
import torch
from typer.testing import CliRunner

from dflash_cli.app import app
from runtime import ModelRef, RuntimeConfig, load_pipeline
from runtime.train.api import DataSpec, prepare_data
from runtime.train.data import dataset_summary, load_shard
from runtime.train.text import build_text_prompts, encode_text
from runtime.train.trainer import build_batch
from tests.fakes import one_line

SOURCES = {
    "pkg/util.py": "\n".join(f"def f{i}(x):\n    y = x + {i}\n    return y * 2\n" for i in range(12)),
    "web/app.js": "\n".join(f"function g{i}(a) {{\n  const b = a + {i};\n  return b;\n}}" for i in range(12)),
    "bin/run.sh": "\n".join(f'step{i}() {{\n  echo "step {i}"\n  sleep 1\n}}' for i in range(12)),
    "db/q.sql": "\n".join(f"SELECT id, name\nFROM t{i}\nWHERE id > {i};" for i in range(12)),
    "cmd/main.go": "\n".join(f"func h{i}(a int) int {{\n\treturn a + {i}\n}}" for i in range(12)),
}


def _sources(root):
    for rel, text in SOURCES.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text + "\n")
    return root


def test_text_prompts_cover_every_language_chat_and_raw(tmp_path):
    root = _sources(tmp_path / "src")
    prompts = build_text_prompts([root], seed=0, dedupe=False)
    langs = {p.source.split(":")[1] for p in prompts}
    assert langs == {"python", "javascript", "bash", "sql", "go"}  # one chunk per file
    for p in prompts:
        assert p.source.startswith(("text-chat:", "text-raw:"))
        assert (p.messages is not None) == p.chat == p.source.startswith("text-chat:")
        assert p.text.strip() in (root / next(r for r in SOURCES if r.endswith(p.source.split(":")[2]))).read_text()
    assert build_text_prompts([root], seed=0, dedupe=False) == prompts  # deterministic
    assert len(build_text_prompts([root], seed=0, max_prompts=2, dedupe=False)) == 2


def test_teacher_forced_blocks_stop_labelling_where_the_text_leaves_the_target():
    b, t = 4, 12
    tokens = torch.arange(100, 100 + t)
    tgt = tokens.clone()
    tgt[0] = -1  # context position
    tgt[6] = 7  # the target would have chosen 7 instead of the text's token 106
    feats = torch.zeros(t, 2)
    batch = build_batch([(tokens, feats, 1)], anchors=t, block_size=b, mask_id=0, rng=random.Random(0), targets=[tgt])
    assert batch is not None
    anchors = batch["block_ids"][0, ::b].tolist()
    labels = batch["labels"][0]
    for j, tok in enumerate(anchors):
        a = tok - 100
        want = []
        for k in range(1, b):
            ok = a + k < t and all(int(tokens[a + m]) == int(tgt[a + m]) for m in range(1, k))
            want.append(int(tgt[a + k]) if ok else -100)
        assert labels[j].tolist() == want, (a, labels[j].tolist(), want)
    # anchored at 4: slot 1 -> 105, slot 2 -> the target's 7 at position 6, slot 3 dropped (106 is not 7)
    j = anchors.index(104)
    assert labels[j].tolist() == [105, 7, -100]
    # without targets the tokens are the labels (generated answers)
    plain = build_batch([(tokens, feats, 1)], anchors=t, block_size=b, mask_id=0, rng=random.Random(0))
    assert plain is not None and plain["labels"][0, j].tolist() == [105, 106, 107]


@pytest.fixture(scope="module")
def tiny(answers_data, tmp_path_factory):
    """The tiny pair's target (loaded), the shared dataset of its answers and source files."""
    target_dir, v2 = answers_data
    pipe = load_pipeline(ModelRef(target=str(target_dir), drafter="none"), RuntimeConfig(dtype="float32"))
    return target_dir, pipe, v2, _sources(tmp_path_factory.mktemp("text") / "src")


def test_text_dataset_labels_are_the_targets_argmax_on_the_text(tiny, tmp_path):
    _, pipe, _, src = tiny
    data = tmp_path / "text"
    spec = DataSpec(num_prompts=5, max_new_tokens=40, batch_size=3, topk=4, generator="text", text_roots=(src,))
    prepare_data(pipe.target, pipe.tokenizer, data, [1, 2, 3], spec, pipe.stop_token_ids)
    meta = json.loads((data / "dataset.json").read_text())
    assert meta["labels"] == "teacher-forced" and meta["spec"]["generator"] == "text"
    shards = [load_shard(p) for p in sorted(data.glob("shard-*.safetensors"))]
    assert [s.num_sequences for s in shards] == [3, 2] and all(s.teacher_forced for s in shards)
    model = pipe.target.model
    checked = 0
    for s in shards:
        for j in range(s.num_sequences):
            a, b = int(s.offsets[j]), int(s.offsets[j + 1])
            ids, plen = s.tokens[a:b], int(s.prompt_len[j])
            with torch.no_grad():  # the sequence alone, unpadded
                logits = model(input_ids=ids[None]).logits[0].float()
            want = logits[plen - 1 : -1].argmax(-1)
            assert torch.equal(s.answer_labels(j), want)
            assert s.topk_ids.shape[1] == 4
            checked += 1
    assert checked == 5
    summary = dataset_summary(data)
    assert 0.0 <= summary["target_agreement"] <= 1.0
    assert set(summary["mix"]) == {"text-chat", "text-raw"} or set(summary["mix"]) <= {"text-chat", "text-raw"}
    # a chat chunk: the user turn and the code fence are context, the chunk is scored
    p = next(q for q in build_text_prompts([src], seed=0, dedupe=False) if q.chat)
    ids, plen = encode_text(pipe.tokenizer, p, 1000)
    assert pipe.tokenizer.decode(ids[plen:]) == p.text and "```" in pipe.tokenizer.decode(ids[:plen])


def test_cli_builds_a_text_dataset_and_trains_on_it_with_answers(tiny, tmp_path):
    target_dir, _, v2, src = tiny
    base = ["train", "--target", str(target_dir), "--taps", "1,2,3", "--dtype", "float32"]
    text = tmp_path / "txt"
    r = CliRunner().invoke(
        app, [*base, "--out", str(text), "--data-only", "--text-from", str(src), "--answer-tokens", "32"]
    )
    assert r.exit_code == 0, r.output
    assert "text chunks" in r.output and "agrees with it at" in r.output
    run = tmp_path / "run"
    args = [*base, "--out", str(run), "--data", str(v2), "--extra-data", str(text / "data"), "--distill", "soft"]
    args += ["--steps", "4", "--block-size", "4", "--anchors", "4", "--draft-vocab", "64", "--no-eval", "--no-ood-eval"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    card = (run / "drafter" / "README.md").read_text()
    assert "chunks of real source files" in card and "answered prompts in" in card


def test_cli_rejects_a_missing_text_folder(tiny, tmp_path, monkeypatch):
    target_dir, _, v2, _ = tiny
    monkeypatch.chdir(tmp_path)
    base = ["train", "--target", str(target_dir), "--dtype", "float32", "--out", "x", "--data-only"]
    r = CliRunner().invoke(app, [*base, "--text-from", "nope"])
    assert r.exit_code == 2 and "--text-from 'nope' is not a folder" in one_line(r.output)
    r = CliRunner().invoke(app, [*base, "--text-from", "auto", "--prompts-from", str(v2)])
    assert r.exit_code == 2 and "cannot be combined" in one_line(r.output)
    assert not (tmp_path / "x").exists()
