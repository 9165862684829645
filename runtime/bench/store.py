"""Bench history: every ``dflash bench`` run stored in SQLite, listed and compared.

The database holds one row per run (the JSON document of ``BenchResult.to_json`` plus a few
columns for listing) and one row per method with its headline numbers. The CLI passes the path
(under ``dflash_cli.common.state_dir()``); nothing here reads the environment.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import DFlashError, InputError

SCHEMA_VERSION = 1
LOCK_TIMEOUT = 10.0  # seconds to wait for another process's lock
_DDL = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created TEXT NOT NULL,
    label TEXT,
    target TEXT,
    drafter TEXT,
    dataset TEXT,
    prompts INTEGER,
    max_tokens INTEGER,
    device TEXT,
    dtype TEXT,
    document TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS method_results (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    name TEXT NOT NULL,
    tok_s REAL,
    ttft REAL,
    tau REAL,
    acceptance REAL,
    speedup REAL,
    PRIMARY KEY (run_id, name)
);
"""


@dataclass(frozen=True)
class RunSummary:
    """One line of ``dflash bench history``."""

    id: int
    created: str
    label: str | None
    target: str
    drafter: str | None
    dataset: str
    prompts: int
    max_tokens: int
    device: str
    dtype: str
    methods: dict[str, dict[str, float | None]]

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return dict(self.__dict__)


