"""The chat app's state and layout: the transcript, legend, statistics bar and prompt, and what a
conversation holds (messages, session, totals, the running generation). ``ChatApp`` adds the
generation worker (``generation``) and the keys and slash commands (``commands``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from textual.app import App, ComposeResult
from textual.containers import VerticalScroll
from textual.content import Content
from textual.reactive import reactive
from textual.widgets import Footer, Header, Static

from runtime.backend import Backend
from runtime.engine import CancelToken

from .config import BackendFactory, ChatConfig
from .stats import GenerationTracker, SessionTotals
from .store import open_store
from .widgets import AssistantTurn, Legend, PromptInput, StatsBar


class ChatLayout(App[None]):
    """The widgets and the conversation's state (the base of ``ChatApp``)."""

    CSS_PATH = "chat.tcss"
    TITLE = "dflash chat"
    ENABLE_COMMAND_PALETTE = True

    show_ghost: reactive[bool] = reactive(True, init=False)

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
        self.set_reactive(ChatLayout.show_ghost, self.config.show_ghost)

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

    def _status(self, text: str, error: bool = False) -> None:
        status = self.query_one("#status", Static)
        status.update(Content(text))
        status.set_class(error, "-error")

    if TYPE_CHECKING:  # defined by ChatGeneration and ChatCommands, each used by the other

        def load_backend(self) -> object: ...

        def run_command(self, text: str) -> None: ...
