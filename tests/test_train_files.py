"""The "files" prompt generator (`dflash train --file-requests`): requests for whole application
source files in every language, whose answers `--fim-from DATASET` cuts holes in."""

from __future__ import annotations

import json
from collections import Counter

from typer.testing import CliRunner

from dflash_cli.app import app
from runtime.train.dedupe import evaluation_index
from runtime.train.file_requests import MIX, SHAPES, build_file_requests
from tests.fakes import make_target, make_tokenizer, one_line


def test_requests_cover_every_language_in_its_share_and_name_a_fenced_file():
    prompts = build_file_requests(seed=3, max_prompts=200)
    assert len(prompts) == 200 and all(p.chat and p.source.startswith("file:") for p in prompts)
    counts = Counter(p.source.split(":")[1] for p in prompts)
    assert set(counts) == set(SHAPES)
    for lang, share in MIX.items():
        assert abs(counts[lang] / 200 - share) <= 0.02, (lang, counts[lang])
    for p in prompts:
        suffix, fence, _ = SHAPES[p.source.split(":")[1]]
        assert f"```{fence} " in p.text and suffix + "`" in p.text
    index = evaluation_index()
    assert not [p.text for p in prompts if index.matches(p.text)]


def test_a_language_repeats_no_topic_before_it_used_them_all():
    prompts = build_file_requests(seed=0, max_prompts=300)
    by_lang: dict[str, list[str]] = {}
    for p in prompts:
        _, lang, topic = p.source.split(":", 2)
        by_lang.setdefault(lang, []).append(topic)
    for topics in by_lang.values():
        assert len(set(topics)) == len(topics)


def test_the_seed_draws_other_requests():
    a, b = build_file_requests(seed=1, max_prompts=40), build_file_requests(seed=2, max_prompts=40)
    assert a == build_file_requests(seed=1, max_prompts=40)
    assert [p.text for p in a] != [p.text for p in b]


def test_cli_builds_a_files_dataset_and_refuses_other_generators_beside_it(tmp_path):
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    tok = make_tokenizer(target_dir)
    make_target("qwen3", vocab_size=len(tok) + 8, seed=0, eos_token_id=tok.eos_token_id).save_pretrained(
        str(target_dir)
    )
    base = ["train", "--target", str(target_dir), "--taps", "1", "--dtype", "float32", "--data-only"]
    out = tmp_path / "f"
    r = CliRunner().invoke(app, [*base, "--out", str(out), "--file-requests", "--prompts", "3", "--answer-tokens", "4"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in (out / "data" / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(row["source"].startswith("file:") and row["chat"] for row in rows)
    assert json.loads((out / "data-report.json").read_text())["generator"] == "files"
    r = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "x"), "--file-requests", "--self-instruct"])
    assert r.exit_code == 2 and "cannot be combined" in one_line(r.output)
