"""`dflash train --fim-from`: holes cut from real source files as editors cut them, answered by the
target in its own FIM layout (runtime.train.fim_prompts, generator "fim")."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from dflash_cli.app import app
from runtime import ModelRef, RuntimeConfig, fim, load_pipeline
from runtime.bench.fim_cases import load_fim_cases
from runtime.train.api import DataSpec, prepare_data
from runtime.train.data import load_shard
from runtime.train.dedupe import evaluation_index
from runtime.train.fim_prompts import CUTS, build_fim_prompts, cut_file
from tests.fakes import answered_dataset, make_tokenizer, one_line

PY = "\n".join(
    f'def f{i}(x, y):\n    """Add {i}."""\n    total = x + y + {i}\n    if total > 10:\n        return total * 2\n'
    f"    return total\n"
    for i in range(8)
)
C = "\n".join(
    f"static int g{i}(int a, int b) {{\n    int c = a + b + {i};\n    if (c > 10) {{\n        c = c * 2;\n    }}\n"
    f"    return c;\n}}\n"
    for i in range(8)
)


@pytest.mark.parametrize("lang,text", [("python", PY), ("c", C)])
@pytest.mark.parametrize("cut", CUTS)
def test_every_cut_splits_the_file_at_the_cursor(lang, text, cut):
    """prefix + middle + suffix is a window of the file, and each cut has its shape."""
    seen = 0
    for seed in range(20):
        parts = cut_file(text, random.Random(seed), lang, cut)
        if parts is None:
            continue
        prefix, middle, suffix = parts
        assert prefix + middle + suffix in text and middle.strip()
        if cut == "line":  # the rest of one line, the cursor after something typed on it
            assert "\n" not in middle and suffix.startswith("\n") and not prefix.endswith("\n")
        else:  # whole lines from the cursor (at the first line's indentation) to a line end
            assert middle.endswith("\n") and prefix.endswith((" ", "\n"))
            assert middle.count("\n") >= (2 if cut == "lines" else 1)
        if cut == "body" and lang == "python":  # below the docstring, up to the next def
            assert prefix.rstrip().endswith('."""') and not middle.lstrip().startswith("def ")
        if cut == "body" and lang == "c":
            assert prefix.rstrip().endswith("{") and suffix.startswith("}")
        seen += 1
    assert seen >= 10


def test_windows_cut_at_line_boundaries():
    text = "\n".join(f"line_{i} = {i} * 3  # some padding text" for i in range(200)) + "\n"
    for seed in range(10):
        parts = cut_file(text, random.Random(seed), "python", "lines", prefix_chars=300, suffix_chars=200)
        assert parts is not None
        prefix, _, suffix = parts
        assert len(prefix) <= 300 and prefix.startswith("line_")
        assert len(suffix) <= 200 and (suffix.endswith("\n") or not suffix)


def test_fim_prompts_are_the_targets_layout_and_skip_control_tokens(tmp_path):
    tok = make_tokenizer(fim="qwen")
    (tmp_path / "a.py").write_text(PY)
    (tmp_path / "b.c").write_text(C)
    (tmp_path / "c.py").write_text(PY.replace("Add", "<|endoftext|> Add"))  # would end the prompt early
    prompts = build_fim_prompts([tmp_path], tok, seed=1, dedupe=False)
    assert {p.source.split(":")[3] for p in prompts} <= {"a.py", "b.c"} and len(prompts) == 2
    for p in prompts:
        kind, lang, cut, _ = p.source.split(":")
        assert kind == "fim" and cut in CUTS and lang in ("python", "c") and not p.chat
        assert p.text.startswith("<|fim_prefix|>") and p.text.endswith("<|fim_middle|>")
        prefix, suffix = p.text[len("<|fim_prefix|>") : -len("<|fim_middle|>")].split("<|fim_suffix|>")
        # the raw prompt tokenises to exactly what `dflash run --suffix` and /infill send
        assert tok.encode(p.text, add_special_tokens=True) == fim.build(tok, prefix, suffix).ids
    assert build_fim_prompts([tmp_path], tok, seed=1, dedupe=False) == prompts  # deterministic


def test_the_fim_bench_cases_are_evaluation_text():
    index = evaluation_index()
    case = load_fim_cases()[0]
    assert index.matches(case.prefix + case.middle + case.suffix)


GO = "\n".join(
    f"func add{i}(a int, b int) int {{\n\tif a < {i} {{\n\t\treturn b\n\t}}\n\treturn a + b + {i}\n}}\n"
    for i in range(4)
)


