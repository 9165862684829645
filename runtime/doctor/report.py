"""The doctor's report: one ``Check`` per line (status, message, fix, the exit code of a failure)
and the exit code of a whole report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from runtime.errors import DFlashError

Status = Literal["ok", "warn", "fail", "info"]


@dataclass(frozen=True)
class Check:
    """One line of the doctor's report.

    Attributes:
        area: what was checked ("device", "dtype", "memory", "target", "vocab", ...).
        status: "ok", "warn" (works, but worse than it could), "fail" (will not work) or "info".
        message: what was found.
        fix: what to do about it (empty when nothing needs doing).
        exit_code: for failures, the exit code the CLI uses for this kind of problem.
    """

    area: str
    status: Status
    message: str
    fix: str = ""
    exit_code: int = 0

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``dflash doctor --json``)."""
        return {"area": self.area, "status": self.status, "message": self.message, "fix": self.fix}


def fail(area: str, err: DFlashError | str, fix: str = "", code: int | None = None) -> Check:
    exit_code = code if code is not None else (err.exit_code if isinstance(err, DFlashError) else 1)
    return Check(area, "fail", str(err), fix, exit_code)


def exit_code(checks: list[Check]) -> int:
    """The exit code of the first failed check (0 when none failed)."""
    for c in checks:
        if c.status == "fail":
            return c.exit_code or 1
    return 0
