"""`dflash chat`'s app under Textual's Pilot with scripted backends (no model).

What a user sees and does: tokens painted by origin, ghost text toggling, Esc/Ctrl-C stopping a
stream and keeping the partial answer, prompt history, copy, statistics matching the events,
errors shown without killing the app, sessions stored and reopened.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import pytest

from runtime.config import SamplingParams
from runtime.engine.events import BlockVerified, Finished, PrefillDone
from runtime.errors import InputError, ModelNotFoundError
from tests.fakes import ScriptedDecoder
from tests.tui_fakes import ANSWER, BLOCKS, FIRST, FakeBackend, ReplayDecoder, scripted_events
from tui import ChatConfig, make_app
from tui.store import ChatStore
from tui.widgets import AssistantTurn, Legend, PromptInput, TokenChunk

SIZE = (110, 32)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def until(pilot: Any, cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Let the app run until ``cond()`` holds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(0.01)


def app_for(backend: Any, **config: Any) -> Any:
    return make_app(lambda progress: backend, ChatConfig(**config))


async def ready(pilot: Any) -> None:
    await until(pilot, lambda: pilot.app.backend is not None)


async def send(pilot: Any, text: str, wait: bool = True) -> None:
    pilot.app.prompt.set_prompt(text)
    await pilot.press("enter")
    if wait:
        await until(pilot, lambda: not pilot.app.generating)
        await pilot.pause()


def styled_runs(chunk: TokenChunk) -> list[tuple[str, Any]]:
    """(text, style) runs of what a chunk paints."""
    content = chunk.render()
    return [(content.plain[s.start : s.end], s.style) for s in content.spans]


def transcript_text(app: Any) -> str:
    return "".join(c.render().plain for c in app.query(TokenChunk))


# -- streaming and colours ------------------------------------------------------------------------


def test_tokens_are_painted_by_origin_and_ghost_text_follows_the_accepted_prefix():
    backend = FakeBackend()

    async def body():
        app = app_for(backend, view="origin")
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send(pilot, "write add")
            chunks = list(app.query(TokenChunk))
            runs = [r for c in chunks for r in styled_runs(c)]
            accepted = chunks[0].origin_style("accepted")
            target = chunks[0].origin_style("target")
            rejected = chunks[0].origin_style("rejected")
            assert len({str(accepted), str(target), str(rejected)}) == 3
            by_style: dict[str, list[str]] = {"a": [], "t": [], "r": []}
            for text, style in runs:
                key = {str(accepted): "a", str(target): "t", str(rejected): "r"}[str(style)]
                by_style[key].append(text)
            assert by_style["t"][0] == FIRST
            assert "".join(by_style["a"]) == "".join("".join(acc) for acc, _, _ in BLOCKS)
            assert "".join(by_style["t"][1:]) == "".join(tgt for _, tgt, _ in BLOCKS)
            assert "".join(by_style["r"]) == "".join("".join(rej) for _, _, rej in BLOCKS).replace("\n", "↵")
            # ghost text sits right after the accepted prefix, before the target's correction
            painted = transcript_text(app)
            assert "def add" + "a" + "(" in painted
            assert app.last_answer().text == ANSWER

    run(body())


def test_ghost_text_toggles_and_off_it_disappears():
    async def body():
        app = app_for(FakeBackend(), view="origin")
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send(pilot, "write add")
            ghost = "".join("".join(rej) for _, _, rej in BLOCKS)
            with_ghost = transcript_text(app)
            assert len(with_ghost) == len(ANSWER) + len(ghost)
            # a rejected newline is drawn as a symbol: ghost text never adds lines to the answer
            assert "\n" in ghost and "↵" in with_ghost and with_ghost.count("\n") == ANSWER.count("\n")
            assert "shown" in app.query_one(Legend).render().plain
            await pilot.press("ctrl+g")
            await pilot.pause()
            assert transcript_text(app) == ANSWER
            assert "hidden" in app.query_one(Legend).render().plain
            await pilot.press("ctrl+g")
            await pilot.pause()
            assert transcript_text(app) == with_ghost

    run(body())


def test_finished_answer_renders_markdown_with_numbered_code_blocks_and_copy():
    answer = [
        (["Use", " this"], ":\n\n```python\n", []),
        (["print(1)"], "\n```\n", []),
        (["Run:\n```bash\nls\n"], "```", []),
    ]
    backend = FakeBackend(ReplayDecoder(scripted_events(answer, first="")))

    async def body():
        from textual.widgets import Markdown
        from textual.widgets._markdown import MarkdownFence

        app = app_for(backend)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send(pilot, "show code")
            await pilot.pause(0.1)
            md = app.query(Markdown)
            assert len(md) == 1 and md.first().display
            fences = list(app.query(MarkdownFence))
            assert [f.code.strip() for f in fences] == ["print(1)", "ls"]
            footer = app.query_one(".turn-footer").render()
            assert "[1] python" in str(footer) and "[2] bash" in str(footer)
            await pilot.press("ctrl+o")
            assert app.clipboard == app.last_answer().text
            await send(pilot, "/copy 2")
            assert app.clipboard == "ls\n"
            await send(pilot, "/copy 1")
            assert app.clipboard == "print(1)\n"
            await send(pilot, "/copy 7")
            assert app.clipboard == "print(1)\n"  # unchanged, a warning instead
            # the origin view of a finished answer is one key away
            await pilot.press("ctrl+t")
            await pilot.pause()
            assert not md.first().display and transcript_text(app).startswith("Use this:")

    run(body())


def test_colours_follow_the_theme():
    async def body():
        app = app_for(FakeBackend(), view="origin")
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send(pilot, "write add")
            chunk = app.query(TokenChunk).first()
            colours = {}
            for theme in ("textual-dark", "nord"):
                app.theme = theme
                await pilot.pause()
                accepted = chunk.origin_style("accepted").foreground
                target = chunk.origin_style("target").foreground
                colours[theme] = (accepted.hex.lower(), target.hex.lower())
                assert colours[theme] == (
                    app.theme_variables["text-success"].lower(),
                    app.theme_variables["text-accent"].lower(),
                )
                runs = styled_runs(chunk)
                assert any(text == "def add" and style.foreground == accepted for text, style in runs)
            assert colours["textual-dark"] != colours["nord"]

    run(body())


def test_a_long_answer_streams_in_chunks_without_losing_text():
    lines = [([f"line {i}"], "\n", ["x"]) for i in range(40)]
    backend = FakeBackend(ReplayDecoder(scripted_events(lines, first="")))

    async def body():
        app = app_for(backend, view="origin")
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send(pilot, "count")
            chunks = list(app.query(TokenChunk))
            assert len(chunks) >= 3  # only the newest chunk is repainted per block
            expected = "".join(f"line {i}\n" for i in range(40))
            assert "".join(c.committed_text for c in chunks) == expected == app.last_answer().text
            await pilot.press("ctrl+g")
            await pilot.pause()
            assert transcript_text(app) == expected

    run(body())


# -- stopping ------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["escape", "ctrl+c"])
def test_stop_mid_stream_keeps_the_partial_answer(key, tmp_path):
    gate = threading.Semaphore(0)
    many = [(["x"], "y", ["z"])] * 50
    backend = FakeBackend(ReplayDecoder(scripted_events(many, first="A"), gate=gate))

    async def body():
        app = app_for(backend, db_path=tmp_path / "chat.db")
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send(pilot, "go", wait=False)
            for _ in range(4):  # prefill + three blocks
                gate.release()
            await until(pilot, lambda: app.turn is not None and app.turn.text == "Axyxyxy")
            assert app.generating
            await pilot.press(key)
            gate.release()  # the stream reaches its next step and sees the cancel
            await until(pilot, lambda: not app.generating)
            turn = app.last_answer()
            assert turn.reason == "cancelled"
            assert turn.text.startswith("Axyxyxy") and len(turn.text) < 1 + 2 * 50
            assert app.messages[-1] == {"role": "assistant", "content": turn.text}
            assert "cancelled" in app.stats_bar.render().plain
            assert not app._exit_renderables and app.is_running  # still running: Ctrl-C once only stops
            return turn.text

    partial = run(body())
    store = ChatStore(tmp_path / "chat.db")
    (session,) = store.list_sessions()
    msgs = store.messages(session.id)
    assert [(m.role, m.content, m.reason) for m in msgs] == [("user", "go", None), ("assistant", partial, "cancelled")]


def test_second_ctrl_c_quits_and_ctrl_q_quits():
    async def body(keys):
        app = app_for(FakeBackend())
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            for k in keys:
                await pilot.press(k)
            await pilot.pause()
            return app.return_code, app._exit

    assert run(body(["ctrl+c", "ctrl+c"]))[1] is True
    assert run(body(["ctrl+q"]))[1] is True
    assert run(body(["ctrl+c"]))[1] is False  # one Ctrl-C only warns


# -- prompt ---------------------------------------------------------------------------------------


def test_prompt_history_recall_is_persisted(tmp_path):
    db = tmp_path / "chat.db"

    async def first():
        app = app_for(FakeBackend(), db_path=db)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send(pilot, "first question")
            await send(pilot, "second\nquestion")
            app.prompt.set_prompt("draft")
            await pilot.press("up")
            assert app.prompt.text == "second\nquestion"
            await pilot.press("up")  # the cursor is on the last line of a two-line prompt: moves up first
            assert app.prompt.text == "second\nquestion"
            await pilot.press("up")
            assert app.prompt.text == "first question"
            await pilot.press("down")
            assert app.prompt.text == "second\nquestion"
            await pilot.press("down", "down")
            assert app.prompt.text == "draft"

    async def second():
        app = app_for(FakeBackend(), db_path=db)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await pilot.press("up")
            assert app.prompt.text == "second\nquestion"

    run(first())
    run(second())


def test_enter_sends_and_shift_enter_or_paste_keep_newlines():
    backend = FakeBackend()

    async def body():
        from textual import events

        app = app_for(backend)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await pilot.press("a", "shift+enter", "b", "ctrl+j", "c")
            app.post_message(events.Paste("\nline 1\nline 2"))  # as the terminal driver does
            await pilot.pause()
            assert app.prompt.text == "a\nb\nc\nline 1\nline 2"
            assert backend.calls == []
            await pilot.press("enter")
            await until(pilot, lambda: not app.generating and backend.calls)
            assert backend.calls[0][0][-1] == {"role": "user", "content": "a\nb\nc\nline 1\nline 2"}
            assert app.prompt.text == ""

    run(body())


def test_conversation_context_system_prompt_and_new_chat():
    backend = FakeBackend()

    async def body():
        app = app_for(backend, system="be terse", params=SamplingParams(max_new_tokens=7))
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send(pilot, "q1")
            await send(pilot, "q2")
            messages, params, _ = backend.calls[1]
            assert messages == [
                {"role": "system", "content": "be terse"},
                {"role": "user", "content": "q1"},
                {"role": "assistant", "content": ANSWER},
                {"role": "user", "content": "q2"},
            ]
            assert params.max_new_tokens == 7
            await send(pilot, "/system you are a pirate")
            await pilot.press("ctrl+n")
            await pilot.pause()
            assert not app.query(AssistantTurn) and app.stats_bar.totals.generations == 0
            await send(pilot, "q3")
            assert backend.calls[2][0] == [
                {"role": "system", "content": "you are a pirate"},
                {"role": "user", "content": "q3"},
            ]
            # the editor (F2): Ctrl+S saves, an empty prompt clears it
            await pilot.press("f2")
            await pilot.pause()
            app.screen.query_one("#system-text").load_text("")
            await pilot.press("ctrl+s")
            await pilot.pause()
            assert app.system is None

    run(body())


def test_help_screen_lists_the_keys():
    async def body():
        app = app_for(FakeBackend())
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await pilot.press("f1")
            await pilot.pause()
            text = str(app.screen.query_one("#help-keys").render())
            for key in ("Esc", "Ctrl+C", "Ctrl+G", "Ctrl+O", "Up / Down", "/copy [N]", "Shift+Enter"):
                assert key in text
            await pilot.press("escape")
            await pilot.pause()
            assert app.screen is app.screen_stack[0]

    run(body())


# -- statistics -----------------------------------------------------------------------------------


def test_stats_bar_follows_every_block_then_the_final_stats():
    gate = threading.Semaphore(0)
    events = scripted_events()
    backend = FakeBackend(ReplayDecoder(events, gate=gate))

    async def body():
        app = app_for(backend)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send(pilot, "go", wait=False)
            prefill = events[0]
            assert isinstance(prefill, PrefillDone)
            gate.release()
            await until(pilot, lambda: app.tracker.generated == 1)
            line = app.stats_bar.current_line().plain
            assert line.startswith("now") and "1 tok" in line and f"TTFT {prefill.seconds * 1000:.0f} ms" in line
            seen = [prefill]
            for event in events[1:-1]:
                assert isinstance(event, BlockVerified)
                gate.release()
                seen.append(event)
                tokens = sum(len(e.tokens) for e in seen)
                await until(pilot, lambda tokens=tokens: app.tracker.generated == tokens)
                blocks = [e for e in seen if isinstance(e, BlockVerified)]
                accepted = sum(e.accepted for e in blocks)
                drafted = sum(len(e.draft) for e in blocks)
                seconds = sum(e.seconds for e in blocks) + prefill.seconds
                line = app.stats_bar.current_line().plain
                assert f"{tokens} tok " in line
                assert f"{tokens / seconds:.1f} tok/s" in line
                assert f"τ {(accepted + len(blocks)) / len(blocks):.2f}" in line
                assert f"accept {accepted / drafted * 100:.0f}%" in line
            gate.release()  # the Finished event
            await until(pilot, lambda: not app.generating)
            final = events[-1]
            assert isinstance(final, Finished)
            s = final.stats
            line = app.stats_bar.current_line().plain
            assert line.startswith("last") and line.endswith(final.reason)
            assert f"{s.generated_tokens} tok " in line and f"{s.tokens_per_second:.1f} tok/s" in line
            assert f"τ {s.tau:.2f}" in line and f"accept {s.acceptance_rate * 100:.0f}%" in line
            # per-slot bars: one cell per draft slot, full where every step accepted the slot
            slots = app.stats_bar.current_line().plain.split("slots ")[1].split("  hist")[0]
            assert len(slots) == 3 and slots[0] == "█"
            assert s.per_position_acceptance[0] == 1.0
            # a second answer: the session line sums both
            for _ in events:
                gate.release()
            await send(pilot, "again")
            session = app.stats_bar.session_line().plain
            assert f"{2 * s.generated_tokens} tok " in session and "2 answers" in session
            assert f"τ {s.tau:.2f}" in session

    run(body())


def test_tokens_copied_by_the_context_lookup_are_counted_once_finished():
    events = scripted_events()
    final = events[-1]
    assert isinstance(final, Finished)
    events[-1] = Finished(final.reason, dataclasses.replace(final.stats, lookup=16, copied_tokens=3))
    backend = FakeBackend(ReplayDecoder(events), ReplayDecoder(scripted_events()))

    async def body():
        app = app_for(backend)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send(pilot, "go")
            line = app.stats_bar.current_line().plain
            assert "3 copied" in line and line.endswith(final.reason)
            assert "· 3 copied ·" in app.summary(app.tracker)
            await send(pilot, "again")  # without lookup: nothing said
            assert "copied" not in app.stats_bar.current_line().plain
            assert "copied" not in app.summary(app.tracker)

    run(body())


# -- failures -------------------------------------------------------------------------------------


def test_decoder_error_shows_a_notification_restores_the_prompt_and_the_app_stays_usable():
    failing = ScriptedDecoder(BLOCKS, first="Hi", fail_after=2)
    backend = FakeBackend(failing, ReplayDecoder(scripted_events()))

    async def body():
        app = app_for(backend)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send(pilot, "explode please")
            notes = list(app._notifications)
            assert any(n.severity == "error" and "scripted failure" in n.message for n in notes)
            assert app.prompt.text == "explode please"
            failed = app.query(AssistantTurn).last()
            assert failed.failed and "scripted failure" in str(failed.query_one(".turn-footer").render())
            assert app.messages == []  # the failed turn is not part of the context
            await pilot.press("enter")  # send it again: works
            await until(pilot, lambda: not app.generating and len(backend.calls) == 2)
            await pilot.pause()
            assert app.last_answer().text == ANSWER and app.last_answer().reason == "length"
            assert backend.calls[1][0] == [{"role": "user", "content": "explode please"}]

    run(body())


def test_runtime_error_at_stream_start_is_one_line():
    class Refuses(FakeBackend):
        def stream_messages(self, messages, params, opts=None, cancel=None):  # noqa: ANN001
            raise InputError("the prompt is longer than the context (40000 > 32768 tokens); shorten it")

    async def body():
        app = app_for(Refuses())
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send(pilot, "huge")
            (note,) = [n for n in app._notifications if n.severity == "error"]
            assert note.message.startswith("the prompt is longer than the context")
            assert app.prompt.text == "huge"

    run(body())


def test_load_failure_shows_in_the_app_which_stays_usable():
    calls = []

    def factory(progress):
        calls.append(1)
        progress("resolving the pair")
        if len(calls) == 1:
            raise ModelNotFoundError("model 'org/missing' not found on the Hub; check the id")
        return FakeBackend()

    async def body():
        app = make_app(factory, ChatConfig())
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.load_error is not None)
            await pilot.pause()
            status = str(app.query_one("#status").render())
            assert "org/missing" in status and "/reload" in status
            assert any(n.severity == "error" and "org/missing" in n.message for n in app._notifications)
            await send(pilot, "hello?", wait=False)
            await pilot.pause()
            assert app.prompt.text == "hello?"  # kept: nothing is lost
            assert not app.query(AssistantTurn)
            app.prompt.clear()
            await send(pilot, "/reload", wait=False)
            await ready(pilot)
            await send(pilot, "hello again")
            assert app.last_answer().text == ANSWER

    run(body())


def test_load_progress_is_shown():
    release = threading.Event()

    def factory(progress):
        progress("loading tiny/target on cpu (float32)")
        release.wait(10)
        return FakeBackend()

    async def body():
        app = make_app(factory, ChatConfig())
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: "tiny/target on cpu" in str(app.query_one("#status").render()))
            release.set()
            await ready(pilot)
            await pilot.pause()
            assert "ready: tiny/target + tiny/drafter" in str(app.query_one("#status").render())
            assert app.sub_title.startswith("tiny/target + tiny/drafter")

    run(body())


# -- sessions -------------------------------------------------------------------------------------


def test_sessions_are_stored_and_reopen(tmp_path):
    db = tmp_path / "chat.db"

    async def chat():
        app = app_for(FakeBackend(), db_path=db, system="sys")
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send(pilot, "first")
            await send(pilot, "second")

    run(chat())
    store = ChatStore(db)
    (info,) = store.list_sessions()
    assert (info.title, info.turns, info.system, info.target) == ("first", 2, "sys", "tiny/target")
    stored = store.messages(info.id)
    assert [m.role for m in stored] == ["user", "assistant", "user", "assistant"]
    assert stored[1].content == ANSWER and stored[1].stats["generated_tokens"] == len(BLOCKS) * 0 + 13
    store.close()

    backend = FakeBackend()

    async def reopen():
        app = app_for(backend, db_path=db, resume=info.id)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await pilot.pause(0.1)
            assert len(app.query(AssistantTurn)) == 2
            assert app.stats_bar.totals.generations == 2
            await send(pilot, "third")
            assert backend.calls[0][0][0] == {"role": "system", "content": "sys"}
            assert [m["content"] for m in backend.calls[0][0][1:]] == ["first", ANSWER, "second", ANSWER, "third"]

    run(reopen())
    store = ChatStore(db)
    assert store.list_sessions()[0].turns == 3


def test_sessions_screen_opens_a_session(tmp_path):
    db = tmp_path / "chat.db"
    store = ChatStore(db)
    sid = store.new_session("old chat", "t", None, None)
    store.add_message(sid, "user", "old question")
    store.add_message(sid, "assistant", "old answer", reason="stop", stats={"generated_tokens": 2})
    store.close()

    async def body():
        app = app_for(FakeBackend(), db_path=db)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await pilot.press("ctrl+r")
            await pilot.pause()
            await pilot.press("enter")
            await pilot.pause(0.1)
            assert app.messages == [
                {"role": "user", "content": "old question"},
                {"role": "assistant", "content": "old answer"},
            ]
            assert app.last_answer().text == "old answer"

    run(body())


# -- a coloured transcript, as an SVG screenshot --------------------------------------------------


def _text_styles(svg: str) -> dict[str, set[str]]:
    """Map each text run of a Textual SVG screenshot to the CSS of the classes it is drawn with."""
    import re

    classes = dict(re.findall(r"\.(terminal-[\w-]+-r\d+) \{([^}]*)\}", svg))
    out: dict[str, set[str]] = {}
    for cls, text in re.findall(r'<text class="([^"]+)"[^>]*>([^<]*)</text>', svg):
        text = text.replace("&#160;", " ").strip()
        if text and cls in classes:
            out.setdefault(text, set()).add(" ".join(classes[cls].split()).lower())
    return out


def _fill(css: str) -> tuple[int, int, int]:
    import re

    hexa = re.search(r"fill: #([0-9a-f]{6})", css).group(1)  # type: ignore[union-attr]
    return int(hexa[0:2], 16), int(hexa[2:4], 16), int(hexa[4:6], 16)


async def _write_add(pilot: Any) -> None:
    await ready(pilot)
    pilot.app.query_one(PromptInput).cursor_blink = False  # a blinking cursor makes the picture random
    await send(pilot, "write add")
    await pilot.pause(0.1)


def test_svg_snapshot_of_a_coloured_transcript(snap_compare):
    """The picture of a coloured transcript equals the stored one (pytest-textual-snapshot; after a
    deliberate change: ``pytest tests/test_tui.py --snapshot-update``). CI pins Textual's version."""
    assert snap_compare(app_for(FakeBackend(), view="origin"), terminal_size=(100, 24), run_before=_write_add)


