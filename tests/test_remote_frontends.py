"""`dflash chat --server` and `dflash bench --server`: the front ends on a remote backend.

Against a real `dflash serve` of the tiny pair on a loopback port (conftest.py's ``server``, shared
with test_serve.py), and against the fake vLLM / plain OpenAI servers of test_remote.py (text
chunks, no per-token origin). Also: chat and bench remember when a local pair was last used.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import tui
from dflash_cli.app import app
from dflash_cli.commands import chat as chat_cmd
from dflash_cli.common import usage_log_path
from dflash_cli.server.app import create_app
from dflash_cli.server.config import ServeConfig
from runtime import DecodeOptions, LoadOptions, ModelRef, RuntimeConfig, SamplingParams, load_pipeline
from runtime.engine.events import Finished
from runtime.models.store import UsageLog
from tests.fakes import ScriptedDecoder
from tests.http_helpers import ThreadServer, free_port
from tests.test_cli_chat import Captured
from tests.test_remote import FakeEngine
from tests.test_serve_app import ScriptedBackend
from tests.tui_fakes import BLOCKS, FIRST
from tui.widgets import PLAIN, AssistantTurn, Legend, TokenChunk

runner = CliRunner()
PROMPTS = ["def add(a, b):", "class Stack:"]


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> Captured:
    cap = Captured()
    monkeypatch.setattr(chat_cmd, "interactive", lambda: True)
    monkeypatch.setattr(tui, "make_app", cap.make_app)
    return cap


@pytest.fixture(scope="module")
def local(tiny_pair):
    t, d = tiny_pair
    return load_pipeline(
        ModelRef(target=str(t), drafter=str(d)), RuntimeConfig(device="cpu", dtype="float32"), LoadOptions()
    )


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def bench(*args: str):
    return runner.invoke(app, ["bench", *args])


def doc_of(result: Any) -> dict[str, Any]:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# -- dflash bench --server ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [[], ["--raw"]], ids=["chat", "raw"])
def test_bench_with_dflash_serve_gives_the_local_greedy_tokens(server, tiny_pair, prompts, mode):
    t, d = tiny_pair
    common = ["--prompts", str(prompts), "-n", "10", "--methods", "ar,dflash", "--warmup", "0", "--tokens", *mode]
    local_doc = doc_of(bench("--target", str(t), "--drafter", str(d), "--dtype", "float32", "--device", "cpu", *common))
    r = bench("--server", server.url, *common)
    remote_doc = doc_of(r)
    assert [m["name"] for m in remote_doc["methods"]] == [m["name"] for m in local_doc["methods"]] == ["ar", "dflash"]
    for lm, rm in zip(local_doc["methods"], remote_doc["methods"], strict=True):
        assert [run["tokens"] for run in rm["runs"]] == [run["tokens"] for run in lm["runs"]]
        assert all(run["new_tokens"] == 10 for run in rm["runs"])
    dflash = remote_doc["methods"][1]
    assert dflash["agreement"] == {"prompts": 2, "identical": 2, "first_divergence": None}
    assert dflash["block_size"] == 4 and sum(run["drafted"] for run in dflash["runs"]) > 0
    assert sum(dflash["acceptance_histogram"]) == sum(run["steps"] for run in dflash["runs"])
    assert remote_doc["dataset"]["prompt_tokens"] == local_doc["dataset"]["prompt_tokens"]
    env = remote_doc["environment"]
    assert env["server"]["url"] == server.url and env["server"]["engine"] == "dflash"
    assert env["server"]["model"] == env["target"]["id"] == "target" and env["device"] == "cpu"
    # the table names the server and the served model; stdout stays one JSON document
    assert f"dflash serve at {server.url}" in r.stderr and "served model target" in r.stderr
    assert "| target " in r.stderr and "dflash b4" in r.stderr
    assert isinstance(remote_doc["run_id"], int)
    history = runner.invoke(app, ["bench", "history", "--format", "json"])
    assert [h["target"] for h in json.loads(history.stdout)][:2] == ["target", str(t)]


def test_bench_with_server_skips_or_refuses_the_local_only_methods(server, tiny_pair, prompts):
    r = bench("--server", server.url, "--prompts", str(prompts), "-l", "1", "-n", "4", "--warmup", "0")
    assert [m["name"] for m in doc_of(r)["methods"]] == ["ar", "dflash"]
    assert r.stderr.count("skipping hf and pld") == 1
    for args, message in [
        (["--methods", "ar,pld"], "local weights"),
        (["--methods", "assisted", "--assistant", "x"], "cannot run with --server"),
        (["--target", str(tiny_pair[0])], "--server excludes --target"),
        (["--thinking"], "--thinking is not available"),
    ]:
        r = bench("--server", server.url, "--prompts", str(prompts), *args)
        assert r.exit_code == 2 and message in r.stderr and r.stdout == "", (args, r.output)
    r = bench("--server", f"http://127.0.0.1:{free_port()}", "--prompts", str(prompts))
    assert r.exit_code == 7 and "cannot reach the server" in r.stderr


def test_bench_with_a_vllm_server_measures_what_it_runs(prompts):
    fake = FakeEngine("vllm")
    with ThreadServer(fake.app) as srv:
        r = bench("--server", srv.url, "-m", "qwen3-8b", "--prompts", str(prompts), "-n", "8", "--tokens")
        fixed = bench("--server", srv.url, "--prompts", str(prompts), "--block-size", "4")
    doc = doc_of(r)
    (row,) = doc["methods"]  # vLLM fixes its decoding at start: one row, named after the engine
    assert row["name"] == row["label"] == "vllm" and row["speedup"] is None and row["agreement"] is None
    assert [run["new_tokens"] for run in row["runs"]] == [2, 2] and row["runs"][0]["tokens"] is None
    assert row["tau"] == 2.5 and row["acceptance_rate"] == pytest.approx(0.1)  # the server's statistics
    assert row["acceptance_histogram"] == [2, 0, 2, 0] and row["block_size"] == 16
    assert doc["environment"]["server"]["model"] == "Qwen/Qwen3-8B" and doc["environment"]["device"] == "remote"
    assert "vllm at " + srv.url in r.stderr and "| Qwen/Qwen3-8B " in r.stderr
    assert all(req["ignore_eos"] is True and req["max_tokens"] == 8 for req in fake.requests)
    assert fixed.exit_code == 2 and "fixes its decoding when it starts" in fixed.stderr


def test_local_bench_and_chat_remember_the_last_use(tiny_pair, prompts, captured):
    t, d = tiny_pair
    t0 = time.time()
    r = bench("--target", str(t), "--drafter", str(d), "--prompts", str(prompts), "-l", "1", "-n", "2")
    assert r.exit_code == 0, r.output
    log = UsageLog(usage_log_path())
    assert log.last_used(t) >= t0 and log.last_used(d) >= t0
    usage_log_path().unlink()
    r = runner.invoke(app, ["chat", "--target", str(t), "--drafter", str(d), "--dtype", "float32"])
    assert r.exit_code == 0, r.output
    assert not usage_log_path().exists()  # nothing loaded yet: the app loads in its worker
    captured.factory(lambda line: None)
    log = UsageLog(usage_log_path())
    assert log.last_used(t) >= t0 and log.last_used(d) >= t0
    assert [(p["target"], p["drafter"]) for p in log.pairs()] == [(str(t.absolute()), str(d.absolute()))]


# -- dflash chat --server ----------------------------------------------------------------------------


async def until(pilot: Any, cond: Any, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "timed out waiting for the app"
        await pilot.pause(0.02)


def chat_app(captured: Captured, *args: str) -> Any:
    r = runner.invoke(app, ["chat", *args])
    assert r.exit_code == 0, r.output
    return tui.app.make_app(captured.factory, captured.config)


async def ask(pilot: Any, text: str) -> AssistantTurn:
    chat = pilot.app
    chat.prompt.set_prompt(text)
    await pilot.press("enter")
    await until(pilot, lambda: chat.query(AssistantTurn) and not chat.generating)
    await pilot.pause()
    return chat.query(AssistantTurn).last()


def merged(parts: list[tuple[str, str]]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for text, kind in parts:
        if out and out[-1][1] == kind:
            out[-1] = (out[-1][0] + text, kind)
        elif text:
            out.append((text, kind))
    return out


def test_chat_server_excludes_local_models(captured, tiny_pair):
    r = runner.invoke(app, ["chat", "--server", "http://127.0.0.1:1", "--drafter", str(tiny_pair[1])])
    assert r.exit_code == 2 and "--server excludes --target/--drafter" in r.stderr and not captured.ran


def test_chat_on_dflash_serve_paints_the_served_token_origins(captured, server, local):
    question = "def add(a, b):"
    # the verify length is pinned: chosen from measured costs, it may differ between two processes
    chat = chat_app(captured, "--server", server.url, "-n", "12", "--view", "origin", "--verify-length", "3")
    assert captured.config.model_label == server.url
    want = list(
        local.stream_messages(
            [{"role": "user", "content": question}], SamplingParams(max_new_tokens=12), DecodeOptions(verify_length=3)
        )
    )

    async def body() -> None:
        async with chat.run_test(size=(110, 30)) as pilot:
            await until(pilot, lambda: chat.backend is not None or chat.load_error is not None)
            assert chat.load_error is None and chat.per_token_status
            assert f"dflash serve at {server.url}" in chat.sub_title and "block 4" in chat.sub_title
            turn = await ask(pilot, question)
            assert turn.failed is None and turn.text == "".join(e.text for e in want[:-1])
            painted = [p for c in chat.query(TokenChunk) for p in c.parts if p[1] != "rejected"]
            expected = [(t.text, t.status.value) for e in want[:-1] for t in e.tokens]
            assert merged(painted) == merged(expected)  # coloured by the origin the server reported
            final, got = want[-1].stats, chat.tracker.final
            assert (got.generated_tokens, got.drafted_tokens, got.tau) == (
                final.generated_tokens,
                final.drafted_tokens,
                final.tau,
            )
            assert f"τ {final.tau:.2f}" in chat.stats_bar.current_line().plain
            assert "accepted draft" in chat.query_one(Legend).render().plain

    asyncio.run(body())
    assert isinstance(want[-1], Finished)


def test_chat_on_the_serve_app_shows_accepted_target_and_ghost_tokens(captured):
    """The serve app around a scripted backend whose drafts get accepted and rejected: the chat paints
    each token with the origin the server sent, and the rejected drafts as ghost text."""
    backend = ScriptedBackend(ScriptedDecoder(BLOCKS, first=FIRST))
    expected = [(FIRST, "target")]
    for accepted, target, rejected in BLOCKS:
        ghost = "".join(rejected).replace("\n", "↵")  # a rejected newline is drawn as a symbol
        expected += [(t, "accepted") for t in accepted] + [(ghost, "rejected"), (target, "target")]

    async def body(chat: Any) -> None:
        async with chat.run_test(size=(110, 30)) as pilot:
            await until(pilot, lambda: chat.backend is not None)
            turn = await ask(pilot, "write add")
            painted = [p for c in chat.query(TokenChunk) for p in c.parts]
            assert merged(painted) == merged(expected)
            assert turn.text == "".join(text for text, kind in expected if kind != "rejected")
            s = chat.tracker.final
            assert (s.accepted_tokens, s.drafted_tokens) == (
                sum(len(a) for a, _, _ in BLOCKS),
                sum(len(a) + len(r) for a, _, r in BLOCKS),
            )
            line = chat.stats_bar.current_line().plain
            assert f"τ {s.tau:.2f}" in line and f"accept {s.acceptance_rate * 100:.0f}%" in line

    with ThreadServer(create_app(backend, ServeConfig(model_names=("scripted",)))) as srv:
        asyncio.run(body(chat_app(captured, "--server", srv.url, "--view", "origin")))


@pytest.mark.parametrize(("owner", "tau"), [("vllm", "2.50"), ("openai", "–")])
def test_chat_on_a_server_without_token_origin_shows_plain_text_and_its_stats(captured, owner, tau):
    fake = FakeEngine(owner, model="served-model")

    async def body(chat: Any) -> None:
        async with chat.run_test(size=(110, 30)) as pilot:
            await until(pilot, lambda: chat.backend is not None)
            assert not chat.per_token_status and f"{owner} at " in chat.sub_title
            assert "plain text" in chat.query_one(Legend).render().plain
            turn = await ask(pilot, "hi")
            assert turn.text == "Hello" and turn.failed is None
            parts = [p for c in chat.query(TokenChunk) for p in c.parts]
            assert parts == [("Hello", PLAIN)]  # no colour the server did not report
            now, session = chat.stats_bar.current_line().plain, chat.stats_bar.session_line().plain
            assert "2 tok" in now and f"τ {tau} " in now and f"τ {tau} " in session
            assert ("accept 10%" in now) == (owner == "vllm")
            assert fake.requests[-1]["messages"] == [{"role": "user", "content": "hi"}]

    with ThreadServer(fake.app) as srv:
        asyncio.run(body(chat_app(captured, "--server", srv.url, "--view", "origin")))


def test_chat_server_problems_show_in_the_app(captured):
    fake = FakeEngine("vllm")

    async def body(chat: Any, message: str) -> None:
        async with chat.run_test(size=(110, 30)) as pilot:
            await until(pilot, lambda: chat.load_error is not None)
            assert message in chat.load_error and chat.is_running
            assert message in str(chat.query_one("#status").render())

    asyncio.run(body(chat_app(captured, "--server", f"http://127.0.0.1:{free_port()}"), "cannot reach the server"))
    with ThreadServer(fake.app) as srv:
        asyncio.run(body(chat_app(captured, "--server", srv.url, "--block-size", "4"), "not per request"))
