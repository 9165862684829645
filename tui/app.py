"""The chat app: a transcript coloured by token origin, a multi-line prompt and live statistics.

The app depends on the runtime's ``Backend`` protocol only (``capabilities``, ``describe`` and
``stream_messages``): a local pipeline or a remote server. Tokens are coloured by origin only when
the backend's capabilities say its events carry it (``per_token_origin``: vLLM and SGLang send plain
text, shown uncoloured with the statistics the server exposes). The app is built by
``make_app(backend_factory, config)``; the factory runs once in a worker thread (loading a model
can take a while) and generation runs in another worker thread that posts one message per runtime
event, so the UI never blocks.
"""

from __future__ import annotations

import time
from typing import Any

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.content import Content
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import Footer, Header, Static

from runtime.backend import Backend
from runtime.engine import CancelToken
from runtime.engine.events import BlockVerified, DecodeEvent, Finished

from .config import BackendFactory, ChatConfig
from .screens import HelpScreen, SessionsScreen, SystemPromptScreen
from .stats import GenerationTracker, SessionTotals
from .store import StoredMessage, open_store, session_title
from .widgets import AssistantTurn, Legend, PromptInput, StatsBar, TokenChunk, UserTurn

QUIT_WINDOW = 3.0  # seconds in which a second Ctrl-C quits