def test_transcript_colours_come_from_the_theme():
    async def body():
        app = app_for(FakeBackend(), view="origin")
        async with app.run_test(size=(100, 24)) as pilot:
            await _write_add(pilot)
            return app.export_screenshot(title="dflash chat"), app.theme_variables

    svg, variables = run(body())
    styles = _text_styles(svg)
    green, accent = (f"fill: {variables[k].lower()}" for k in ("text-success", "text-accent"))
    # accepted drafts in the success colour, the target's tokens in the accent colour (theme variables)
    assert (
        styles["def add"] == {green} and styles["a, b"] == {green} and any(green in c for c in styles["accepted draft"])
    )
    assert styles["Here:"] == {accent} and styles["):"] == {accent} and any(accent in c for c in styles["target token"])
    # rejected drafts: struck-through ghost text, drawn in the (dimmed) error colour
    (ghost,) = styles["- b"]
    assert "line-through" in ghost and green not in ghost and accent not in ghost
    r, g, b = _fill(ghost)
    er, eg, eb = _fill(f"fill: {variables['text-error'].lower()}")
    assert r > g and r > b and er > eg and er > eb  # the error hue, dimmed towards the background
    assert all("line-through" in c for c in styles["rejected draft"])


def test_a_turn_whose_prompt_the_cache_held_says_how_much():
    events = scripted_events()
    first = events[0]
    assert isinstance(first, PrefillDone)
    events[0] = dataclasses.replace(first, prompt_tokens=40, tokens_cached=31)
    backend = FakeBackend(ReplayDecoder(events), ReplayDecoder(scripted_events()))

    async def body():
        app = app_for(backend)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send(pilot, "go")
            assert "31/40 cached" in app.stats_bar.current_line().plain
            assert "(31/40 prompt tokens cached)" in app.summary(app.tracker)
            await send(pilot, "again")  # nothing cached: nothing said
            assert "cached" not in app.stats_bar.current_line().plain
            assert "cached" not in app.summary(app.tracker)

    run(body())
