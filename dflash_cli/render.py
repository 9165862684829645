"""Plain-text rendering helpers shared by commands (no rich needed for stdout)."""

from __future__ import annotations

from typing import Any

_ANSI = {"accepted": "\x1b[32m", "target": "", "rejected": "\x1b[2;9m"}
_RESET = "\x1b[0m"


def paint(text: str, status: str) -> str:
    """Wrap ``text`` in the ANSI colour of a token status (accepted drafts green)."""
    code = _ANSI.get(status, "")
    return f"{code}{text}{_RESET}" if code and text else text


def format_stats_line(stats: Any, reason: str) -> str:
    """One-line summary: tokens, time, tok/s, TTFT, tau, acceptance."""
    line = (
        f"{stats.generated_tokens} tokens in {stats.total_seconds:.2f}s | {stats.tokens_per_second:.1f} tok/s | "
        f"TTFT {stats.ttft_seconds * 1000:.0f} ms | {stats.decoder}"
    )
    if stats.decoder == "dflash":
        line += f" | tau {stats.tau:.2f} | accept {stats.acceptance_rate * 100:.0f}% | block {stats.block_size}, " + (
            f"tree {stats.tree_budget}" if getattr(stats, "tree_budget", 0) else f"verify {stats.verify_length}"
        )
        if getattr(stats, "lookup", 0):
            line += f", lookup {stats.lookup} ({stats.copied_tokens} copied)"
        if stats.verify_steps:  # the confidence cut sizes every step: the label above is the last step's
            line += f", {stats.drafted_tokens / stats.verify_steps:.1f} drafted/step"
    return line + f" | finish: {reason}"


def warn_block_size(pipe: Any, asked: Any) -> None:
    """Warn on stderr when a block size is above the drafter's trained block (slower, drafts past it are noise).

    Args:
        pipe: the loaded pipeline (``drafter``, ``block_size``: the trained block).
        asked: a block size or a sequence of them (None: the drafter's own).
    """
    import sys

    if asked is None or getattr(pipe, "drafter", None) is None:
        return
    trained = int(pipe.block_size)
    sizes = [asked] if isinstance(asked, int) else list(asked)
    over = sorted({b for b in sizes if b > trained})
    if over:
        print(
            f"dflash: warning: block size {', '.join(map(str, over))} is above the {trained} tokens the drafter was "
            f"trained for: drafts beyond position {trained - 1} are rarely accepted and each step costs more; "
            f"use --block-size {trained} or less",
            file=sys.stderr,
            flush=True,
        )