def test_holes_are_cut_from_the_code_the_target_wrote_in_a_datasets_answers(tmp_path):
    """A dataset folder as a --fim-from root: one hole per fenced code block of 12+ lines in its
    answers (prose, short blocks and the held-out last shard left out), the block's language kept."""
    tok = make_tokenizer(fim="qwen")
    short = "\n".join(PY.split("\n")[:6])
    replies = [
        f"Here it is:\n\n```go\n{GO}\n```\n\nDone.",
        f"```python\n{PY}\n```\nand a second one:\n```c\n{C}\n```",
        f"```python\n{short}\n```",  # too short to cut a hole in
        "No code, only words.",
        f"```python\n{PY.replace('Add', 'Held out')}\n```",  # the held-out shard
        "Still held out.",
    ]
    data = answered_dataset(tmp_path / "d", tok, replies)
    prompts = build_fim_prompts([data], tok, seed=3, dedupe=False)
    assert sorted(p.source.split(":", 2)[1] for p in prompts) == ["c", "go", "python"]
    assert {p.source.split(":")[-1] for p in prompts} == {"Lang0#0", "Lang1#0", "Lang1#1"}
    for p in prompts:
        assert "Held out" not in p.text and "Here it is" not in p.text
        prefix, suffix = p.text[len("<|fim_prefix|>") : -len("<|fim_middle|>")].split("<|fim_suffix|>")
        code = {"go": GO, "python": PY, "c": C}[p.source.split(":")[1]]
        assert prefix in code and suffix in code + "\n"


@pytest.fixture(scope="module")
def fim_target(fim_pair, tmp_path_factory):
    target_dir, _ = fim_pair
    pipe = load_pipeline(ModelRef(target=str(target_dir), drafter="none"), RuntimeConfig(dtype="float32"))
    src = tmp_path_factory.mktemp("fimsrc")
    py, c = "\n".join(PY.split("\n")[:19]), "\n".join(C.split("\n")[:24])  # prompts within the tiny target's 512
    for i in range(10):
        (src / f"m{i}.py").write_text(py.replace("total", f"total{i}"))
        (src / f"m{i}.c").write_text(c.replace("int c", f"int c{i}"))
    return target_dir, pipe, src


def test_a_fim_dataset_holds_the_targets_middles(fim_target, tmp_path):
    _, pipe, src = fim_target
    data = tmp_path / "fim"
    spec = DataSpec(num_prompts=6, max_new_tokens=12, batch_size=4, generator="fim", text_roots=(src,))
    prepare_data(pipe.target, pipe.tokenizer, data, [1, 2, 3], spec, pipe.stop_token_ids)
    meta = json.loads((data / "dataset.json").read_text())
    assert meta["spec"]["generator"] == "fim"
    fmt = fim.require(pipe.tokenizer)
    shards = [load_shard(p) for p in sorted(data.glob("shard-*.safetensors"))]
    assert sum(s.num_sequences for s in shards) == 6
    for s in shards:
        for j in range(s.num_sequences):
            a, b = int(s.offsets[j]), int(s.offsets[j + 1])
            ids, plen = s.tokens[a:b].tolist(), int(s.prompt_len[j])
            assert ids[plen - 1] == fmt.middle and fmt.prefix in ids[:plen] and fmt.suffix in ids[:plen]
            answer = ids[plen:]
            # a middle ends at its first end-of-middle token (the family's, not only the chat EOS)
            stops = [i for i, t in enumerate(answer) if t in fmt.stop_ids]
            assert not stops or stops[0] == len(answer) - 1


def test_cli_builds_a_fim_dataset_and_rejects_bad_folders(fim_target, tmp_path, monkeypatch):
    target_dir, _, src = fim_target
    base = ["train", "--target", str(target_dir), "--taps", "1,2,3", "--dtype", "float32", "--data-only"]
    out = tmp_path / "f"
    r = CliRunner().invoke(
        app, [*base, "--out", str(out), "--fim-from", str(src), "--prompts", "4", "--answer-tokens", "8"]
    )
    assert r.exit_code == 0, r.output
    assert json.loads((out / "data-report.json").read_text())["generator"] == "fim"
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, [*base, "--out", "x", "--fim-from", "nope"])
    assert r.exit_code == 2 and "--fim-from 'nope' is not a folder" in one_line(r.output)
    r = CliRunner().invoke(app, [*base, "--out", "x", "--fim-from", str(src), "--text-from", str(src)])
    assert r.exit_code == 2 and "cannot be combined" in one_line(r.output)
    r = CliRunner().invoke(app, [*base, "--out", "x", "--text-from", str(out / "data")])
    assert r.exit_code == 2 and "is a dataset folder (--fim-from cuts holes in its answers)" in one_line(r.output)