def error_text(error: BaseException) -> str:
    """One line for a failure (DFlashError messages already name the value and the fix)."""
    from runtime.errors import DFlashError

    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if isinstance(error, DFlashError):
        return text or type(error).__name__
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class ChatApp(App[None]):
    """``dflash chat``."""

    CSS_PATH = "chat.tcss"
    TITLE = "dflash chat"
    ENABLE_COMMAND_PALETTE = True
    BINDINGS = [
        Binding("escape", "stop", "Stop", show=True),
        Binding("ctrl+c", "interrupt", "Stop/Quit", show=False, priority=True),
        Binding("ctrl+q", "quit", "Quit", priority=True),
        Binding("ctrl+g", "toggle_ghost", "Ghost"),
        Binding("ctrl+t", "toggle_view", "View"),
        Binding("ctrl+o", "copy_answer", "Copy"),
        Binding("ctrl+n", "new_chat", "New"),
        Binding("ctrl+r", "sessions", "Sessions", show=False),
        Binding("f2", "system_prompt", "System", show=False),
        Binding("f1", "help", "Help"),
    ]

    show_ghost: reactive[bool] = reactive(True, init=False)

    # -- messages from worker threads (post_message is thread-safe) ---------------------------
    class LoadProgress(Message):
        """A line of loading progress."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    class Loaded(Message):
        """The backend is ready."""

        def __init__(self, backend: Backend) -> None:
            super().__init__()
            self.backend = backend

    class LoadFailed(Message):
        """The backend could not be built."""

        def __init__(self, error: BaseException) -> None:
            super().__init__()
            self.error = error

    class GenerationEvent(Message):
        """One runtime event of generation ``gen_id``."""

        def __init__(self, gen_id: int, event: DecodeEvent) -> None:
            super().__init__()
            self.gen_id = gen_id
            self.event = event

    class GenerationFailed(Message):
        """Generation ``gen_id`` raised."""

        def __init__(self, gen_id: int, error: BaseException) -> None:
            super().__init__()
            self.gen_id = gen_id
            self.error = error

    def __init__(self, backend_factory: BackendFactory, config: ChatConfig | None = None) -> None:
        super().__init__()
        self.config = config or ChatConfig()
        self.backend_factory = backend_factory
        self.backend: Backend | None = None
        self.model_info: dict[str, Any] = {}
        self.per_token_status = True  # the backend says which tokens were drafted (False: plain text)
        self.load_error: str | None = None
        self.store, self.store_warning = open_store(self.config.db_path)  # a damaged file: in memory, said once
        self.system = self.config.system
        self.view = self.config.view
        self.messages: list[dict[str, str]] = []
        self.session_id: int | None = None
        self.totals = SessionTotals()
        self.tracker: GenerationTracker | None = None
        self.turn: AssistantTurn | None = None
        self.pending_prompt = ""
        self.cancel: CancelToken | None = None
        self.gen_id = 0
        self.answers = 0
        self._ctrl_c_at = -1e9
        self.set_reactive(ChatApp.show_ghost, self.config.show_ghost)

    # -- layout ------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with VerticalScroll(id="transcript"):
            yield Static(Content("loading the model…"), id="status")
        yield Legend()
        yield StatsBar(id="stats")
        yield PromptInput(history=self.store.prompts, id="prompt")
        yield Footer()

    @property
    def prompt(self) -> PromptInput:
        """The prompt widget."""
        return self.query_one("#prompt", PromptInput)

    @property
    def transcript(self) -> VerticalScroll:
        """The scrolling transcript."""
        return self.query_one("#transcript", VerticalScroll)

    @property
    def stats_bar(self) -> StatsBar:
        """The live statistics."""
        return self.query_one("#stats", StatsBar)

    @property
    def generating(self) -> bool:
        """True while an answer streams."""
        return self.cancel is not None

    def on_mount(self) -> None:
        self.sub_title = self.config.model_label or "loading…"
        self.transcript.anchor()
        self.prompt.focus()
        if self.config.resume is not None:
            self.open_session(self.config.resume)
        self.stats_bar.show(self.tracker, self.totals, running=False)
        if self.store_warning:
            self.notify(self.store_warning, title="chat history not saved", severity="warning", timeout=30)
        self.load_backend()

    def on_unmount(self) -> None:
        if self.cancel is not None:
            self.cancel.cancel()
        self.store.close()

    # -- loading -----------------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="load", exit_on_error=False)
    def load_backend(self) -> None:
        """Build the backend in a worker thread; progress and the outcome come back as messages."""
        try:

            def progress(text: str) -> None:
                self.post_message(self.LoadProgress(text))

            backend = self.backend_factory(progress)
        except Exception as e:
            self.post_message(self.LoadFailed(e))
        else:
            self.post_message(self.Loaded(backend))

    def _status(self, text: str, error: bool = False) -> None:
        status = self.query_one("#status", Static)
        status.update(Content(text))
        status.set_class(error, "-error")

    def on_chat_app_load_progress(self, message: LoadProgress) -> None:
        self._status(f"loading: {message.text}")

    def on_chat_app_loaded(self, message: Loaded) -> None:
        self.backend = message.backend
        self.load_error = None
        try:
            self.model_info = dict(message.backend.describe())
        except Exception:
            self.model_info = {}
        try:
            self.per_token_status = message.backend.capabilities.per_token_origin
        except Exception:
            self.per_token_status = False
        self.query_one(Legend).refresh()
        label = self.model_label()
        self.sub_title = label
        self._status(f"ready: {label}")

    def on_chat_app_load_failed(self, message: LoadFailed) -> None:
        self.backend = None
        self.load_error = error_text(message.error)
        self._status(f"model not loaded: {self.load_error}  (/reload retries)", error=True)
        self.sub_title = "no model"
        self.notify(self.load_error, title="loading failed", severity="error", timeout=10)

    def model_label(self) -> str:
        """Target (+ drafter), device, dtype, block size: what the header shows."""
        info = self.model_info
        if not info:
            return self.config.model_label
        name = str(info.get("target") or "?")
        if info.get("drafter"):
            name += f" + {info['drafter']}"
        extras = [str(info[k]) for k in ("device", "dtype") if info.get(k)]
        if info.get("block_size"):
            extras.append(f"block {info['block_size']}")
        if self.config.decode.decoder == "ar":
            extras.append("plain decoding")
        label = name + (f" · {' '.join(extras)}" if extras else "")
        if info.get("server"):  # a remote backend
            engine = "dflash serve" if info.get("engine") == "dflash" else info.get("engine") or "server"
            label += f" · {engine} at {info['server']}"
        return label

    # -- sending -----------------------------------------------------------------------------
    def on_prompt_input_submitted(self, message: PromptInput.Submitted) -> None:
        self.submit(message.text)

    def submit(self, text: str) -> None:
        """Send a prompt or run a /command (the text stays in the prompt when it cannot be sent)."""
        if not text.strip():
            return
        if text.startswith("/") and not text.startswith("//"):
            self.run_command(text)
            return
        if text.startswith("//"):
            text = text[1:]
        if self.generating:
            self.notify("an answer is still streaming; Esc stops it", severity="warning")
            return
        if self.backend is None:
            if self.load_error:
                self.notify(f"no model: {self.load_error} (/reload retries)", severity="error")
            else:
                self.notify("the model is still loading", severity="warning")
            return
        self.store.add_prompt(text)
        self.prompt.clear()
        self.prompt.reset_history()
        self.pending_prompt = text
        self.messages.append({"role": "user", "content": text})
        conversation = ([{"role": "system", "content": self.system}] if self.system else []) + list(self.messages)
        self.transcript.mount(UserTurn(text))
        turn = AssistantTurn(view=self.view, origin=self.per_token_status)
        self.transcript.mount(turn)
        turn.set_header("waiting for the first token…")
        self.transcript.anchor()
        self.turn = turn
        block = int(self.model_info.get("block_size") or 1)
        self.tracker = GenerationTracker(slots=max(block - 1, 0), origin=self.per_token_status)
        self.cancel = CancelToken()
        self.gen_id += 1
        self.stats_bar.show(self.tracker, self.totals, running=True)
        self.generate(conversation, self.cancel, self.gen_id)

    @work(thread=True, exclusive=True, group="generation", exit_on_error=False)
    def generate(self, conversation: list[dict[str, str]], cancel: CancelToken, gen_id: int) -> None:
        """Stream one answer in a worker thread, one message per event."""
        backend = self.backend
        assert backend is not None
        finished = False
        try:
            for event in backend.stream_messages(conversation, self.config.params, self.config.decode, cancel):
                self.post_message(self.GenerationEvent(gen_id, event))
                finished = finished or isinstance(event, Finished)
        except Exception as e:
            self.post_message(self.GenerationFailed(gen_id, e))
            return
        if not finished:
            self.post_message(self.GenerationFailed(gen_id, RuntimeError("the backend ended without finishing")))

    def on_chat_app_generation_event(self, message: GenerationEvent) -> None:
        if message.gen_id != self.gen_id or self.turn is None or self.tracker is None:
            return
        event, turn, tracker = message.event, self.turn, self.tracker
        tracker.update(event)
        if isinstance(event, Finished):
            self.finish(event)
            return
        if event.tokens or (isinstance(event, BlockVerified) and event.draft):
            turn.add_event(event)
        if event.type == "prefill":
            turn.set_header("streaming… (Esc stops)")
        self.stats_bar.show(tracker, self.totals, running=True)

    def finish(self, event: Finished) -> None:
        """Close the answer: summary, Markdown, statistics, storage."""
        turn, tracker = self.turn, self.tracker
        assert turn is not None and tracker is not None
        self.cancel = None
        self.totals.add(tracker)
        self.answers += 1
        turn.number = self.answers
        turn.finish(event.reason, self.summary(tracker))
        answer = turn.text
        if event.reason != "cancelled" or answer:
            self.messages.append({"role": "assistant", "content": answer})
        else:  # stopped before any text: forget the question, as if it was never sent
            self.messages.pop()
        self.save_turn(self.pending_prompt, answer, event.reason, tracker.to_json())
        self.stats_bar.show(tracker, self.totals, running=False)
        if event.reason == "cancelled":
            self.notify("stopped; the partial answer is kept", timeout=3)

    def summary(self, tracker: GenerationTracker) -> str:
        """The header line of a finished answer."""
        line = (
            f"{tracker.generated_tokens} tok · {tracker.tokens_per_second:.1f} tok/s"
            f" · TTFT {tracker.ttft_seconds * 1000:.0f} ms"
        )
        if tracker.tokens_cached:  # the prompt cache held the conversation so far
            line += f" ({tracker.tokens_cached}/{tracker.prompt_tokens} prompt tokens cached)"
        if tracker.drafted:
            line += f" · τ {tracker.tau:.2f} · accept {tracker.acceptance_rate * 100:.0f}%"
        if tracker.copied:
            line += f" · {tracker.copied} copied"
        return line + f" · {tracker.reason}"

    def on_chat_app_generation_failed(self, message: GenerationFailed) -> None:
        if message.gen_id != self.gen_id:
            return
        text = error_text(message.error)
        self.cancel = None
        if self.turn is not None:
            self.turn.fail(text)
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()
        if not self.prompt.text.strip():
            self.prompt.set_prompt(self.pending_prompt)  # nothing is lost: the prompt comes back
        self.stats_bar.show(self.tracker, self.totals, running=False)
        self.notify(text, title="generation failed", severity="error", timeout=10)
        self.prompt.focus()

    def save_turn(self, prompt: str, answer: str, reason: str, stats: dict[str, Any]) -> None:
        """Persist a finished turn (the session is created with its first turn)."""
        if self.session_id is None:
            self.session_id = self.store.new_session(
                session_title(prompt), self.model_info.get("target"), self.model_info.get("drafter"), self.system
            )
        self.store.add_message(self.session_id, "user", prompt)
        self.store.add_message(self.session_id, "assistant", answer, reason=reason, stats=stats)

    # -- actions -----------------------------------------------------------------------------
    def action_stop(self) -> None:
        """Stop the generation after the current verify step; the partial answer stays."""
        if self.cancel is not None and not self.cancel.cancelled:
            self.cancel.cancel()
            if self.turn is not None:
                self.turn.set_header("stopping…")

    def action_interrupt(self) -> None:
        """Ctrl-C: stop a generation; a second Ctrl-C within a few seconds quits."""
        now = time.monotonic()
        if self.generating:
            self.action_stop()
            self._ctrl_c_at = now
            return
        if now - self._ctrl_c_at <= QUIT_WINDOW:
            self.exit()
            return
        self._ctrl_c_at = now
        self.notify("press Ctrl-C again to quit (or Ctrl-Q)", timeout=QUIT_WINDOW)

    async def action_quit(self) -> None:
        if self.cancel is not None:
            self.cancel.cancel()
        self.exit()

    def watch_show_ghost(self, show: bool) -> None:
        for widget in self.query(TokenChunk):
            widget.refresh(layout=True)
        self.query_one(Legend).refresh()

    def action_toggle_ghost(self) -> None:
        """Show or hide the rejected drafts."""
        self.show_ghost = not self.show_ghost

    def action_toggle_view(self) -> None:
        """Finished answers as Markdown or coloured by token origin."""
        self.view = "origin" if self.view == "markdown" else "markdown"
        for turn in self.query(AssistantTurn):
            turn.set_view(self.view)
        self.notify(f"finished answers: {'Markdown' if self.view == 'markdown' else 'coloured by origin'}", timeout=2)

    def last_answer(self) -> AssistantTurn | None:
        """The newest finished answer with text."""
        for turn in reversed(list(self.query(AssistantTurn))):
            if turn.finished and turn.text:
                return turn
        return None

    def action_copy_answer(self) -> None:
        """Copy the last answer (OSC 52)."""
        self.copy_block(None)

    def copy_block(self, number: int | None) -> None:
        """Copy the last answer, or its code block ``number`` (1-based)."""
        turn = self.last_answer()
        if turn is None:
            self.notify("nothing to copy yet", severity="warning")
            return
        if number is None:
            self.copy_to_clipboard(turn.text)
            self.notify(f"copied the last answer ({len(turn.text)} characters)", timeout=2)
            return
        if not 1 <= number <= len(turn.blocks):
            have = f"1..{len(turn.blocks)}" if turn.blocks else "none"
            self.notify(f"no code block {number} in the last answer (it has {have})", severity="warning")
            return
        code = turn.blocks[number - 1].code
        self.copy_to_clipboard(code)
        self.notify(f"copied code block {number} ({len(code)} characters)", timeout=2)

    def action_new_chat(self) -> None:
        """Start a new conversation: empty transcript and context."""
        if self.generating:
            self.notify("an answer is still streaming; Esc stops it", severity="warning")
            return
        self.clear_transcript()
        self.notify("new conversation", timeout=2)

    def clear_transcript(self) -> None:
        """Forget the conversation on screen and in the context (stored sessions stay)."""
        for widget in list(self.transcript.children):
            if widget.id != "status":
                widget.remove()
        self.messages = []
        self.session_id = None
        self.tracker = None
        self.turn = None
        self.totals = SessionTotals()
        self.answers = 0
        self.stats_bar.show(None, self.totals, running=False)

    def action_help(self) -> None:
        """Show the keys."""
        self.push_screen(HelpScreen())

    def action_sessions(self) -> None:
        """Pick a stored session to open."""
        if self.generating:
            self.notify("an answer is still streaming; Esc stops it", severity="warning")
            return

        def opened(session_id: int | None) -> None:
            if session_id is not None:
                self.open_session(session_id)

        self.push_screen(SessionsScreen(self.store.list_sessions()), opened)

    def open_session(self, session_id: int) -> None:
        """Replace the conversation with a stored session (its answers as Markdown)."""
        info = self.store.get_session(session_id)
        if info is None:
            self.notify(f"no session {session_id}", severity="error")
            return
        self.clear_transcript()
        self.session_id = session_id
        self.system = info.system
        messages: list[StoredMessage] = self.store.messages(session_id)
        for m in messages:
            if m.role == "user":
                self.messages.append({"role": "user", "content": m.content})
                self.transcript.mount(UserTurn(m.content))
            elif m.role == "assistant":
                self.messages.append({"role": "assistant", "content": m.content})
                self.replay_answer(m)
        self.notify(f"opened session {session_id}: {info.title}", timeout=3)

    def replay_answer(self, m: StoredMessage) -> None:
        """Show a stored answer and count its statistics in the session totals."""
        self.answers += 1
        summary = f"stored answer · {m.reason or 'stop'}"
        if m.stats:
            summary = (
                f"stored answer · {m.stats.get('generated_tokens', 0)} tok"
                f" · {float(m.stats.get('tokens_per_second', 0.0)):.1f} tok/s · {m.reason or 'stop'}"
            )
            self.totals.add_record(m.stats)
        turn = AssistantTurn(view=self.view, stored=(m.content, m.reason or "stop", summary))
        turn.number = self.answers
        self.transcript.mount(turn)
        self.stats_bar.show(None, self.totals, running=False)

    def action_system_prompt(self) -> None:
        """Edit the system prompt in a dialog."""

        def saved(text: str | None) -> None:
            if text is not None:
                self.set_system(text)

        self.push_screen(SystemPromptScreen(self.system), saved)

    def set_system(self, text: str) -> None:
        """Use a new system prompt from the next answer on (empty: none)."""
        self.system = text.strip() or None
        if self.session_id is not None:
            self.store.set_system(self.session_id, self.system)
        self.notify("system prompt " + ("set" if self.system else "cleared"), timeout=2)

    def run_command(self, text: str) -> None:
        """Slash commands; the prompt is cleared when one ran."""
        name, _, arg = text[1:].partition(" ")
        name, arg = name.strip().lower(), arg.strip()
        if name == "copy":
            if arg and not arg.isdigit():
                self.notify("usage: /copy [N]", severity="warning")
                return
            self.copy_block(int(arg) if arg else None)
        elif name == "system":
            if arg:
                self.set_system(arg)
            else:
                self.action_system_prompt()
        elif name in ("clear", "new"):
            self.action_new_chat()
        elif name in ("sessions", "history"):
            self.action_sessions()
        elif name == "ghost":
            self.action_toggle_ghost()
        elif name == "view":
            self.action_toggle_view()
        elif name == "reload":
            if self.generating:
                self.notify("an answer is still streaming; Esc stops it", severity="warning")
                return
            self.backend = None
            self.load_error = None
            self._status("loading the model…")
            self.load_backend()
        elif name == "help":
            self.action_help()
        elif name in ("quit", "exit"):
            self.exit()
        else:
            self.notify(f"unknown command /{name}; F1 lists them (start with // to send a literal /)", severity="error")
            return
        self.prompt.clear()


def make_app(backend_factory: BackendFactory, config: ChatConfig | None = None) -> ChatApp:
    """Build the chat app around a backend factory (tests pass one that returns a scripted backend)."""
    return ChatApp(backend_factory, config)
