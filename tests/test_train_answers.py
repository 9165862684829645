"""The "answers" prompt generator (requests on the code of a dataset's answers) and training on
several datasets at once (--extra-data)."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from dflash_cli.app import app
from runtime.train.answers import MIX, build_prompts_from_answers, code_blocks, read_answers
from tests.fakes import answered_dataset, make_tokenizer

GO = "func add(a int, b int) int {\n    if a < 0 {\n        return b\n    }\n    return a + b\n}"
RUST = "fn clamp(x: i32) -> i32 {\n    if x < 0 {\n        return 0;\n    }\n    x\n}"
PY = "def area(w, h):\n    if w <= 0:\n        return 0\n    total = w * h\n    return total"
REPLIES = [
    f"Here is the function:\n\n```go\n{GO}\n```\n\nIt adds.",
    f"```rust\n{RUST}\n```",
    f"Sure:\n\n```python\n{PY}\n```",
    "No code here, just words.",
    f"```py\n{PY.replace('area', 'size')}\n```",
    f"```golang\n{GO.replace('add', 'plus')}\n```",
]


def test_code_blocks_languages_and_sizes():
    text = (
        f"a\n```go\n{GO}\n```\nb\n```\nuntagged\nblock\nof\nlines\n```\n```ts\nx\n```\n```sh\n" + "echo 1\n" * 5 + "```"
    )
    blocks = code_blocks(text)
    assert [(b.lang, b.fence) for b in blocks] == [("Go", "go"), ("Bash", "bash")]  # untagged and 1-line dropped
    assert blocks[0].code == GO


def test_read_answers_realigns_prompts_and_keeps_the_held_out_shard_unseen(tmp_path):
    tok = make_tokenizer()
    data = answered_dataset(tmp_path / "d", tok, REPLIES)
    answers = read_answers(data, tok)
    assert len(answers) == 4  # 3 shards of 2; the last (held-out) one is not read
    assert [a.reply for a in answers] == REPLIES[:4]  # the decoded answers are the stored ones
    assert answers[1].messages == ({"role": "user", "content": "Write function number 1."},)
    assert answers[1].source == "task:Lang1"
    assert len(read_answers(data, tok, skip_last=False)) == 6


def test_prompts_from_answers_kinds_code_and_follow_ups(tmp_path):
    tok = make_tokenizer()
    answers = read_answers(answered_dataset(tmp_path / "d", tok, REPLIES * 3), tok, skip_last=False)
    prompts = build_prompts_from_answers(answers, seed=0, dedupe=False)
    kinds = {p.kind for p in prompts}
    assert kinds == set(MIX)
    for p in prompts:
        lang = p.source.split(":")[1]
        assert lang in ("Go", "Rust", "Python")
        if p.kind == "ans-follow-up":
            # the earlier assistant turn is the target's own reply, then a new request
            assert p.messages is not None and len(p.messages) == 3
            assert p.messages[1]["role"] == "assistant" and p.messages[1]["content"] in REPLIES
            assert p.messages[2]["content"] == p.text
        else:
            assert p.messages is None and "```" in p.text
    fixes = [p.text for p in prompts if p.kind == "ans-fix" and "bug" in p.text]
    assert fixes and all(GO not in t and RUST not in t and PY not in t for t in fixes)  # a bug was injected
    for p in (p for p in prompts if p.kind == "ans-port"):  # ported to another language
        lang = p.source.split(":")[1]
        first = p.text.split("\n")[0]
        m = re.match(r"(?:Port this|Translate the following) (.+) code (?:to|into idiomatic) (.+):$", first)
        assert m is not None and m.group(1) == lang and m.group(2) != lang
    # Python is at most ~30% of each kind while other languages last
    tests = [p for p in prompts if p.kind == "ans-tests"]
    head = tests[:6]
    assert sum(p.source.split(":")[1] == "Python" for p in head) <= 2
    assert build_prompts_from_answers(answers, seed=0, dedupe=False) == prompts  # deterministic
    assert build_prompts_from_answers(answers, seed=1, dedupe=False) != prompts
    assert len(build_prompts_from_answers(answers, seed=0, max_prompts=5, dedupe=False)) == 5


@pytest.fixture(scope="module")
def tiny(answers_data, tmp_path_factory):
    """The tiny pair's target, the shared dataset of its answers and a dataset of answered requests."""
    target_dir, data = answers_data
    tok = make_tokenizer()  # the tokenizer save_pair gives the target
    hidden = json.loads((target_dir / "config.json").read_text())["hidden_size"]
    src = answered_dataset(tmp_path_factory.mktemp("answers") / "src", tok, REPLIES * 2, hidden=hidden, taps=(1, 2, 3))
    return target_dir, data, src


def test_cli_builds_a_dataset_from_answers_and_trains_on_two_datasets(tiny, tmp_path):
    target_dir, v2_data, src = tiny
    base = ["train", "--target", str(target_dir), "--taps", "1,2,3", "--dtype", "float32"]
    out = tmp_path / "ans"
    r = CliRunner().invoke(
        app,
        [
            *base,
            "--out",
            str(out),
            "--data-only",
            "--prompts-from",
            str(src),
            "--prompts",
            "12",
            "--gen-batch",
            "6",
            "--answer-tokens",
            "6",
        ],
    )
    assert r.exit_code == 0, r.output
    meta = json.loads((out / "data" / "dataset.json").read_text())
    assert meta["spec"]["generator"] == "answers" and meta["spec"]["source"] == str(src)
    rows = [json.loads(line) for line in (out / "data" / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and all(r["source"].startswith("ans-") for r in rows)
    report = json.loads((out / "data-report.json").read_text())
    assert report["generator"] == "answers" and set(report["mix"]) <= set(MIX)

    run = tmp_path / "run"
    args = [*base, "--out", str(run), "--data", str(out / "data"), "--extra-data", str(v2_data)]
    args += ["--steps", "4", "--block-size", "4", "--anchors", "4", "--draft-vocab", "64", "--no-eval", "--no-ood-eval"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    cfg = json.loads((run / "drafter" / "config.json").read_text())
    (extra,) = cfg["dflash_training"]["extra_datasets"]
    assert extra.endswith("v2") and str(tmp_path) not in extra  # recorded, and portable
    card = (run / "drafter" / "README.md").read_text()
    assert card.count("answered prompts in") == 2  # both datasets' size and mix
    assert "Prompt generator answers" in card and "Prompt generator v2" in card


def test_cli_rejects_folders_that_are_not_datasets(tiny, tmp_path):
    target_dir, v2_data, _ = tiny
    base = ["train", "--target", str(target_dir), "--taps", "1,2,3", "--dtype", "float32", "--out", str(tmp_path / "x")]
    for flag in ("--prompts-from", "--extra-data"):
        r = CliRunner().invoke(app, [*base, "--data-only", flag, str(tmp_path / "missing")])
        assert r.exit_code == 2 and flag in r.output and "no dataset.json" in r.output
    assert not (tmp_path / "x").exists()  # nothing was created
