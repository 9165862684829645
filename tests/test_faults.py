"""Faults and hostile input (issue 11): each answered cleanly, nothing lost (tiny models only)."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from dflash_cli.app import app
from runtime.errors import ConfigError
from tests.fakes import one_line_error

runner = CliRunner()
F32 = ["--dtype", "float32", "--device", "cpu"]


def cli(*args: str, input: str | bytes = ""):  # noqa: A002
    return runner.invoke(app, list(args), input=input)


def _no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a model would load."""
    import runtime.quantize.job as job

    def boom(*_a, **_k):
        raise AssertionError("a model was loaded before --out was checked")

    monkeypatch.setattr(job, "load_pipeline", boom)


# -- 1. dflash quantize --out/--force ---------------------------------------------------------------
def test_quantize_out_dot_force_never_empties_the_current_folder(tiny_pair, tmp_path, monkeypatch):
    t, d = tiny_pair
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "notes.txt").write_text("x\n")
    monkeypatch.chdir(scratch)
    _no_load(monkeypatch)
    for out in (".", "..", str(scratch)):
        r = cli("quantize", "--target", str(t), "--drafter", str(d), "--scheme", "int8", "--out", out, "--force", *F32)
        one_line_error(r, ConfigError.exit_code, "cannot be used", "current folder")
    assert sorted(p.name for p in scratch.iterdir()) == ["notes.txt"]
    assert (scratch / "notes.txt").read_text() == "x\n"


def test_quantize_force_never_replaces_home_or_root(tiny_pair, tmp_path, monkeypatch):
    t, _d = tiny_pair
    home = tmp_path / "home"
    home.mkdir()
    (home / "keep").write_text("k")
    monkeypatch.setenv("HOME", str(home))
    _no_load(monkeypatch)
    for out, why in ((str(home), "home folder"), ("/", "root folder")):
        r = cli("quantize", "--target", str(t), "--drafter", "none", "--scheme", "int8", "--out", out, "--force", *F32)
        one_line_error(r, ConfigError.exit_code, why)
    assert (home / "keep").read_text() == "k"


def test_quantize_unwritable_out_is_exit_2_before_loading(tiny_pair, tmp_path, monkeypatch):
    t, _d = tiny_pair
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    _no_load(monkeypatch)
    if os.geteuid() == 0:  # root writes anywhere: let the permission check see what a user would
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, m, **k: False if str(p) == str(locked) else real(p, m, **k))
    try:
        r = cli(
            "quantize", "--target", str(t), "--drafter", "none", "--scheme", "int8", "--out", str(locked / "q"), *F32
        )
        one_line_error(r, ConfigError.exit_code, "cannot write", "permission denied")
    finally:
        locked.chmod(0o755)


# -- 2, 4, 7, 8, 9. dflash serve: bad options, bad text, bad numbers, no paths, cancellations -------
MESSAGES = [{"role": "user", "content": "hi"}]


def _metrics(url: str) -> str:
    from tests.http_helpers import get

    return get(url + "/metrics")[1]


def test_server_block_size_beyond_the_drafters_block_is_400(server):
    from tests.http_helpers import post

    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    status, resp = post(server.url + "/v1/chat/completions", {**body, "dflash": {"block_size": 100000}})
    assert status == 400 and resp["error"]["param"] == "dflash.block_size", resp
    assert resp["error"]["code"] == "block_size_exceeded" and "at most 4" in resp["error"]["message"]
    status, resp = post(server.url + "/v1/chat/completions", {**body, "dflash": {"block_size": 4}})
    assert status == 200, resp


