"""`dflash run`: the piping contract, exit codes and bad input (CliRunner, tiny models)."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from dflash_cli.app import app
from runtime.errors import ConfigError, IncompatibleDraftError, ModelLoadError, ModelNotFoundError
from tests.fakes import drafter_config_dict

runner = CliRunner()


def run(args, input=None):
    return runner.invoke(app, ["run", *args], input=input)


@pytest.fixture(scope="module")
def pair_args(tiny_pair):
    t, d = tiny_pair
    return ["--target", str(t), "--drafter", str(d), "--dtype", "float32", "-n", "12"]


@pytest.mark.parametrize("mode", ["argument", "stdin", "dash", "split"])
def test_prompt_sources_give_same_text(pair_args, mode):
    base = run([*pair_args, "--raw", "def fib(n):\n    return"], input="")
    assert base.exit_code == 0, base.output
    if mode == "argument":
        r = run([*pair_args, "--raw", "def fib(n):\n    return"], input="")
    elif mode == "stdin":
        r = run([*pair_args, "--raw"], input="def fib(n):\n    return")
    elif mode == "dash":
        r = run([*pair_args, "--raw", "-"], input="def fib(n):\n    return")
    else:  # stdin first, then the argument: a different prompt, still valid output
        r = run([*pair_args, "--raw", "return"], input="def fib(n):")
    assert r.exit_code == 0, r.output
    if mode != "split":
        assert r.stdout == base.stdout
    assert r.stdout and "dflash" not in r.stdout  # stdout carries only generated text


def test_stdout_is_pure_and_stats_go_to_stderr(pair_args):
    r = run([*pair_args, "--stats", "add two numbers"], input="")
    assert r.exit_code == 0, r.output
    assert "tok/s" in r.stderr and "tau" in r.stderr
    assert "tok/s" not in r.stdout


def test_json_event_lines(pair_args):
    r = run([*pair_args, "--json", "hello"], input="")
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert lines[0]["type"] == "prefill" and lines[-1]["type"] == "done"
    for line in lines[1:-1]:
        assert line["type"] == "block" and isinstance(line["draft"], list) and isinstance(line["accepted"], int)
        assert all(set(t) == {"id", "text", "status"} and t["status"] in ("accepted", "target") for t in line["tokens"])
    stats = lines[-1]["stats"]
    for key in ("generated_tokens", "tau", "tokens_per_second", "acceptance_histogram"):
        assert key in stats
    assert stats["generated_tokens"] == sum(len(x["tokens"]) for x in lines[:-1])


def test_decoder_ar_and_block_size_one_agree(pair_args):
    a = run([*pair_args, "--decoder", "ar", "--raw", "x = 1"], input="")
    b = run([*pair_args, "--block-size", "1", "--raw", "x = 1"], input="")
    c = run([*pair_args, "--raw", "x = 1"], input="")
    assert a.exit_code == b.exit_code == c.exit_code == 0
    assert a.stdout == b.stdout == c.stdout


def test_empty_prompt_is_a_usage_error(pair_args):
    r = run([*pair_args, "   "], input="")
    assert r.exit_code == ConfigError.exit_code
    assert "prompt is empty" in r.stderr and r.stdout == ""


def test_prompt_longer_than_context(pair_copy):
    t, d = pair_copy
    cfg = json.loads((t / "config.json").read_text())
    cfg["max_position_embeddings"] = 16
    (t / "config.json").write_text(json.dumps(cfg))
    r = run(["--target", str(t), "--drafter", str(d), "--raw", "word " * 40], input="")
    assert r.exit_code == 2 and "context is 16 tokens" in r.stderr
    assert "Traceback" not in r.output


def test_unknown_model_id_offline():
    r = run(["--target", "nobody/no-such-model", "--offline", "hi"], input="")
    assert r.exit_code == ModelNotFoundError.exit_code
    assert "nobody/no-such-model" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_unknown_preset():
    r = run(["--model", "gpt-7", "hi"], input="")
    assert r.exit_code == ModelNotFoundError.exit_code and "known presets" in r.stderr


@pytest.mark.parametrize("field,value,needle", [("hidden_size", 32, "hidden size"), ("vocab_size", 999, "vocab")])
def test_drafter_for_another_target(pair_copy, field, value, needle):
    t, d = pair_copy
    cfg = json.loads((d / "config.json").read_text())
    cfg[field] = value
    (d / "config.json").write_text(json.dumps(cfg))
    r = run(["--target", str(t), "--drafter", str(d), "hi"], input="")
    assert r.exit_code == IncompatibleDraftError.exit_code
    assert needle in r.stderr and "dflash train" in r.stderr


def test_drafter_layer_ids_beyond_target(pair_copy):
    t, d = pair_copy
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [1, 9]
    (d / "config.json").write_text(json.dumps(cfg))
    r = run(["--target", str(t), "--drafter", str(d), "hi"], input="")
    assert r.exit_code == IncompatibleDraftError.exit_code and "[9]" in r.stderr


@pytest.mark.parametrize("which", ["target", "drafter"])
def test_truncated_safetensors(pair_copy, which):
    t, d = pair_copy
    f = (t if which == "target" else d) / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    r = run(["--target", str(t), "--drafter", str(d), "hi"], input="")
    assert r.exit_code == ModelLoadError.exit_code, r.output
    assert "corrupt" in r.stderr or "truncated" in r.stderr


@pytest.mark.parametrize("which", ["target", "drafter"])
def test_missing_safetensors(pair_copy, which):
    t, d = pair_copy
    ((t if which == "target" else d) / "model.safetensors").unlink()
    r = run(["--target", str(t), "--drafter", str(d), "hi"], input="")
    assert r.exit_code == ModelLoadError.exit_code and "safetensors" in r.stderr


def test_missing_folder_and_drafter_without_target(tmp_path):
    r = run(["--target", str(tmp_path / "nope"), "hi"], input="")
    assert r.exit_code == ModelNotFoundError.exit_code
    r = run(["--drafter", str(tmp_path), "hi"], input="")
    assert r.exit_code == ConfigError.exit_code and "--target" in r.stderr


def test_prompt_ids_out_of_vocab(fixture_dir):
    r = run(
        ["--target", str(fixture_dir / "target"), "--drafter", str(fixture_dir / "drafter"), "--prompt-ids", "1,2,99"],
        input="",
    )
    assert r.exit_code == 2 and "prompt ids" in r.stderr


def test_bad_option_values():
    assert run(["--temperature", "-1", "x"], input="").exit_code == 2
    r = run(["--prompt-ids", "a,b", "x"], input="")
    assert r.exit_code == 2


def test_stop_string_cuts_output(pair_args):
    full = run([*pair_args, "--raw", "-n", "30", "def"], input="")
    assert full.exit_code == 0
    text = full.stdout
    assert len(text) > 6, text  # enough text to cut (the tiny pair answers 30 tokens)
    stop = text[3:6]
    r = run([*pair_args, "--raw", "-n", "30", "--stop", stop, "def"], input="")
    assert r.exit_code == 0 and r.stdout == text[: text.index(stop)]


def test_fixture_drafter_copy_with_top_level_keys(tmp_path, fixture_dir):
    d = tmp_path / "drafter"
    shutil.copytree(fixture_dir / "drafter", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(cfg.pop("dflash_config"))
    (d / "config.json").write_text(json.dumps(cfg))
    ids = "8,16,9,21,9,1,14,8,10,5,10,3"
    a = run(["--target", str(fixture_dir / "target"), "--drafter", str(d), "--prompt-ids", ids, "-n", "20"], input="")
    b = run(
        [
            "--target",
            str(fixture_dir / "target"),
            "--drafter",
            str(fixture_dir / "drafter"),
            "--prompt-ids",
            ids,
            "-n",
            "20",
        ],
        input="",
    )
    assert a.exit_code == 0 and a.stdout == b.stdout
    assert drafter_config_dict  # fakes importable


def test_conflicting_flags_are_a_usage_error():
    r = run(["--raw", "--chat", "x"], input="")
    assert r.exit_code == 2 and "exclude each other" in r.output


def test_unsupported_architecture_names_it():
    import torch.nn as nn

    from runtime.engine.models.target import TargetModel
    from runtime.errors import UnsupportedModelError

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"architectures": ["OddForCausalLM"], "num_hidden_layers": 3})()
            self.blocks = nn.Sequential(nn.Linear(2, 2))

    with pytest.raises(UnsupportedModelError, match="OddForCausalLM"):
        TargetModel(Odd())


def test_chat_mode_turns_thinking_off(pair_copy):
    """Qwen3-style templates get enable_thinking=False (the published drafters were trained without it)."""
    from runtime import ModelRef, RuntimeConfig, load_pipeline

    t, d = pair_copy
    cfg = json.loads((t / "tokenizer_config.json").read_text())
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}NOTHINK{% endif %}"
    )
    (t / "chat_template.jinja").write_text(template)
    cfg.pop("chat_template", None)
    (t / "tokenizer_config.json").write_text(json.dumps(cfg))
    pipe = load_pipeline(ModelRef(target=str(t), drafter=str(d)), RuntimeConfig(dtype="float32"))
    assert pipe.is_chat_model
    text = pipe.tokenizer.decode(pipe.encode("hi"))
    assert text.endswith("NOTHINK") and "hi" in text
    raw = pipe.tokenizer.decode(pipe.encode("hi", chat=False))
    assert raw == "hi"


def test_ctrl_c_keeps_partial_output_and_exits_130(pair_copy):
    """A real process: SIGINT mid-generation stops after the current step, exit code 130."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from tests.fakes import make_target

    t, d = pair_copy
    model = make_target(
        "qwen3", vocab_size=json.loads((t / "config.json").read_text())["vocab_size"], max_position_embeddings=40000
    )
    model.config.eos_token_id = None
    model.save_pretrained(str(t))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dflash_cli",
            "run",
            "--target",
            str(t),
            "--drafter",
            str(d),
            "--raw",
            "-n",
            "30000",
            "--json",
            "def",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    first = proc.stdout.readline()  # the prefill event: generation is under way
    assert json.loads(first)["type"] == "prefill"
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    lines = [json.loads(x) for x in rest.splitlines()]
    assert proc.returncode == 130, err
    assert lines[-1]["type"] == "done" and lines[-1]["reason"] == "cancelled"
    assert 0 < lines[-1]["stats"]["generated_tokens"] < 30000
    assert "interrupted" in err


