"""`dflash serve --engine vllm|sglang`: the engine commands, and running them (fake engines)."""

from __future__ import annotations

import json
import os
import shlex
import socket
import stat
import sys

import pytest
from typer.testing import CliRunner

from dflash_cli.app import app

runner = CliRunner()

VLLM_QWEN3_8B = (
    "vllm serve Qwen/Qwen3-8B --host 127.0.0.1 --port 8000 --tensor-parallel-size 1 "
    '--speculative-config \'{"method": "dflash", "model": "z-lab/Qwen3-8B-DFlash-b16", "num_speculative_tokens": 15}\' '
    "--per-request-spec-decode-metrics summary "
    "--default-chat-template-kwargs '{\"enable_thinking\": false}'"
)
SGLANG_QWEN3_8B = (
    "python -m sglang.launch_server --model-path Qwen/Qwen3-8B --host 127.0.0.1 --port 30000 --tp-size 1 "
    "--speculative-algorithm DFLASH --speculative-draft-model-path z-lab/Qwen3-8B-DFlash-b16 "
    "--speculative-num-draft-tokens 16 "
    "--default-chat-template-kwargs '{\"enable_thinking\": false}'"
)


def serve(*args):
    return runner.invoke(app, ["serve", *args])


@pytest.mark.parametrize("engine,expected", [("vllm", VLLM_QWEN3_8B), ("sglang", SGLANG_QWEN3_8B)])
def test_print_command_for_the_qwen3_8b_preset(engine, expected):
    r = serve("--engine", engine, "-m", "qwen3-8b", "--print-command")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == expected and r.stderr == ""


def test_parallelism_port_draft_tokens_and_extra_arguments():
    r = serve(
        "--engine",
        "vllm",
        "-m",
        "qwen3-8b",
        "-tp",
        "4",
        "--port",
        "9000",
        "--draft-tokens",
        "7",
        "--print-command",
        "--",
        "--max-model-len",
        "8192",
    )
    argv = shlex.split(r.stdout)
    assert r.exit_code == 0
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4" and argv[argv.index("--port") + 1] == "9000"
    assert json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"] == 7
    assert argv[-2:] == ["--max-model-len", "8192"]
    r = serve("--engine", "sglang", "-m", "qwen3-8b", "-tp", "2", "--draft-tokens", "7", "--print-command")
    argv = shlex.split(r.stdout)
    assert argv[argv.index("--tp-size") + 1] == "2" and argv[argv.index("--speculative-num-draft-tokens") + 1] == "8"


def test_block_size_of_a_local_drafter_folder(tiny_pair):
    t, d = tiny_pair
    r = serve("--engine", "vllm", "--target", str(t), "--drafter", str(d), "--print-command")
    spec = json.loads(shlex.split(r.stdout)[shlex.split(r.stdout).index("--speculative-config") + 1])
    assert r.exit_code == 0 and spec == {"method": "dflash", "model": str(d), "num_speculative_tokens": 3}
    assert "--default-chat-template-kwargs" not in r.stdout


def test_unknown_block_size_needs_a_flag_for_vllm_only():
    r = serve("--engine", "vllm", "-m", "llama3.1-8b", "--print-command")
    assert r.exit_code == 2 and "--block-size" in r.stderr and r.stdout == ""
    r = serve("--engine", "vllm", "-m", "llama3.1-8b", "--block-size", "10", "--print-command")
    assert r.exit_code == 0 and '"num_speculative_tokens": 9' in r.stdout
    r = serve("--engine", "sglang", "-m", "llama3.1-8b", "--print-command")  # SGLang reads the drafter config
    assert r.exit_code == 0 and "--speculative-num-draft-tokens" not in r.stdout


@pytest.mark.parametrize(
    "args,code,message",
    [
        (["-m", "qwen2.5-coder-0.5b"], 2, "local engine only"),
        ([], 2, "name the pair"),
        (["-m", "qwen9-1b"], 3, "unknown model preset"),
        (["--target", "Qwen/Qwen3-8B", "--drafter", "none"], 2, "need a DFlash drafter"),
    ],
)
def test_engine_pair_errors(args, code, message):
    r = serve("--engine", "vllm", *args, "--print-command")
    assert r.exit_code == code and message in r.stderr and "Traceback" not in r.output


def test_engine_not_installed_says_how_to_get_the_command(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    r = serve("--engine", "vllm", "-m", "qwen3-8b")
    assert r.exit_code == 2 and "vllm is not installed" in r.stderr and "--print-command" in r.stderr


def test_installed_vllm_is_run_with_the_command_and_its_exit_code(monkeypatch, tmp_path):
    record = tmp_path / "args.json"
    exe = tmp_path / "vllm"
    exe.write_text(
        f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\nsys.exit(3)\n"
    )
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    r = serve("--engine", "vllm", "-m", "qwen3-8b", "--port", "8123")
    assert r.exit_code == 3
    assert json.loads(record.read_text()) == shlex.split(VLLM_QWEN3_8B.replace("8000", "8123"))[1:]
    assert "starting vllm" in r.stderr


def test_installed_sglang_is_run_with_this_python(monkeypatch, tmp_path):
    record = tmp_path / "args.json"
    pkg = tmp_path / "site" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(f"import json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    r = serve("--engine", "sglang", "-m", "qwen3-8b")
    assert r.exit_code == 0, r.output
    assert json.loads(record.read_text()) == shlex.split(SGLANG_QWEN3_8B)[3:]


def test_local_engine_refuses_engine_flags_and_a_busy_port(tmp_path):
    r = serve("--print-command")
    assert r.exit_code == 2 and "--engine vllm or sglang" in r.output
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = str(busy.getsockname()[1])
        r = serve("--target", str(tmp_path / "missing"), "--port", port)  # fails before any model loads
    assert r.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr
