"""`dflash bench` on tiny models: every method runs, greedy methods agree with ar, the JSON schema,
history/compare, --limit, pitfall warnings and bad input (CliRunner; exit codes and streams)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_cli.app import app
from runtime.errors import ConfigError, IncompatibleDraftError, InputError
from tests.fakes import CHATML, make_target, make_tokenizer

runner = CliRunner()
THINKING_CHATML = "{% if enable_thinking %}<think>{% endif %}" + CHATML
PROMPTS = ["def add(a, b):", "for i in range(10):", "class Stack:"]


def bench(*args: str, input: str | None = None):
    return runner.invoke(app, ["bench", *args], input=input)


@pytest.fixture(scope="module")
def models(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny target + drafter (trained-length metadata of 24 tokens), a same-tokenizer assistant and
    a model with another tokenizer."""
    root = tmp_path_factory.mktemp("bench-models")
    target, drafter = shutil.copytree(tiny_pair[0], root / "target"), shutil.copytree(tiny_pair[1], root / "drafter")
    cfg = json.loads((drafter / "config.json").read_text())
    cfg["training"] = {"max_len": 24, "dtype": "bfloat16"}
    (drafter / "config.json").write_text(json.dumps(cfg))
    (target / "chat_template.jinja").write_text(THINKING_CHATML)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]

    assistant = root / "assistant"
    assistant.mkdir()
    for f in target.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, assistant / f.name)
    make_target(vocab_size=vocab, seed=7, layers=1).save_pretrained(str(assistant))

    other = root / "other-tokenizer"
    other.mkdir()
    tok = make_tokenizer(other, vocab_size=300)
    make_target(vocab_size=len(tok) + 8, seed=3, layers=1).save_pretrained(str(other))
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return {"target": target, "drafter": drafter, "assistant": assistant, "other": other, "prompts": prompts}


def pair_args(models: dict[str, Path]) -> list[str]:
    return [
        "--target",
        str(models["target"]),
        "--drafter",
        str(models["drafter"]),
        "--dtype",
        "float32",
        "--device",
        "cpu",
    ]


def test_every_method_runs_and_greedy_methods_agree(models):
    r = bench(
        *pair_args(models),
        "--prompts",
        str(models["prompts"]),
        "-n",
        "10",
        "--assistant",
        str(models["assistant"]),
        "--block-size",
        "2,4",
        "--tokens",
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout.strip().splitlines()[-1])  # stdout is the JSON document, nothing else
    assert len(r.stdout.strip().splitlines()) == 1
    names = [m["name"] for m in doc["methods"]]
    assert names == ["ar", "hf", "pld", "assisted", "dflash-b2", "dflash-b4"]
    ar = doc["methods"][0]
    for m in doc["methods"]:
        assert len(m["runs"]) == len(PROMPTS)
        assert all(run["new_tokens"] == 10 for run in m["runs"])  # fixed-length runs
        assert m["tokens_per_second"]["median"] > 0
        if m["name"] != "ar":  # greedy in float32: every method reproduces ar token for token
            assert m["agreement"] == {"prompts": 3, "identical": 3, "first_divergence": None}
            assert [run["tokens"] for run in m["runs"]] == [run["tokens"] for run in ar["runs"]]
    b4 = doc["methods"][-1]
    assert b4["block_size"] == 4 and b4["verify_lengths"] == [3, 3, 3]
    assert len(b4["per_position_acceptance"]) == 3 and len(b4["acceptance_histogram"]) == 4
    steps = sum(run["steps"] for run in b4["runs"])
    assert sum(b4["acceptance_histogram"]) == steps
    assert sum(run["drafted"] for run in b4["runs"]) > 0
    # the table on stderr names every row and the columns of the issue
    for col in ("model", "draft", "method", "t/s ± sd", "TTFT", "tau", "accept %", "speedup"):
        assert col in r.stderr
    for label in ("| ar ", "| hf ", "| pld ", "| assisted ", "dflash b2 (verify 1)", "dflash b4 (verify 3)"):
        assert label in r.stderr


