"""Widgets of the chat app: the prompt, user and assistant turns, the legend and the stats bar.

Colours come from component classes styled in ``chat.tcss`` with theme variables; nothing here
names a colour.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Markdown, Static, TextArea

from runtime.engine.events import BlockVerified, PrefillDone, TokenEvent

from .stats import GenerationTracker, SessionTotals, bars, histogram_bars

ACCEPTED, TARGET, REJECTED, PLAIN = "accepted", "target", "rejected", "plain"  # plain: stored answers
COPIED = "copied"  # accepted tokens the context lookup copied from the prompt or answer
GHOST_NEWLINE = "↵"  # how a newline inside rejected drafts is shown
GHOST_BRANCHES = 4  # losing branches of a draft tree shown as ghost text
GHOST_BRANCH_SEP = "│"  # between two losing branches
CHUNK_LINES = 12  # a streaming answer is split into chunks of about this many lines


class OriginStyled(Widget):
    """Base of widgets that paint text by token origin (styles: ``.token--accepted`` etc.)."""

    COMPONENT_CLASSES = {"token--accepted", "token--copied", "token--target", "token--rejected"}

    def origin_style(self, kind: str) -> object:
        """The style of a token kind, from the stylesheet."""
        return self.get_visual_style(f"token--{kind}", partial=True)

    def show_ghost(self) -> bool:
        """Whether rejected drafts are shown (an app-wide toggle)."""
        return bool(getattr(self.app, "show_ghost", True))


class TokenChunk(OriginStyled):
    """A run of streamed text, kept as (text, kind) parts and painted at render time."""

    DEFAULT_CSS = "TokenChunk { height: auto; }"

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[tuple[str, str]] = []
        self.lines = 0

    def append(self, text: str, kind: str) -> None:
        """Add text of one kind (merged with the previous part when the kind is the same)."""
        if not text:
            return
        if self.parts and self.parts[-1][1] == kind:
            self.parts[-1] = (self.parts[-1][0] + text, kind)
        else:
            self.parts.append((text, kind))
        if kind != REJECTED:
            self.lines += text.count("\n")

    @property
    def committed_text(self) -> str:
        """The chunk's output text (ghost text excluded)."""
        return "".join(t for t, k in self.parts if k != REJECTED)

    def render(self) -> Content:
        ghost = self.show_ghost()
        styles = {k: self.origin_style(k) for k in (ACCEPTED, COPIED, TARGET, REJECTED)}
        styles[PLAIN] = ""
        return Content.assemble(*((t, styles[k]) for t, k in self.parts if ghost or k != REJECTED))  # type: ignore[arg-type]


class Legend(OriginStyled):
    """What the colours mean, and the ghost toggle's state."""

    DEFAULT_CSS = "Legend { height: 1; }"

    def render(self) -> Content:
        if not getattr(self.app, "per_token_status", True):
            return Content("plain text: this server does not report which tokens were drafted   F1 help")
        ghost = "shown" if self.show_ghost() else "hidden"
        return Content.assemble(
            ("accepted draft", self.origin_style(ACCEPTED)),  # type: ignore[arg-type]
            "  ",
            ("copied", self.origin_style(COPIED)),  # type: ignore[arg-type]
            "  ",
            ("target token", self.origin_style(TARGET)),  # type: ignore[arg-type]
            "  ",
            ("rejected draft", self.origin_style(REJECTED)),  # type: ignore[arg-type]
            f" ({ghost}; ctrl+g)   F1 help",
        )


class UserTurn(Static):
    """A prompt the user sent."""

    def __init__(self, text: str) -> None:
        super().__init__(Content(text), classes="user-turn")
        self.text = text


@dataclass(frozen=True)
class CodeBlock:
    """A fenced code block of an answer."""

    language: str
    code: str


def code_blocks(markdown: str) -> list[CodeBlock]:
    """Fenced and indented code blocks of a Markdown text, in order."""
    from markdown_it import MarkdownIt

    return [
        CodeBlock((tok.info or "").strip().split(" ")[0], tok.content)
        for tok in MarkdownIt("commonmark").parse(markdown)
        if tok.type in ("fence", "code_block")
    ]


