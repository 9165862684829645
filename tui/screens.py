"""Modal screens: key help, stored sessions, the system prompt editor."""

from __future__ import annotations

import time
from collections.abc import Sequence

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static, TextArea
from textual.widgets.option_list import Option

from .store import SessionInfo

KEYS: list[tuple[str, str]] = [
    ("Enter", "send the prompt"),
    ("Shift+Enter, Ctrl+J", "new line in the prompt (also Alt+Enter; a paste keeps its newlines)"),
    ("Up / Down", "previous / next prompt from the history (on the first / last line)"),
    ("Esc", "stop the generation, keep the partial answer"),
    ("Ctrl+C", "stop the generation; press twice to quit"),
    ("Ctrl+Q", "quit"),
    ("Ctrl+G", "show / hide rejected drafts (ghost text)"),
    ("Ctrl+T", "finished answers as Markdown / coloured by origin"),
    ("Ctrl+O", "copy the last answer to the clipboard (OSC 52)"),
    ("Ctrl+N", "new conversation (clears the transcript and the context)"),
    ("Ctrl+R", "open a stored session"),
    ("F2", "edit the system prompt"),
    ("Ctrl+P", "command palette (themes, ...)"),
    ("F1", "this help"),
]
COMMANDS: list[tuple[str, str]] = [
    ("/copy [N]", "copy the last answer, or its code block N"),
    ("/system [TEXT]", "set the system prompt (no text: open the editor)"),
    ("/clear, /new", "new conversation"),
    ("/sessions", "open a stored session"),
    ("/ghost, /view", "the toggles of Ctrl+G and Ctrl+T"),
    ("/reload", "load the model again (after a failure)"),
    ("/help, /quit", "this help; quit"),
]
LEGEND = (
    "Colours: accepted drafts (proposed by the drafter, verified by the target) in the success colour; "
    "copied tokens (proposed by the context lookup from the prompt or answer, verified) in the warning colour; "
    "the target's own tokens (first token, the correction/bonus after each accepted prefix, every token "
    "of plain decoding) in the accent colour; rejected drafts as struck-through ghost text right after "
    "the accepted prefix.\n"
    "Stats: tok/s end to end, TTFT, τ = tokens per verify step, accept = accepted / drafted, per-slot = "
    "acceptance of each draft position, hist = verify steps per accepted length (0 on the left)."
)


class HelpScreen(ModalScreen[None]):
    """Keys, slash commands and what the colours and stats mean."""

    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        width = max(len(k) for k, _ in KEYS + COMMANDS)
        lines = [f"{k.ljust(width)}  {v}" for k, v in KEYS] + [""] + [f"{k.ljust(width)}  {v}" for k, v in COMMANDS]
        with Vertical():
            yield Static("dflash chat: keys", classes="title")
            with VerticalScroll():
                yield Static(Content("\n".join(lines)), id="help-keys")
                yield Static(Content(LEGEND), classes="hint")
            yield Static("Esc closes", classes="hint")

    def action_dismiss(self, result: None = None) -> None:  # type: ignore[override]
        self.dismiss(None)


class SessionsScreen(ModalScreen[int | None]):
    """Pick a stored session; dismisses with its id (None: cancelled)."""

    BINDINGS = [Binding("escape", "cancel", "Close")]

    def __init__(self, sessions: Sequence[SessionInfo]) -> None:
        super().__init__()
        self.sessions = list(sessions)

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("Stored sessions", classes="title")
            if not self.sessions:
                yield Static("no chat sessions yet")
            else:
                yield OptionList(
                    *(
                        Option(
                            Content(
                                f"#{s.id:<4} {time.strftime('%Y-%m-%d %H:%M', time.localtime(s.updated))}  "
                                f"{s.turns:>3} turns  {s.title}"
                            ),
                            id=str(s.id),
                        )
                        for s in self.sessions
                    )
                )
            yield Static("Enter opens, Esc closes", classes="hint")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id or 0))

    def action_cancel(self) -> None:
        self.dismiss(None)


class SystemPromptScreen(ModalScreen[str | None]):
    """Edit the system prompt; Ctrl+S saves (empty: none), Esc cancels."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save", priority=True)]

    def __init__(self, current: str | None) -> None:
        super().__init__()
        self.current = current or ""

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("System prompt", classes="title")
            yield TextArea(self.current, id="system-text", soft_wrap=True)
            yield Static("Ctrl+S saves (empty: no system prompt), Esc cancels", classes="hint")

    def on_mount(self) -> None:
        self.query_one("#system-text", TextArea).focus()

    def action_save(self) -> None:
        self.dismiss(self.query_one("#system-text", TextArea).text)

    def action_cancel(self) -> None:
        self.dismiss(None)
