"""`dflash models`: list cached pairs and models (size, last use, state); `dflash models rm`.

Lists go to stdout as plain columns (or JSON with --json); questions and notes go to stderr.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated, Any

import typer

from ..common import load_options, models_dir, usage_log_path
from ..errors import error_line, handle_errors

models_app = typer.Typer(
    help="List cached model pairs and models, or remove them (`dflash models rm NAME`).",
    no_args_is_help=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def human_size(n: int) -> str:
    """Decimal units, as ollama and `du -h --si` print them: 942 B, 1.6 MB, 16.4 GB."""
    value = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{n} B"  # pragma: no cover


def human_ago(ts: float | None, now: float | None = None) -> str:
    """'just now', '5 minutes ago', '3 days ago', or a date for old times; '-' when unknown."""
    if ts is None:
        return "-"
    delta = max(0.0, (now or time.time()) - ts)
    for seconds, unit in ((86400 * 7, "week"), (86400, "day"), (3600, "hour"), (60, "minute")):
        if delta >= seconds:
            if unit == "week" and delta >= 86400 * 60:
                return time.strftime("%Y-%m-%d", time.localtime(ts))
            k = int(delta // seconds)
            return f"{k} {unit}{'s' if k > 1 else ''} ago"
    return "just now"


def columns(rows: list[list[str]]) -> str:
    """Left-aligned columns separated by two spaces (the first row is the header)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _state(m: Any) -> str:
    if m.ok:
        return "ok"
    more = f" (+{len(m.problems) - 1} more)" if len(m.problems) > 1 else ""
    return f"incomplete: {m.problems[0]}{more}"


def _scan() -> tuple[Any, list[Any], list[Any]]:
    from runtime.models import store as cache_store

    usage = cache_store.UsageLog(usage_log_path())
    opts = load_options()
    found = cache_store.scan(opts.hf_cache_dir, models_dir(), usage)
    return usage, found, cache_store.find_pairs(found, usage)


def _list_presets(json_out: bool) -> None:
    from runtime.models import presets
    from runtime.models import store as cache_store

    _usage, found, _pairs = _scan()
    rows = [["PRESET", "TARGET", "DRAFTER", "ON DISK", "NOTE"]]
    data = []
    for p in presets.PRESETS.values():
        t, d = cache_store.preset_members(p, found)
        on_disk = "yes" if t and d else ("target only" if t else ("drafter only" if d else "no"))
        target = "Qwen2.5-Coder-0.5B-Instruct (PyPI, `dflash setup`)" if p.target == "embedded" else p.target
        drafter = "trained by dflash (package data)" if p.drafter == "embedded" else p.drafter
        rows.append([p.name, target, drafter, on_disk, p.note])
        data.append({"name": p.name, "target": p.target, "drafter": p.drafter, "on_disk": on_disk, "note": p.note})
    if json_out:
        print(json.dumps(data, indent=2))
        return
    print(columns(rows))
    print(
        "\nfetch one with `dflash download PRESET`; any Hub pair works too: --target ID --drafter ID", file=sys.stderr
    )


@models_app.callback(invoke_without_command=True)
@handle_errors
def models(
    ctx: typer.Context,
    show_presets: Annotated[bool, typer.Option("--presets", help="List the known presets instead.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON instead of columns.")] = False,
) -> None:
    """List cached pairs and models with disk size, last use and state."""
    if ctx.invoked_subcommand is not None:
        return
    if show_presets:
        _list_presets(json_out)
        return
    from runtime.models import store as cache_store

    _usage, found, pairs = _scan()
    if json_out:
        doc = {"pairs": [p.to_json() for p in pairs], "models": [m.to_json() for m in found]}
        print(json.dumps(doc, indent=2))
        return
    where = (
        f"Hugging Face cache: {cache_store.hub_cache_dir(load_options().hf_cache_dir)}; dflash models: {models_dir()}"
    )
    if not found:
        print(
            f"no models on disk yet ({where})\n"
            "get a pair with `dflash download PRESET` (see `dflash models --presets`)",
            file=sys.stderr,
        )
        return
    if pairs:
        rows = [["PAIR", "TARGET", "DRAFTER", "SIZE", "LAST USED", "STATE"]]
        rows += [
            [
                p.name,
                p.target.name,
                p.drafter.name,
                human_size(p.size_bytes),
                human_ago(p.last_used),
                "ok" if p.ok else "incomplete",
            ]
            for p in pairs
        ]
        print(columns(rows))
        print()
    rows = [["MODEL", "TYPE", "SIZE", "LAST USED", "STATE"]]
    rows += [[m.name, m.kind, human_size(m.size_bytes), human_ago(m.last_used), _state(m)] for m in found]
    print(columns(rows))
    print(f"\n{where}", file=sys.stderr)


@models_app.command("rm")
@handle_errors
def rm(
    names: Annotated[
        list[str],
        typer.Argument(help="Presets (both models of the pair), Hub ids or folder names.", show_default=False),
    ],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Remove without asking.")] = False,
) -> None:
    """Remove cached models from disk (asks first unless --yes)."""
    from runtime.models import store as cache_store

    usage, found, _pairs = _scan()
    chosen = cache_store.select(names, found)
    total = sum(m.size_bytes for m in chosen)
    listing = columns([[m.name, m.kind, human_size(m.size_bytes), str(m.path)] for m in chosen])
    print("\n".join("  " + line for line in listing.splitlines()), file=sys.stderr)
    if not yes:
        n = len(chosen)
        try:
            ok = typer.confirm(
                f"Remove {n} model{'s' if n > 1 else ''} ({human_size(total)})?", default=False, err=True
            )
        except typer.Abort:
            error_line("nothing removed: no answer to the question (pass --yes to remove without asking)")
            raise typer.Exit(code=1) from None
        if not ok:
            print("nothing removed", file=sys.stderr)
            return
    roots = [cache_store.hub_cache_dir(load_options().hf_cache_dir), models_dir()]
    freed = cache_store.remove(chosen, roots, usage)
    print(f"removed {len(chosen)} model{'s' if len(chosen) > 1 else ''}, freed {human_size(freed)}", file=sys.stderr)