def test_default_dflash_records_the_runtime_verify_length_and_json_schema(models):
    r = bench(*pair_args(models), "--prompts", str(models["prompts"]), "-n", "8", "--methods", "dflash")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["schema"] == "dflash.bench/1" and isinstance(doc["run_id"], int)
    env = doc["environment"]
    for key in ("device", "device_name", "cpu", "gpu", "dtype", "torch", "transformers", "python", "threads"):
        assert key in env
    assert env["device"] == "cpu" and env["dtype"] == "float32"
    assert env["target"]["id"] == str(models["target"]) and "revision" in env["target"]
    assert env["drafter"]["id"] == str(models["drafter"])
    assert doc["config"]["max_new_tokens"] == 8 and doc["config"]["methods"] == ["dflash"]
    assert doc["dataset"]["count"] == 3 and doc["dataset"]["prompt_ids"][0] == "prompts.txt:1"
    assert [m["name"] for m in doc["methods"]] == ["ar", "dflash"]  # ar always runs: it is the baseline
    d = doc["methods"][1]
    assert d["block_size"] == 4  # the drafter's own block
    # the runtime picks a chain (its verify length) or a draft tree (its budget) from costs measured
    # on this machine at this moment: on a busy machine drafting may not pay (verify length 0)
    assert len(d["verify_lengths"]) == 3 and all(0 <= v <= 3 for v in d["verify_lengths"])
    assert (f"(verify {d['verify_lengths'][0]}" in d["label"] or " tree" in d["label"]) and d["label"] in r.stderr
    for key in (
        "tokens_per_second",
        "ttft_seconds",
        "tpot_seconds",
        "speedup",
        "tau",
        "acceptance_rate",
        "per_position_acceptance",
        "acceptance_histogram",
        "peak_memory_bytes",
        "agreement",
        "runs",
    ):
        assert key in d
    assert set(d["tokens_per_second"]) == {"median", "mean", "stdev", "min", "max"}
    assert doc["methods"][0]["speedup"] == 1.0
    assert "tokens" not in d["runs"][0]  # token ids only with --tokens
    # prompts of up to 24 tokens + 8 new run past the drafter's recorded training length of 24
    assert "context-beyond-training" in {w["code"] for w in doc["warnings"]}
    assert "beyond the 24 tokens" in r.stderr and "fix:" in r.stderr


def test_limit_dataset_and_csv_md_formats(models):
    r = bench(*pair_args(models), "--dataset", "humaneval", "--limit", "2", "-n", "4", "--methods", "ar", "-f", "csv")
    assert r.exit_code == 0, r.output
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("run_id,target,draft,method")
    assert len(lines) == 2 and ",ar," in lines[1] and lines[1].endswith(",2")  # one row, 2 prompts
    assert "humaneval (2 prompts x 4 new tokens" in r.stderr
    r = bench(*pair_args(models), "--dataset", "mbpp", "--limit", "1", "-n", "4", "--methods", "ar", "-f", "md")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("| model") and "| ar " in r.stdout


def test_history_and_compare(models):
    base = [*pair_args(models), "--prompts", str(models["prompts"]), "-n", "6", "--methods", "ar,hf", "--chat"]
    a = bench(*base, "--label", "before")
    b = bench(*base, "--thinking")
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    id_a, id_b = json.loads(a.stdout)["run_id"], json.loads(b.stdout)["run_id"]
    assert id_b == id_a + 1
    h = bench("history")
    assert h.exit_code == 0, h.output
    lines = h.stdout.strip().splitlines()
    assert lines[0].startswith("| run") and len(lines) == 4  # header, rule, two runs
    assert lines[2].split("|")[1].strip() == str(id_b) and "before" in lines[3]  # newest first
    hj = json.loads(bench("history", "--format", "json").stdout)
    assert [r["id"] for r in hj] == [id_b, id_a] and set(hj[0]["methods"]) == {"ar", "hf"}
    c = bench("compare", str(id_a), str(id_b))
    assert c.exit_code == 0, c.output
    assert f"t/s #{id_a}" in c.stdout and f"t/s #{id_b}" in c.stdout
    assert "| ar " in c.stdout and "| hf " in c.stdout and "%" in c.stdout
    cj = json.loads(bench("compare", "prev", "last", "--format", "json").stdout)
    assert (cj["a"], cj["b"]) == (id_a, id_b)
    tok_a = json.loads(a.stdout)["methods"][0]["tokens_per_second"]["median"]
    assert cj["methods"][0]["tok_s_a"] == pytest.approx(tok_a)
    missing = bench("compare", str(id_a), "999")
    assert missing.exit_code == InputError.exit_code and "no bench run 999" in missing.stderr
    # the template's thinking switch was on in run b, and the drafter was not trained with it
    assert "thinking-mode" not in {w["code"] for w in json.loads(a.stdout)["warnings"]}
    assert "thinking mode is on" not in b.stderr  # no dflash row ran, so no drafter warning