class BenchStore:
    """The SQLite file of bench runs.

    Args:
        path: database file (created with its folder on first write).
    """

    def __init__(self, path: Path, lock_timeout: float = LOCK_TIMEOUT) -> None:
        self.path = Path(path)
        self.lock_timeout = lock_timeout

    @contextmanager
    def _connect(self, create: bool) -> Iterator[sqlite3.Connection]:
        """A connection: read-only for reads (no schema change, no write lock), read-write to save."""
        if not create and not self.path.exists():
            raise InputError(f"no bench runs recorded yet ({self.path} does not exist); run `dflash bench` first")
        try:
            if create:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                con = sqlite3.connect(self.path, timeout=self.lock_timeout)
            else:
                uri = self.path.resolve().as_uri() + "?mode=ro"
                con = sqlite3.connect(uri, uri=True, timeout=self.lock_timeout)
            with closing(con):
                con.execute("PRAGMA foreign_keys = ON")
                version = con.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise DFlashError(
                        f"bench history {self.path} was written by a newer dflash (schema {version}); upgrade dflash"
                    )
                if create:  # schema changes only when writing
                    con.executescript(_DDL)
                    con.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                elif not con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'runs'").fetchone():
                    con.executescript(_DDL.replace("CREATE TABLE", "CREATE TEMP TABLE"))  # empty: nothing saved yet
                with con:
                    yield con
        except sqlite3.OperationalError as e:
            if "locked" in str(e) or "busy" in str(e):
                raise DFlashError(
                    f"bench history {self.path} is locked by another process (waited {self.lock_timeout:g} s); "
                    "try again when it has finished"
                ) from None
            raise self._unreadable(e, create) from None
        except sqlite3.DatabaseError as e:
            raise self._unreadable(e, create) from None
        except OSError as e:
            raise DFlashError(f"cannot open bench history {self.path}: {e}") from None

    def _unreadable(self, e: Exception, create: bool) -> DFlashError:
        if create and ("readonly" in str(e) or "read-only" in str(e)):
            return DFlashError(f"cannot save to bench history {self.path}: it is read-only ({e})")
        if "unable to open" in str(e):
            return DFlashError(f"cannot open bench history {self.path} ({e}); check its permissions")
        return DFlashError(
            f"bench history {self.path} is unreadable ({e}); dflash leaves it as it is: move it away to start a new one"
        )

    def save(self, document: dict[str, Any], label: str | None = None) -> int:
        """Store a run's JSON document; returns its run id (also written into ``document``)."""
        env, ds, cfg = document["environment"], document["dataset"], document["config"]
        with self._connect(create=True) as con:
            cur = con.execute(
                "INSERT INTO runs (created, label, target, drafter, dataset, prompts, max_tokens, device, dtype, "
                "document) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, '{}')",
                (
                    document["created"],
                    label,
                    env["target"]["id"],
                    (env.get("drafter") or {}).get("id"),
                    ds["name"],
                    ds["count"],
                    cfg["max_new_tokens"],
                    env["device"],
                    env["dtype"],
                ),
            )
            run_id = int(cur.lastrowid or 0)
            document["run_id"] = run_id
            document["label"] = label
            con.execute("UPDATE runs SET document = ? WHERE id = ?", (json.dumps(document), run_id))
            con.executemany(
                "INSERT INTO method_results VALUES (?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        run_id,
                        m["name"],
                        m["tokens_per_second"]["median"],
                        m["ttft_seconds"],
                        m["tau"],
                        m["acceptance_rate"],
                        m["speedup"],
                    )
                    for m in document["methods"]
                ],
            )
        return run_id

    def history(self, limit: int | None = 20) -> list[RunSummary]:
        """The latest runs, newest first."""
        if not self.path.exists():
            return []
        with self._connect(create=False) as con:
            rows = con.execute(
                "SELECT id, created, label, target, drafter, dataset, prompts, max_tokens, device, dtype "
                "FROM runs ORDER BY id DESC LIMIT ?",
                (limit if limit is not None else -1,),
            ).fetchall()
            out = []
            for r in rows:
                methods = {
                    name: {"tok_s": tok_s, "ttft": ttft, "tau": tau, "acceptance": acc, "speedup": sp}
                    for name, tok_s, ttft, tau, acc, sp in con.execute(
                        "SELECT name, tok_s, ttft, tau, acceptance, speedup FROM method_results WHERE run_id = ? "
                        "ORDER BY rowid",
                        (r[0],),
                    )
                }
                out.append(RunSummary(*r, methods=methods))  # type: ignore[misc]  # mypy cannot count a row
        return out

    def resolve_id(self, ref: str) -> int:
        """A run id from ``ref``: a number, or ``last`` / ``prev`` (the newest and the one before).

        Raises:
            InputError: not a run id, or no such run.
        """
        key = ref.strip().lower()
        if key in ("last", "latest", "prev", "previous"):
            runs = self.history(limit=2)
            want = 0 if key in ("last", "latest") else 1
            if len(runs) <= want:
                raise InputError(f"there is no {key!r} bench run yet; `dflash bench history` lists the runs")
            return runs[want].id
        try:
            return int(key)
        except ValueError:
            raise InputError(f"{ref!r} is not a bench run id; use a number from `dflash bench history`") from None

    def get(self, ref: str | int) -> dict[str, Any]:
        """The JSON document of a run.

        Raises:
            InputError: no such run.
        """
        run_id = self.resolve_id(str(ref))
        with self._connect(create=False) as con:
            row = con.execute("SELECT document FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise InputError(f"there is no bench run {run_id}; `dflash bench history` lists the runs")
        return dict(json.loads(row[0]))


@dataclass(frozen=True)
class MethodChange:
    """One method in two runs (None where a run lacks it)."""

    name: str
    a: dict[str, Any] | None
    b: dict[str, Any] | None

    def value(self, side: str, key: str) -> float | None:
        """A headline number (``tok_s``, ``ttft``, ``tau``, ``acceptance``, ``speedup``) of one side."""
        m = self.a if side == "a" else self.b
        if m is None:
            return None
        if key == "tok_s":
            return m["tokens_per_second"]["median"]
        return {
            "ttft": m["ttft_seconds"],
            "tau": m["tau"],
            "acceptance": m["acceptance_rate"],
            "speedup": m["speedup"],
        }[key]

    def change(self, key: str) -> float | None:
        """Relative change b / a - 1 (None when either side is missing or zero)."""
        va, vb = self.value("a", key), self.value("b", key)
        if va is None or vb is None or va == 0:
            return None
        return vb / va - 1.0


@dataclass(frozen=True)
class Comparison:
    """Two runs side by side: per-method changes and the settings that differ."""

    a: dict[str, Any]
    b: dict[str, Any]
    rows: tuple[MethodChange, ...]
    differences: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form."""
        keys = ("tok_s", "ttft", "tau", "acceptance", "speedup")
        return {
            "a": self.a["run_id"],
            "b": self.b["run_id"],
            "differences": list(self.differences),
            "methods": [
                {
                    "name": r.name,
                    **{f"{k}_a": r.value("a", k) for k in keys},
                    **{f"{k}_b": r.value("b", k) for k in keys},
                    "tok_s_change": r.change("tok_s"),
                }
                for r in self.rows
            ],
        }


def compare_runs(a: dict[str, Any], b: dict[str, Any]) -> Comparison:
    """Line up the methods of two run documents and list the settings that differ."""
    ma = {m["name"]: m for m in a["methods"]}
    mb = {m["name"]: m for m in b["methods"]}
    names = list(ma) + [n for n in mb if n not in ma]
    rows = tuple(MethodChange(n, ma.get(n), mb.get(n)) for n in names)
    diffs = []
    checks = [
        ("target", lambda d: d["environment"]["target"]["id"]),
        ("drafter", lambda d: (d["environment"].get("drafter") or {}).get("id")),
        ("dataset", lambda d: d["dataset"]["name"]),
        ("prompts", lambda d: d["dataset"]["count"]),
        ("max tokens", lambda d: d["config"]["max_new_tokens"]),
        ("temperature", lambda d: d["config"]["temperature"]),
        ("device", lambda d: d["environment"]["device_name"]),
        ("dtype", lambda d: d["environment"]["dtype"]),
        ("quantize", lambda d: d["environment"].get("quantize")),
        ("torch", lambda d: d["environment"]["torch"]),
        ("transformers", lambda d: d["environment"]["transformers"]),
    ]
    for what, get in checks:
        va, vb = get(a), get(b)
        if va != vb:
            diffs.append(f"{what}: {va} -> {vb}")
    return Comparison(a, b, rows, tuple(diffs))