class AssistantTurn(Vertical):
    """An answer: streamed chunks coloured by origin, then Markdown once finished.

    The answer's text and state are updated at once; the widgets follow as soon as the turn is
    mounted (events can arrive before that).
    """

    def __init__(self, view: str = "markdown", stored: tuple[str, str, str] | None = None, origin: bool = True) -> None:
        """``stored``: (text, finish reason, summary) of an answer from a stored session; ``origin``
        False: the backend does not report token origin, so streamed text is shown plain."""
        super().__init__(classes="assistant-turn")
        self.view = view
        self.origin = origin
        self.chunks: list[TokenChunk] = []
        self.finished = False
        self.reason: str | None = None
        self.failed: str | None = None
        self.blocks: list[CodeBlock] = []
        self.number = 0  # position among answers in the transcript
        self._text: list[str] = []
        self._ready = False
        self._pending: list[Callable[[], None]] = []
        if stored is not None:
            text, reason, summary = stored
            self._text.append(text)
            self._show(lambda: self._paint([(text, PLAIN)]))
            self.finish(reason, summary)

    def compose(self) -> ComposeResult:
        yield Static("", classes="turn-header")
        yield Vertical(classes="chunks")
        footer = Static("", classes="turn-footer")
        footer.display = False
        yield footer

    def on_mount(self) -> None:
        self._ready = True
        for step in self._pending:
            step()
        self._pending.clear()

    def _show(self, step: Callable[[], None]) -> None:
        """Run a widget update now, or once the turn is mounted."""
        if self._ready:
            step()
        else:
            self._pending.append(step)

    @property
    def text(self) -> str:
        """The committed answer text so far."""
        return "".join(self._text)

    def _live(self) -> TokenChunk:
        last = self.chunks[-1] if self.chunks else None
        if last is None or (last.lines >= CHUNK_LINES and last.committed_text.endswith("\n")):
            last = TokenChunk()
            self.chunks.append(last)
            self.query_one(".chunks", Vertical).mount(last)
        return last

    def _paint(self, parts: Sequence[tuple[str, str]]) -> None:
        chunk = self._live()
        for text, kind in parts:
            chunk.append(text, kind)
        chunk.refresh(layout=True)

    def add_tokens(self, tokens: Sequence[TokenEvent]) -> None:
        """Append committed tokens (e.g. the first token after prefill)."""
        parts = [(t.text, t.status.value if self.origin else PLAIN) for t in tokens]
        self._text.extend(t.text for t in tokens)
        self._show(lambda: self._paint(parts))

    def add_block(self, event: BlockVerified) -> None:
        """Append one verify step: accepted drafts, the rejected tail (a tree: its losing branches) as
        ghost text, the target's token."""
        if not self.origin:
            self.add_tokens(event.tokens)
            return
        # a rejected draft never breaks the answer's lines: its newlines show as a symbol
        # a draft tree lost several branches where the walk stopped: show the best few, split by a bar
        branches = event.losing_branches_text[:GHOST_BRANCHES]
        ghost = GHOST_BRANCH_SEP.join(branches).replace("\r\n", "\n").replace("\n", GHOST_NEWLINE)
        cut = min(event.accepted, len(event.tokens))
        copied = set(event.copied_path)  # accepted tokens the context lookup proposed
        parts: list[tuple[str, str]] = []
        for i, t in enumerate(event.tokens):
            if i == cut:
                parts.append((ghost, REJECTED))
            parts.append((t.text, COPIED if i in copied and i < cut else t.status.value))
        if cut >= len(event.tokens):
            parts.append((ghost, REJECTED))
        self._text.extend(t.text for t in event.tokens)
        self._show(lambda: self._paint(parts))

    def add_event(self, event: PrefillDone | BlockVerified) -> None:
        """Fold a streamed event in."""
        if isinstance(event, BlockVerified):
            self.add_block(event)
        else:
            self.add_tokens(event.tokens)

    def set_header(self, text: str) -> None:
        """The line above the answer (model, then a summary once finished)."""
        self._show(lambda: self.query_one(".turn-header", Static).update(Content(text)))

    def finish(self, reason: str, summary: str) -> None:
        """The answer is complete: list its code blocks and show it in the chosen view."""
        self.finished = True
        self.reason = reason
        self.blocks = code_blocks(self.text)
        self.set_header(summary)
        if self.blocks:
            labels = "  ".join(
                f"[{i}] {b.language or 'code'} · {b.code.count(chr(10)) or 1} lines"
                for i, b in enumerate(self.blocks, 1)
            )
            footer = Content(f"code blocks: {labels}   (/copy N)")
            self._show(lambda: self._footer(footer))
        self.set_view(self.view)

    def fail(self, message: str) -> None:
        """The generation failed: keep what arrived and say why."""
        self.finished = True
        self.failed = message
        self.add_class("-failed")
        self._show(lambda: self._footer(Content(f"error: {message}")))

    def _footer(self, content: Content) -> None:
        footer = self.query_one(".turn-footer", Static)
        footer.update(content)
        footer.display = True

    def set_view(self, view: str) -> None:
        """Show a finished answer as Markdown or coloured by origin."""
        self.view = view
        if self.finished and not self.failed:
            self._show(self._apply_view)

    def _apply_view(self) -> None:
        markdown = self.query(Markdown)
        chunks = self.query_one(".chunks")
        if self.view == "markdown":
            if not markdown:
                self.mount(Markdown(self.text, classes="answer-markdown"), after=chunks)
            else:
                markdown.first().display = True
            chunks.display = False
        else:
            if markdown:
                markdown.first().display = False
            chunks.display = True


