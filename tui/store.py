"""Chat sessions and prompt history in SQLite (one file under dflash's state directory).

A session holds its turns (user prompts, answers with finish reason and statistics) and the
system prompt it used. Prompt history is global, like a shell's, for up/down recall.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    title TEXT NOT NULL DEFAULT '',
    target TEXT,
    drafter TEXT,
    system TEXT
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    created REAL NOT NULL,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    reason TEXT,
    stats TEXT
);
CREATE INDEX IF NOT EXISTS messages_session ON messages(session_id, id);
CREATE TABLE IF NOT EXISTS prompt_history (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created REAL NOT NULL,
    text TEXT NOT NULL
);
"""


@dataclass(frozen=True)
class SessionInfo:
    """One row of the session list."""

    id: int
    created: float
    updated: float
    title: str
    target: str | None
    drafter: str | None
    system: str | None
    turns: int
    tokens: int


@dataclass(frozen=True)
class StoredMessage:
    """One message of a session."""

    role: str
    content: str
    reason: str | None = None
    stats: dict[str, Any] | None = None


class ChatStore:
    """Sessions and prompt history in one SQLite file (``":memory:"`` keeps nothing on disk)."""

    def __init__(self, path: Path | str) -> None:
        self.path = path
        if isinstance(path, Path):
            path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), check_same_thread=False, timeout=5)
        try:
            self.db.execute("PRAGMA foreign_keys = ON")
            if path != ":memory:":
                check = self.db.execute("PRAGMA quick_check").fetchone()  # reads only; a damaged page shows here
                if check is None or check[0] != "ok":
                    raise sqlite3.DatabaseError(f"damaged database: {check[0] if check else 'no answer'}")
            with self.db:
                self.db.executescript(SCHEMA)
                self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")  # fails on a read-only file
        except BaseException:
            self.db.close()
            raise

    def close(self) -> None:
        """Close the database."""
        self.db.close()

    # -- sessions ----------------------------------------------------------------------------
    def new_session(self, title: str, target: str | None, drafter: str | None, system: str | None) -> int:
        """Create a session and return its id."""
        now = time.time()
        with self.db:
            cur = self.db.execute(
                "INSERT INTO sessions (created, updated, title, target, drafter, system) VALUES (?, ?, ?, ?, ?, ?)",
                (now, now, title[:200], target, drafter, system),
            )
        return int(cur.lastrowid or 0)

    def set_system(self, session_id: int, system: str | None) -> None:
        """Record the session's current system prompt."""
        with self.db:
            self.db.execute(
                "UPDATE sessions SET system = ?, updated = ? WHERE id = ?", (system, time.time(), session_id)
            )

    def add_message(
        self,
        session_id: int,
        role: str,
        content: str,
        reason: str | None = None,
        stats: dict[str, Any] | None = None,
    ) -> None:
        """Append a message to a session."""
        now = time.time()
        with self.db:
            self.db.execute(
                "INSERT INTO messages (session_id, created, role, content, reason, stats) VALUES (?, ?, ?, ?, ?, ?)",
                (session_id, now, role, content, reason, json.dumps(stats) if stats is not None else None),
            )
            self.db.execute("UPDATE sessions SET updated = ? WHERE id = ?", (now, session_id))

    def list_sessions(self, limit: int = 50, session_id: int | None = None) -> list[SessionInfo]:
        """Sessions, most recently used first (or only ``session_id``)."""
        where = "WHERE s.id = ?" if session_id is not None else ""
        args: tuple[int, ...] = (session_id, limit) if session_id is not None else (limit,)
        rows = self.db.execute(
            f"""
            SELECT s.id, s.created, s.updated, s.title, s.target, s.drafter, s.system,
                   (SELECT COUNT(*) FROM messages m WHERE m.session_id = s.id AND m.role = 'user'),
                   (SELECT COALESCE(SUM(json_extract(m.stats, '$.generated_tokens')), 0)
                      FROM messages m WHERE m.session_id = s.id AND m.stats IS NOT NULL)
            FROM sessions s {where} ORDER BY s.updated DESC, s.id DESC LIMIT ?
            """,
            args,
        ).fetchall()
        return [SessionInfo(*r[:7], turns=int(r[7]), tokens=int(r[8] or 0)) for r in rows]  # type: ignore[misc]

    def get_session(self, session_id: int) -> SessionInfo | None:
        """One session's row, or None."""
        found = self.list_sessions(limit=1, session_id=session_id)
        return found[0] if found else None

    def messages(self, session_id: int) -> list[StoredMessage]:
        """A session's messages in order."""
        rows = self.db.execute(
            "SELECT role, content, reason, stats FROM messages WHERE session_id = ? ORDER BY id", (session_id,)
        ).fetchall()
        return [StoredMessage(r[0], r[1], r[2], json.loads(r[3]) if r[3] else None) for r in rows]

    def delete_session(self, session_id: int) -> None:
        """Remove a session and its messages."""
        with self.db:
            self.db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))

    # -- prompt history ------------------------------------------------------------------------
    def add_prompt(self, text: str) -> None:
        """Remember a sent prompt (a repeat of the last one is not stored twice)."""
        last = self.db.execute("SELECT text FROM prompt_history ORDER BY id DESC LIMIT 1").fetchone()
        if last and last[0] == text:
            return
        with self.db:
            self.db.execute("INSERT INTO prompt_history (created, text) VALUES (?, ?)", (time.time(), text))

    def prompts(self, limit: int = 1000) -> list[str]:
        """The last ``limit`` prompts, oldest first."""
        rows = self.db.execute("SELECT text FROM prompt_history ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        return [r[0] for r in reversed(rows)]


def open_store(path: Path | None) -> tuple[ChatStore, str | None]:
    """The chat store at ``path``, or an in-memory one when that file cannot be used.

    Returns:
        (store, None), or (in-memory store, a one-line warning naming the file) when the file is
        damaged, not a database, read-only or locked. The file itself is left exactly as it was.
    """
    if path is None:
        return ChatStore(":memory:"), None
    try:
        return ChatStore(path), None
    except (sqlite3.Error, OSError) as e:
        return ChatStore(":memory:"), store_problem(path, e)


def store_problem(path: Path, error: BaseException) -> str:
    """What to tell the user about an unusable chat database."""
    return (
        f"chat history {path} cannot be used ({error}); this session is kept in memory only and the file is left "
        f"untouched. To start a fresh history, move it away (mv {path} {path}.bad) or fix its permissions."
    )


def session_title(text: str, width: int = 60) -> str:
    """A one-line title from the first prompt."""
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"


def format_sessions(sessions: Sequence[SessionInfo]) -> str:
    """The ``dflash chat --history`` table (plain text)."""
    if not sessions:
        return "no chat sessions yet"
    rows = [("id", "last used", "turns", "tokens", "model", "title")]
    for s in sessions:
        model = s.target or "?"
        if s.drafter:
            model += f" + {s.drafter}"
        rows.append(
            (
                str(s.id),
                time.strftime("%Y-%m-%d %H:%M", time.localtime(s.updated)),
                str(s.turns),
                str(s.tokens),
                model,
                s.title,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join(
        "  ".join(r[i].ljust(widths[i]) if i not in (0, 2, 3) else r[i].rjust(widths[i]) for i in range(5))
        + "  "
        + r[5]
        for r in rows
    )