DEEP = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
BAD_INPUT = [
    ("seed overflow", {"messages": MESSAGES, "seed": 18446744073709551616}, None, "seed"),
    ("100k-deep JSON", None, DEEP, None),
    ("lone surrogate", None, b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', None),
    ("lone surrogate in stop", None, b'{"messages": [{"role": "user", "content": "a"}], "stop": "\\udc00"}', None),
    ("invalid UTF-8", None, b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', None),
    ("NaN temperature", None, b'{"messages": [{"role": "user", "content": "a"}], "temperature": NaN}', None),
    ("huge stop string", {"messages": MESSAGES, "stop": "x" * 100_000}, None, "stop"),
]


@pytest.mark.parametrize("case", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_server_bad_input_is_400_counted_and_not_logged(server, case):
    from tests.http_helpers import post, request

    _, body, raw, param = case
    before = _metrics(server.url)
    logged = len(server.lines)
    if raw is None:
        status, resp = post(server.url + "/v1/chat/completions", body)
    else:
        status, resp = request("POST", server.url + "/v1/chat/completions", raw=raw)
    assert status == 400, resp
    assert resp["error"]["type"] == "invalid_request_error" and resp["error"]["param"] == param
    from tests.http_helpers import metric

    after = _metrics(server.url)
    labels = 'endpoint="chat",status="400"'
    assert metric(after, "dflash_requests_total", labels) - metric(before, "dflash_requests_total", labels) == 1
    assert post(server.url + "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})[0] == 200
    assert not any("Traceback" in line for line in server.lines[logged:]), "".join(server.lines[logged:])


def test_models_endpoint_shows_no_local_paths(server, tiny_pair):
    from tests.http_helpers import request

    status, text = request("GET", server.url + "/v1/models")
    raw = text if isinstance(text, str) else __import__("json").dumps(text)
    assert status == 200
    for folder in tiny_pair:
        assert str(folder) not in raw and str(folder.parent) not in raw, raw
    card = text["data"][0]["dflash"]
    assert card["target"] == "target" and card["drafter"] == "drafter"


def test_client_disconnect_is_counted_as_a_cancelled_generation():
    import json
    import time
    import urllib.request

    from tests.fakes import ScriptedDecoder
    from tests.test_serve_app import BLOCKS
    from tests.test_serve_app import serve as scripted

    decoder = ScriptedDecoder(BLOCKS * 40, delay=0.05)
    backend, srv = scripted(decoder)
    with srv:
        req = urllib.request.Request(
            srv.url + "/v1/chat/completions",
            data=json.dumps({"messages": MESSAGES, "stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        resp = urllib.request.urlopen(req, timeout=10)
        assert resp.readline().startswith(b"data: ")
        resp.close()
        assert backend.cancelled.wait(5)
        from tests.http_helpers import metric

        deadline = time.monotonic() + 5
        while metric(_metrics(srv.url), "dflash_generations_total", 'reason="cancelled"') < 1:
            assert time.monotonic() < deadline, _metrics(srv.url)
            time.sleep(0.05)
        assert metric(_metrics(srv.url), "dflash_requests_running") == 0  # the slot is free


def test_ctrl_c_twice_stops_the_server_cleanly(tiny_pair, tmp_path):
    import signal
    import threading
    import time

    from tests.http_helpers import ServeProcess, sse

    t, d = tiny_pair
    proc = ServeProcess(
        ["--target", str(t), "--drafter", str(d), "--dtype", "float32", "--device", "cpu", "--log-level", "warning"],
        tmp_path,
    )
    body = {"messages": MESSAGES, "stream": True, "max_tokens": 64, "ignore_eos": True}
    threading.Thread(target=lambda: _swallow(sse, proc.url + "/v1/chat/completions", body), daemon=True).start()
    time.sleep(0.3)
    proc.proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.proc.send_signal(signal.SIGINT)  # as ServePool.stop does when the first has not finished yet
    assert proc.stop() == 0, "".join(proc.lines)
    time.sleep(0.2)
    log = "".join(proc.lines)
    assert "Traceback" not in log and "CancelledError" not in log and "KeyboardInterrupt" not in log, log
    assert "server stopped" in log


def _swallow(fn, *args):
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - the server going away mid-stream is the point
        pass


# -- 3. a run folder never runs code --------------------------------------------------------------
class _Payload:
    """Unpickling this would create a file: the proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_payload_in_a_run_folder_is_refused(tmp_path):
    import torch

    from runtime.errors import ModelLoadError
    from runtime.train.state import load_trainer_state

    ckpt = tmp_path / "run" / "checkpoint"
    ckpt.mkdir(parents=True)
    marker = tmp_path / "pwned"
    torch.save({"config": _Payload(str(marker)), "state": {}, "optimizer": {}, "rng": None}, ckpt / "trainer_state.pt")
    with pytest.raises(ModelLoadError, match="pickled objects that dflash does not load"):
        load_trainer_state(ckpt)
    assert not marker.exists()


def test_eval_only_on_a_run_folder_with_a_pickle_payload_is_a_clear_error(tmp_path):
    import torch

    ckpt = tmp_path / "run" / "checkpoint"
    ckpt.mkdir(parents=True)
    marker = tmp_path / "pwned"
    torch.save({"config": _Payload(str(marker))}, ckpt / "trainer_state.pt")
    r = cli("train", "--out", str(tmp_path / "run"), "--eval-only", *F32)
    one_line_error(r, 4, "trainer_state.pt", "pickle")
    assert not marker.exists()


def test_trainer_state_round_trips_without_pickle(tmp_path):
    import random

    import torch

    from runtime.train.state import load_trainer_state, save_trainer_state

    w = torch.nn.Parameter(torch.randn(3, 2))
    opt = torch.optim.AdamW([w], lr=1e-3, betas=(0.9, 0.95))
    w.sum().backward()
    opt.step()
    rng = random.Random(3)
    save_trainer_state(tmp_path, opt.state_dict(), {"step": 1}, {"betas": (0.9, 0.95)}, rng.getstate())
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.*")) == [
        "trainer/optimizer.safetensors",
        "trainer/state.json",
    ]
    blob = load_trainer_state(tmp_path)
    opt2 = torch.optim.AdamW([torch.nn.Parameter(w.detach().clone())], lr=1e-3)
    opt2.load_state_dict(blob["optimizer"])
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert opt2.param_groups[0]["betas"] == (0.9, 0.95)
    r2 = random.Random()
    r2.setstate(blob["rng"])
    assert r2.random() == rng.random()


# -- 4. text that is not UTF-8 ------------------------------------------------------------------------
def test_invalid_utf8_on_stdin_is_exit_2_naming_the_byte_offset(tiny_pair):
    import subprocess
    import sys
    from pathlib import Path

    t, d = tiny_pair
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "dflash_cli", "run", "--target", str(t), "--drafter", str(d), *F32, "--raw", "-"]
    p = subprocess.run(cmd, input=b"caf\xe9 x", capture_output=True, env=env, cwd=root, timeout=120)
    err = p.stderr.decode()
    assert p.returncode == 2, err
    assert "stdin is not valid UTF-8: byte 0xe9 at byte offset 3" in err and "Traceback" not in err
    assert p.stdout == b""


def test_invalid_utf8_argument_and_lone_surrogate_are_exit_2(tiny_pair):
    t, d = tiny_pair
    r = cli("run", "--target", str(t), "--drafter", str(d), *F32, "--raw", "caf\udce9 x")  # as argv carries it
    one_line_error(r, 2, "the prompt argument is not valid UTF-8: byte 0xe9 at byte offset 3")
    r = cli("run", "--target", str(t), "--drafter", str(d), *F32, "--raw", "-", input=b"ok \xff\xfe")
    one_line_error(r, 2, "byte 0xff at byte offset 3")


def test_prompt_file_not_utf8_and_json_surrogates(tmp_path, tiny_pair):
    from runtime.bench.datasets import load_prompt_file
    from runtime.errors import InputError

    f = tmp_path / "p.txt"
    f.write_bytes(b"fine\nna\xefve\n")
    with pytest.raises(InputError, match="byte 0xef at byte offset 7"):
        load_prompt_file(f)
    from runtime import ModelRef, RuntimeConfig, load_pipeline

    t, _d = tiny_pair
    pipe = load_pipeline(ModelRef(target=str(t), drafter="none"), RuntimeConfig(device="cpu", dtype="float32"))
    with pytest.raises(InputError, match="lone surrogate"):
        pipe.encode("a\ud800", chat=False)


# -- 5. a damaged or read-only chat database --------------------------------------------------------
def _damaged_db(path) -> bytes:
    """A real chat database with a page of garbage in the middle."""
    from tui.store import ChatStore

    store = ChatStore(path)
    sid = store.new_session("t", "x", None, None)
    for i in range(200):
        store.add_message(sid, "user", f"message {i} " * 20)
    store.close()
    data = bytearray(path.read_bytes())
    data[4096 * 2 : 4096 * 3] = b"\xa5" * 4096
    path.write_bytes(bytes(data))
    return bytes(data)


@pytest.mark.parametrize("kind", ["not a database", "damaged pages", "read-only"])
def test_chat_starts_with_a_damaged_or_read_only_database(tmp_path, monkeypatch, kind):
    import sqlite3

    from tests.test_tui import SIZE, app_for, ready, run, send
    from tests.tui_fakes import FakeBackend

    db = tmp_path / "chat.sqlite3"
    if kind == "not a database":
        db.write_bytes(b"this is not sqlite\n" * 100)
    elif kind == "damaged pages":
        _damaged_db(db)
    else:
        from tui.store import ChatStore

        ChatStore(db).close()
        real = sqlite3.connect
        monkeypatch.setattr(  # what a file without write permission gives (root ignores chmod)
            sqlite3,
            "connect",
            lambda p, **k: real(f"file:{p}?mode=ro", uri=True, **k) if p == str(db) else real(p, **k),
        )
    before = db.read_bytes()

    async def chat():
        app = app_for(FakeBackend(), db_path=db)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send(pilot, "hello")
            await send(pilot, "again")
            notes = [n for n in app._notifications if str(db) in n.message]
            assert len(notes) == 1 and notes[0].severity == "warning", [n.message for n in app._notifications]
            assert "in memory" in notes[0].message
            assert app.store.list_sessions()[0].turns == 2  # kept for this run

    run(chat())
    assert db.read_bytes() == before  # nothing deleted or overwritten


def test_chat_history_with_a_damaged_database_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    from dflash_cli.commands.chat import chat_db

    db = chat_db()
    db.parent.mkdir(parents=True, exist_ok=True)
    db.write_bytes(b"garbage" * 100)
    r = cli("chat", "--history")
    one_line_error(r, 2, str(db))
    assert db.read_bytes() == b"garbage" * 100


# -- 6. bench history: reads are read-only and wait for locks -----------------------------------------
def _old_history(path):
    import sqlite3

    from runtime.bench.store import _DDL

    con = sqlite3.connect(path)
    con.executescript(_DDL)
    con.execute(
        "INSERT INTO runs (created, target, dataset, prompts, max_tokens, device, dtype, document) "
        "VALUES ('2026-01-01', 't', 'humaneval', 1, 8, 'cpu', 'float32', '{\"x\": 1}')"
    )
    con.commit()
    con.close()  # user_version 0: a schema change on read would rewrite the header


def test_bench_history_reads_never_change_the_file(tmp_path):
    from runtime.bench.store import BenchStore

    db = tmp_path / "bench.sqlite"
    _old_history(db)
    before = db.read_bytes()
    store = BenchStore(db)
    assert [r.id for r in store.history()] == [1]
    assert store.get("last") == {"x": 1}
    assert db.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.sqlite"]  # no journal left behind


def test_bench_history_reads_while_another_process_writes(tmp_path):
    import sqlite3
    import time

    from runtime.bench.store import BenchStore

    db = tmp_path / "bench.sqlite"
    _old_history(db)
    writer = sqlite3.connect(db)
    writer.execute("BEGIN IMMEDIATE")  # a `dflash bench` saving right now
    writer.execute("DELETE FROM runs")
    try:
        t0 = time.monotonic()
        assert [r.id for r in BenchStore(db, lock_timeout=3).history()] == [1]
        assert time.monotonic() - t0 < 2
    finally:
        writer.rollback()
        writer.close()


def test_bench_history_waits_for_an_exclusive_lock_then_says_locked(tmp_path):
    import sqlite3
    import threading
    import time

    from runtime.bench.store import BenchStore
    from runtime.errors import DFlashError

    db = tmp_path / "bench.sqlite"
    _old_history(db)
    holder = sqlite3.connect(db, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    with pytest.raises(DFlashError, match="locked by another process") as e:
        BenchStore(db, lock_timeout=0.2).history()
    assert "move it away" not in str(e.value)
    threading.Timer(0.3, holder.rollback).start()
    t0 = time.monotonic()
    assert [r.id for r in BenchStore(db, lock_timeout=5).history()] == [1]  # waited for the lock
    assert time.monotonic() - t0 >= 0.2
    holder.close()


# -- 10. errors from a model's files name the file -------------------------------------------------------
@pytest.mark.parametrize(
    "edit,code,needle",
    [
        (lambda c: c.update(block_size=0), 2, "block_size must be >= 1"),
        (lambda c: c.pop("intermediate_size"), 4, "intermediate_size"),
        (lambda c: c.update(num_hidden_layers="two"), 4, "two"),
    ],
    ids=["block_size 0", "missing field", "malformed field"],
)
def test_bad_drafter_config_names_the_config_file(tiny_pair, tmp_path, edit, code, needle):
    import json
    import shutil

    t, d = tiny_pair
    bad = tmp_path / "drafter"
    shutil.copytree(d, bad)
    cfg = json.loads((bad / "config.json").read_text())
    edit(cfg)
    (bad / "config.json").write_text(json.dumps(cfg))
    r = cli("run", "--target", str(t), "--drafter", str(bad), *F32, "--raw", "hi")
    one_line_error(r, code, str(bad / "config.json"), needle)


# -- 11. silent nonsense -------------------------------------------------------------------------------
def test_garbage_weights_with_an_intact_header_stop_with_exit_4_naming_the_folder(tiny_pair, tmp_path):
    import json
    import shutil
    import struct

    t, _d = tiny_pair
    bad = tmp_path / "garbage-target"
    shutil.copytree(t, bad)
    (st,) = list(bad.glob("*.safetensors"))
    data = bytearray(st.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    assert all(v["dtype"] == "F32" for k, v in header.items() if k != "__metadata__")
    data[8 + n :] = b"\xff" * (len(data) - 8 - n)  # every float is NaN; the header still adds up
    st.write_bytes(bytes(data))
    r = cli("run", "--target", str(bad), "--drafter", "none", *F32, "--raw", "-n", "4", "hello")
    one_line_error(r, 4, str(bad), "non-finite logits")
    assert r.stdout == ""


def test_block_size_above_the_trained_block_warns(tiny_pair):
    t, d = tiny_pair
    r = cli("run", "--target", str(t), "--drafter", str(d), *F32, "--raw", "-n", "4", "-b", "9", "hello")
    assert r.exit_code == 0, r.output
    assert "warning: block size 9 is above the 4 tokens the drafter was trained for" in r.stderr
    r = cli("run", "--target", str(t), "--drafter", str(d), *F32, "--raw", "-n", "4", "-b", "4", "hello")
    assert r.exit_code == 0 and "warning" not in r.stderr


def test_non_streamed_client_disconnect_cancels_at_the_next_step_and_is_counted():
    import json
    import socket
    import time

    from tests.fakes import ScriptedDecoder
    from tests.http_helpers import metric
    from tests.test_serve_app import BLOCKS
    from tests.test_serve_app import serve as scripted

    decoder = ScriptedDecoder(BLOCKS * 40, delay=0.05)
    backend, srv = scripted(decoder)
    with srv:
        host, port = srv.url.removeprefix("http://").split(":")
        body = json.dumps({"messages": MESSAGES}).encode()
        s = socket.create_connection((host, int(port)))
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(0.3)  # the generation is running
        s.close()
        assert backend.cancelled.wait(5), "the generation kept running for a client that left"
        deadline = time.monotonic() + 5
        while metric(_metrics(srv.url), "dflash_generations_total", 'reason="cancelled"') < 1:
            assert time.monotonic() < deadline, _metrics(srv.url)
            time.sleep(0.05)


def test_an_unexpected_exception_is_a_counted_500_without_a_traceback(capfd):
    from tests.fakes import ScriptedDecoder
    from tests.http_helpers import get, metric
    from tests.test_serve_app import BLOCKS, ScriptedBackend

    class Broken(ScriptedBackend):
        def describe(self):
            raise RuntimeError("boom")

    from dflash_cli.server.app import create_app
    from dflash_cli.server.config import ServeConfig
    from tests.http_helpers import ThreadServer

    srv = ThreadServer(create_app(Broken(ScriptedDecoder(BLOCKS)), ServeConfig(model_names=("scripted",))))
    with srv:
        status, body = get(srv.url + "/v1/models")
        assert status == 500 and body["error"]["code"] == "internal_error" and "boom" in body["error"]["message"]
        assert metric(_metrics(srv.url), "dflash_requests_total", 'endpoint="models",status="500"') == 1
        assert get(srv.url + "/health")[0] == 200
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
