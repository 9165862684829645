"""The "self" prompt generator: requests written by the target itself (self-instruct)."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from dflash_cli.app import app
from runtime.train.dedupe import evaluation_index
from runtime.train.selfinstruct import (
    HEADER,
    SEEDS,
    SELF_LANGUAGES,
    SHOTS,
    TASKS,
    clean_request,
    meta_prompt,
    plan_slots,
    sample_requests,
)
from tests.fakes import make_target, make_tokenizer, one_line

WRITE = next(t for t in TASKS if not t.code)
FIX = next(t for t in TASKS if t.key == "fix")


def test_no_example_request_is_an_evaluation_prompt():
    index = evaluation_index()
    assert [text[:60] for _, _, text in SEEDS if index.matches(text)] == []
    keys = {t.key for t in TASKS}
    assert all(lang in SELF_LANGUAGES and key in keys for lang, key, _ in SEEDS)


def test_meta_prompt_ends_with_the_header_of_the_request_to_write():
    page = meta_prompt("Rust", FIX, "a trie", random.Random(0))
    assert page.endswith(HEADER.format(lang="Rust", task=FIX.header, topic="a trie"))
    assert page.count("### Request (") == SHOTS + 1  # the examples, then the one to write


def test_clean_request_keeps_requests_and_drops_answers_and_broken_ones():
    req = "Why does this loop never end?\n\n```go\nfor i := 0; i < 3; {\n}\n```"
    assert clean_request(req + "\n\n### Request (Go, fix, topic: x)\nmore", FIX) == req
    assert clean_request("Sure! Here is the code you asked for: ...", WRITE) is None  # an answer
    assert clean_request("Fix this:\n\n```go\nfor {", FIX) is None  # unfinished code block
    assert clean_request("Please fix my function that never returns anything", FIX) is None  # no code pasted
    assert clean_request("too short", WRITE) is None
    assert clean_request("Write a Go function that merges two sorted slices of ints.", WRITE) is not None


def test_slots_cover_every_language_and_task():
    n = len(SELF_LANGUAGES) * len(TASKS)
    slots = plan_slots(n, seed=0)
    assert {(s.lang, s.task.key) for s in slots} == {(lang, t.key) for lang in SELF_LANGUAGES for t in TASKS}
    assert plan_slots(n, seed=0) == slots and plan_slots(n, seed=1) != slots


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    target_dir = tmp_path_factory.mktemp("self") / "target"
    target_dir.mkdir()
    tok = make_tokenizer(target_dir)
    model = make_target("qwen3", vocab_size=len(tok) + 8, seed=0, eos_token_id=tok.eos_token_id)
    model.save_pretrained(str(target_dir))
    return target_dir, tok, model


def test_sampling_is_seeded_and_labels_each_request_with_its_slot(tiny):
    _, tok, model = tiny
    slots = [s for s in plan_slots(40, seed=0) if not s.task.code][:6]
    side = tok.padding_side
    first = sample_requests(model, tok, slots, seed=3, batch_size=4, max_new_tokens=24)
    assert first == sample_requests(model, tok, slots, seed=3, batch_size=4, max_new_tokens=24)
    assert first and all(p.chat and p.kind.startswith("self-") for p in first)
    assert tok.padding_side == side  # restored


def test_cli_builds_a_dataset_on_requests_the_target_wrote(tiny, tmp_path):
    target_dir, _, _ = tiny
    out = tmp_path / "run"
    args = ["train", "--target", str(target_dir), "--taps", "1,2,3", "--dtype", "float32", "--out", str(out)]
    args += ["--data-only", "--self-instruct", "--prompts", "20", "--gen-batch", "10", "--answer-tokens", "6"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "requests written" in r.output
    meta = json.loads((out / "data" / "dataset.json").read_text())
    assert meta["spec"]["generator"] == "self"
    rows = [json.loads(line) for line in (out / "data" / "prompts.jsonl").read_text().splitlines()]
    assert 0 < len(rows) <= 20 and all(r["source"].startswith("self-") and r["chat"] for r in rows)
    report = json.loads((out / "data-report.json").read_text())
    assert report["generator"] == "self" and all(k.startswith("self-") for k in report["mix"])

    # reopened (to train on it, or by a rerun of the same command): nothing is sampled again
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert "requests written" not in again.output
    assert (out / "data" / "prompts.jsonl").read_text().splitlines() == [json.dumps(r) for r in rows]


def test_self_instruct_does_not_combine_with_other_generators(tiny, tmp_path):
    target_dir, _, _ = tiny
    args = ["train", "--target", str(target_dir), "--out", str(tmp_path / "x"), "--data-only"]
    r = CliRunner().invoke(app, [*args, "--self-instruct", "--text-from", str(tmp_path)])
    assert r.exit_code == 2 and "cannot be combined" in one_line(r.output)


def test_an_interrupted_sampling_resumes_from_its_journal(tiny, tmp_path):
    _, tok, model = tiny
    slots = [s for s in plan_slots(60, seed=0) if not s.task.code][:6]
    whole = sample_requests(model, tok, slots, seed=2, batch_size=2, max_new_tokens=16)
    journal = tmp_path / "self-requests.jsonl"
    sample_requests(model, tok, slots[:4], seed=2, batch_size=2, max_new_tokens=16, journal=journal)
    assert len(journal.read_text().splitlines()) == 2  # two batches finished, then "interrupted"
    with journal.open("a") as f:
        f.write('{"key": "torn')  # a line cut short by a kill

    calls = 0
    generate = model.generate

    def counting(*a, **k):
        nonlocal calls
        calls += 1
        return generate(*a, **k)

    model.generate = counting
    try:
        resumed = sample_requests(model, tok, slots, seed=2, batch_size=2, max_new_tokens=16, journal=journal)
    finally:
        del model.generate
    assert calls == 1 and resumed == whole  # only the last batch is sampled again, same result
