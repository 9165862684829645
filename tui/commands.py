"""The chat app's keys and slash commands: stop and quit, ghost drafts and views, copying answers and
code blocks, new chats, stored sessions, the system prompt, /reload."""

from __future__ import annotations

import time

from .layout import ChatLayout
from .screens import HelpScreen, SessionsScreen, SystemPromptScreen
from .stats import SessionTotals
from .store import StoredMessage
from .widgets import AssistantTurn, Legend, TokenChunk, UserTurn

QUIT_WINDOW = 3.0  # seconds in which a second Ctrl-C quits


class ChatCommands(ChatLayout):
    """Actions bound to keys (``action_*``) and the slash commands that reach them."""

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