# -- fill in the middle (--suffix) ----------------------------------------------------------------
@pytest.fixture(scope="module")
def fim_pair_args(fim_pair):
    t, d = fim_pair
    return ["--target", str(t), "--drafter", str(d), "--dtype", "float32", "-n", "8"], t


def test_suffix_fills_the_middle_with_the_fim_prompt(fim_pair_args, tmp_path):
    from runtime import fim
    from tests.fakes import make_tokenizer

    args, target = fim_pair_args
    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    r = run([*args, "--json", "--suffix", suffix, prefix], input="")
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert lines[0]["type"] == "prefill" and lines[-1]["type"] == "done"  # events as without --suffix
    tok = make_tokenizer(fim="qwen")
    assert lines[0]["prompt_tokens"] == len(fim.build(tok, prefix, suffix).ids)
    (tmp_path / "after.py").write_text(suffix)
    from_file = run([*args, "--json", "--suffix", f"@{tmp_path / 'after.py'}"], input=prefix)  # prefix on stdin
    assert from_file.exit_code == 0, from_file.output

    def ids(out):
        return [t["id"] for x in out.splitlines() for t in json.loads(x).get("tokens", [])]

    assert ids(from_file.stdout) == ids(r.stdout)


def test_suffix_file_missing_is_exit_2(fim_pair_args, tmp_path):
    from tests.fakes import one_line_error

    r = run([*fim_pair_args[0], "--suffix", f"@{tmp_path / 'nope.py'}", "x = "], input="")
    one_line_error(r, 2, "nope.py", "does not exist")


def test_suffix_without_fim_tokens_is_exit_2(pair_args):
    from tests.fakes import one_line_error

    r = run([*pair_args, "--suffix", "b = 2\n", "a = 1\n"], input="")
    one_line_error(r, 2, "declares no fill-in-the-middle tokens")


def test_suffix_excludes_chat(fim_pair_args):
    from tests.fakes import one_line as fake_one_line

    r = run([*fim_pair_args[0], "--chat", "--suffix", "b", "a"], input="")
    assert r.exit_code == 2 and "exclude each other" in fake_one_line(r.output)
