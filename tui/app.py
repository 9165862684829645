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

from textual.binding import Binding

from .commands import ChatCommands
from .config import BackendFactory, ChatConfig
from .generation import ChatGeneration


class ChatApp(ChatGeneration, ChatCommands):
    """``dflash chat``: layout and state (``layout``), loading and generation (``generation``), keys
    and slash commands (``commands``)."""

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


def make_app(backend_factory: BackendFactory, config: ChatConfig | None = None) -> ChatApp:
    """Build the chat app around a backend factory (tests pass one that returns a scripted backend)."""
    return ChatApp(backend_factory, config)
