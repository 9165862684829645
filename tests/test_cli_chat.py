"""`dflash chat` as a command: options, exit codes, --history/--resume, and the real backend
(a loaded tiny pipeline) driving the app under Pilot."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from typer.testing import CliRunner

import tui
from dflash_cli.app import app
from dflash_cli.commands import chat as chat_cmd
from runtime.errors import ConfigError, InputError
from tui.store import ChatStore

runner = CliRunner()


class Captured:
    """Stands in for the app: records what the command built, runs nothing."""

    def __init__(self) -> None:
        self.factory: Any = None
        self.config: Any = None
        self.ran = False

    def make_app(self, factory: Any, config: Any) -> Captured:
        self.factory, self.config = factory, config
        return self

    def run(self) -> None:
        self.ran = True


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> Captured:
    cap = Captured()
    monkeypatch.setattr(chat_cmd, "interactive", lambda: True)
    monkeypatch.setattr(tui, "make_app", cap.make_app)
    return cap


def test_needs_a_terminal():
    r = runner.invoke(app, ["chat"], input="")
    assert r.exit_code == ConfigError.exit_code
    assert "needs an interactive terminal" in r.stderr and "dflash run" in r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "2"], "top_p"),
        (["--max-tokens", "0"], "max_new_tokens"),
        (["--view", "fancy"], "markdown"),
        (["--resume", "42"], "no chat session '42'"),
        (["--resume", "last"], "no chat session to resume"),
    ],
)
def test_bad_options_fail_before_the_app_opens(captured, args, message):
    r = runner.invoke(app, ["chat", *args], input="")
    assert r.exit_code == 2, r.output
    assert message in r.stderr
    assert not captured.ran


def test_history_lists_sessions_and_resume_opens_one(captured):
    r = runner.invoke(app, ["chat", "--history"])
    assert r.exit_code == 0 and "no chat sessions yet" in r.stdout
    store = ChatStore(chat_cmd.chat_db())
    a = store.new_session("sort a list in place", "Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", None)
    store.add_message(a, "user", "sort a list in place")
    store.add_message(a, "assistant", "xs.sort()", reason="stop", stats={"generated_tokens": 5})
    b = store.new_session("second chat", "embedded", None, None)
    store.close()
    r = runner.invoke(app, ["chat", "--history"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split()[:4] == ["id", "last", "used", "turns"]
    assert lines[1].split()[0] == str(b) and lines[2].split()[0] == str(a)  # most recent first
    assert "Qwen/Qwen3-8B + z-lab/Qwen3-8B-DFlash-b16" in lines[2] and "sort a list in place" in lines[2]
    assert lines[2].split()[3:5] == ["1", "5"]  # turns, tokens
    r = runner.invoke(app, ["chat", "--resume", "last"])
    assert r.exit_code == 0, r.output
    assert captured.ran and captured.config.resume == b
    r = runner.invoke(app, ["chat", "-r", str(a), "--system", "be brief", "-n", "9", "--no-ghost", "--view", "origin"])
    assert r.exit_code == 0, r.output
    cfg = captured.config
    assert (cfg.resume, cfg.system, cfg.params.max_new_tokens, cfg.show_ghost, cfg.view) == (
        a,
        "be brief",
        9,
        False,
        "origin",
    )
    assert cfg.db_path == chat_cmd.chat_db()


def test_drafter_none_means_plain_decoding(captured, tiny_pair):
    target, _ = tiny_pair
    r = runner.invoke(app, ["chat", "--target", str(target), "--drafter", "none"])
    assert r.exit_code == 0, r.output
    assert captured.config.decode.decoder == "ar"


def test_real_pipeline_streams_into_the_app(captured, tiny_pair):
    """The command's backend factory loads a real (tiny) pair; the app streams its answer."""
    target, drafter = tiny_pair
    args = ["chat", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32", "-n", "12"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    progress: list[str] = []

    async def body() -> None:
        from tui.widgets import AssistantTurn

        def factory(report: Any) -> Any:
            return captured.factory(lambda line: (progress.append(line), report(line)))

        chat_app = tui.app.make_app(factory, captured.config)
        async with chat_app.run_test(size=(100, 30)) as pilot:
            loop = asyncio.get_running_loop()
            end = loop.time() + 180  # a loaded machine (CI beside other jobs) is slow to load even a tiny pair
            while chat_app.backend is None:
                assert chat_app.load_error is None, chat_app.load_error
                assert loop.time() < end
                await pilot.pause(0.05)
            chat_app.prompt.set_prompt("def add(a, b):")
            await pilot.press("enter")
            while chat_app.generating or not chat_app.query(AssistantTurn):
                assert loop.time() < end
                await pilot.pause(0.05)
            await pilot.pause()
            turn = chat_app.query(AssistantTurn).last()
            assert turn.failed is None and turn.reason in ("stop", "length")
            tracker = chat_app.tracker
            assert tracker.final is not None and tracker.final.generated_tokens >= 1
            assert tracker.final.decoder == "dflash" and tracker.final.block_size == 4
            line = chat_app.stats_bar.current_line().plain
            assert f"{tracker.final.generated_tokens} tok " in line and f"τ {tracker.final.tau:.2f}" in line
            assert chat_app.model_info["block_size"] == 4

    asyncio.run(body())
    assert any("loading" in p for p in progress)


def test_resume_of_a_missing_session_is_an_input_error(captured):
    r = runner.invoke(app, ["chat", "--resume", "abc"])
    assert r.exit_code == InputError.exit_code and "dflash chat --history" in r.stderr