def test_thinking_mode_warning(models):
    r = bench(*pair_args(models), "--prompts", str(models["prompts"]), "-n", "4", "--methods", "dflash", "--thinking")
    assert r.exit_code == 0, r.output
    assert "thinking-mode" in {w["code"] for w in json.loads(r.stdout)["warnings"]}
    assert "thinking mode is on" in r.stderr


def test_history_when_empty():
    r = bench("history")
    assert r.exit_code == 0 and r.stdout == "" and "no bench runs" in r.stderr
    r = bench("compare", "1", "2")
    assert r.exit_code == InputError.exit_code and "dflash bench" in r.stderr


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--dataset", "nope"], ConfigError.exit_code, "unknown dataset 'nope'"),
        (["--methods", "ar,turbo"], ConfigError.exit_code, "unknown bench method 'turbo'"),
        (["--methods", "assisted"], ConfigError.exit_code, "pass --assistant"),
        (["--block-size", "4,x"], ConfigError.exit_code, "block sizes"),
        (["--block-size", "1"], ConfigError.exit_code, "block size 1 is the ar row"),
        (["--limit", "0"], ConfigError.exit_code, "--limit must be >= 1"),
        (["--prompts", "/nonexistent/p.txt"], InputError.exit_code, "does not exist"),
    ],
)
def test_bad_options_fail_before_loading(models, args, code, message):
    r = bench("--target", "/nonexistent/target", *args)  # the model is never reached
    assert r.exit_code == code, r.output
    assert message in r.stderr and r.stdout == ""
    assert "Traceback" not in r.output


@pytest.mark.parametrize("content", ["", "\n  \n\n", '{"prompt": "   "}\n'])
def test_empty_prompt_file(models, tmp_path, content):
    f = tmp_path / ("p.jsonl" if content.startswith("{") else "p.txt")
    f.write_text(content)
    r = bench(*pair_args(models), "--prompts", str(f))
    assert r.exit_code == InputError.exit_code
    assert "has no prompts" in r.stderr and r.stdout == ""


def test_invalid_jsonl_names_the_line(models, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{not json}\n')
    r = bench(*pair_args(models), "--prompts", str(f))
    assert r.exit_code == InputError.exit_code and "line 2" in r.stderr


def test_assistant_with_another_tokenizer_is_refused(models):
    r = bench(*pair_args(models), "--prompts", str(models["prompts"]), "--assistant", str(models["other"]))
    assert r.exit_code == IncompatibleDraftError.exit_code, r.output
    assert "different tokenizer" in r.stderr and str(models["other"]) in r.stderr
    assert r.stdout == ""
    assert bench("history").stdout == ""  # nothing was stored


def test_no_drafter_skips_dflash_or_refuses_it(models):
    args = ["--target", str(models["target"]), "--drafter", "none", "--dtype", "float32", "--device", "cpu"]
    r = bench(*args, "--prompts", str(models["prompts"]), "-n", "4", "--methods", "ar,dflash")
    assert r.exit_code == ConfigError.exit_code and "no drafter" in r.stderr
    r = bench(*args, "--prompts", str(models["prompts"]), "-n", "4")
    assert r.exit_code == 0, r.output
    assert [m["name"] for m in json.loads(r.stdout)["methods"]] == ["ar", "hf", "pld"]
    assert "skipping the dflash rows" in r.stderr


def test_results_survive_an_unwritable_history(models, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("DFLASH_HOME", str(blocker))  # the state dir cannot be created under a file
    r = bench(*pair_args(models), "--prompts", str(models["prompts"]), "-n", "4", "--methods", "ar")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["run_id"] is None and doc["methods"][0]["name"] == "ar"
    assert "this run was not stored" in r.stderr and "| ar " in r.stderr


def test_sampling_runs_without_the_greedy_check(models):
    r = bench(*pair_args(models), "--prompts", str(models["prompts"]), "-n", "5", "-t", "0.8", "--methods", "hf,dflash")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["config"]["temperature"] == 0.8
    assert [m["agreement"] for m in doc["methods"]] == [None, None, None]
    assert all(run["new_tokens"] == 5 for m in doc["methods"] for run in m["runs"])
    assert "temperature 0.8" in r.stderr