class PromptInput(TextArea):
    """The multi-line prompt: Enter sends, Shift+Enter / Ctrl+J / Alt+Enter insert a newline, a paste
    keeps its newlines; Up on the first line and Down on the last line walk the prompt history."""

    NEWLINE_KEYS = ("shift+enter", "ctrl+j", "alt+enter")

    class Submitted(Message):
        """The user pressed Enter."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, history: Callable[[], list[str]] | None = None, **kw: object) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kw)  # type: ignore[arg-type]
        self._history_source = history or (lambda: [])
        self._history: list[str] = []
        self._pos: int | None = None  # index into history while browsing; None: editing the draft
        self._draft = ""

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self.text))
            return
        if event.key in self.NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return

    def set_prompt(self, text: str) -> None:
        """Replace the text and put the cursor at its end."""
        self.load_text(text)
        self.move_cursor(self.document.end)

    def reset_history(self) -> None:
        """Leave history browsing (after a send)."""
        self._pos = None
        self._draft = ""

    def action_cursor_up(self, select: bool = False) -> None:
        if not select and self.cursor_location[0] == 0 and self.history_prev():
            return
        super().action_cursor_up(select)

    def action_cursor_down(self, select: bool = False) -> None:
        if not select and self.cursor_location[0] == self.document.line_count - 1 and self.history_next():
            return
        super().action_cursor_down(select)

    def history_prev(self) -> bool:
        """Show the previous prompt; False when there is none."""
        if self._pos is None:
            self._history = self._history_source()
            if not self._history:
                return False
            self._draft = self.text
            self._pos = len(self._history)
        if self._pos == 0:
            return True
        self._pos -= 1
        self.set_prompt(self._history[self._pos])
        return True

    def history_next(self) -> bool:
        """Show the next prompt (or the draft after the newest); False when not browsing."""
        if self._pos is None:
            return False
        self._pos += 1
        if self._pos >= len(self._history):
            self._pos = None
            self.set_prompt(self._draft)
        else:
            self.set_prompt(self._history[self._pos])
        return True


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


class StatsBar(Widget):
    """Two lines: the current (or last) generation, and the session totals."""

    COMPONENT_CLASSES = {"stats--label", "stats--bars", "stats--dim"}
    DEFAULT_CSS = "StatsBar { height: 2; text-wrap: nowrap; text-overflow: ellipsis; }"

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.current: GenerationTracker | None = None
        self.totals = SessionTotals()
        self.running = False

    def show(self, current: GenerationTracker | None, totals: SessionTotals, running: bool) -> None:
        """Point the bar at new values and repaint."""
        self.current, self.totals, self.running = current, totals, running
        self.refresh()

    def _line(
        self,
        label: str,
        tokens: int,
        tps: float,
        ttft: float,
        tau: float | None,
        rate: float,
        drafted: bool,
        slots: Sequence[float],
        hist: Sequence[int],
        tail: str = "",
    ) -> Content:
        lab = self.get_visual_style("stats--label", partial=True)
        bar_style = self.get_visual_style("stats--bars", partial=True)
        dim = self.get_visual_style("stats--dim", partial=True)
        accept = f"{rate * 100:.0f}%" if drafted else "–"
        tau_text = "–" if tau is None else f"{tau:.2f}"
        return Content.assemble(
            (f"{label:<8}", lab),
            f"{tokens} tok  {tps:.1f} tok/s  TTFT {_ms(ttft)}  τ {tau_text}  accept {accept}  ",
            ("slots ", dim),
            (bars(slots), bar_style),
            ("  hist ", dim),
            (histogram_bars(hist), bar_style),
            (f"  {tail}" if tail else "", dim),
        )

    def current_line(self) -> Content:
        """The line of the current or last generation."""
        g = self.current
        if g is None:
            return Content.assemble(
                ("last", self.get_visual_style("stats--label", partial=True)), "    no generation yet"
            )
        label = "now" if self.running else "last"
        tail = "" if self.running else (f"{g.copied} copied  " if g.copied else "") + f"{g.reason}"
        if g.tokens_cached:
            tail = f"{g.tokens_cached}/{g.prompt_tokens} cached  " + tail
        return self._line(
            label,
            g.generated_tokens,
            g.tokens_per_second,
            g.ttft_seconds,
            g.tau if g.tau_known else None,
            g.acceptance_rate,
            g.drafted > 0,
            g.per_position,
            g.histogram,
            tail,
        )

    def session_line(self) -> Content:
        """The line of session totals."""
        s = self.totals
        return self._line(
            "session",
            s.generated,
            s.tokens_per_second,
            s.ttft_seconds,
            s.tau if s.steps or not s.generations else None,
            s.acceptance_rate,
            s.drafted > 0,
            s.per_position,
            s.histogram,
            f"{s.generations} answers",
        )

    def render(self) -> Content:
        return Content("\n").join([self.current_line(), self.session_line()])
