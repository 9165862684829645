"""Text renderings of bench documents (the JSON of ``BenchResult.to_json``) for ``dflash bench``:
the llama-bench-style table, Markdown, CSV, history and comparison tables. Pure functions: no I/O.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TABLE_COLUMNS = (
    "model",
    "draft",
    "method",
    "t/s ± sd",
    "TTFT ms",
    "TPOT ms",
    "tau",
    "accept %",
    "speedup",
    "peak mem",
    "= ar",
)


def short_name(name: str | None) -> str:
    """A model id or folder as shown in tables (folders by their last component)."""
    if not name:
        return "-"
    if "/" in name and Path(name).expanduser().exists():
        return Path(name).name
    return name


def fmt(value: float | None, spec: str = ".2f", scale: float = 1.0, suffix: str = "") -> str:
    """A number for a table cell ("-" when unknown)."""
    return "-" if value is None else f"{value * scale:{spec}}{suffix}"


def fmt_bytes(n: int | None) -> str:
    """Bytes as MB/GB."""
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GB" if n >= 2**30 else f"{n / 2**20:.0f} MB"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table with padded columns (numbers right-aligned)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def is_num(s: str) -> bool:
        return bool(s) and (s[0].isdigit() or s[0] in "+-") and s != "-"

    def line(cells: Sequence[str]) -> str:
        return (
            "| "
            + " | ".join(c.rjust(w) if is_num(c) else c.ljust(w) for c, w in zip(cells, widths, strict=True))
            + " |"
        )

    sep = "| " + " | ".join("-" * w for w in widths) + " |"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def _agreement(m: dict[str, Any]) -> str:
    if m["name"] == "ar":
        return "ref"
    ag = m.get("agreement")
    if ag is None:
        return "-"
    return f"{ag['identical']}/{ag['prompts']}"


def method_rows(doc: dict[str, Any]) -> list[list[str]]:
    """Table rows of a bench document, one per method."""
    target = short_name(doc["environment"]["target"]["id"])
    rows = []
    for m in doc["methods"]:
        tps = m["tokens_per_second"]
        rows.append(
            [
                target,
                short_name(m.get("draft")),
                m["label"],
                f"{tps['median']:.2f} ± {tps['stdev']:.2f}",
                fmt(m["ttft_seconds"], ".0f", 1000),
                fmt(m["tpot_seconds"], ".1f", 1000),
                fmt(m["tau"]),
                fmt(m["acceptance_rate"], ".1f", 100),
                fmt(m["speedup"], ".2f", suffix="x"),
                fmt_bytes(m["peak_memory_bytes"]),
                _agreement(m),
            ]
        )
    return rows


def bench_table(doc: dict[str, Any]) -> str:
    """The llama-bench-style table of a run."""
    return markdown_table(TABLE_COLUMNS, method_rows(doc))


def bench_header(doc: dict[str, Any]) -> str:
    """One line saying what was measured, where."""
    env, ds, cfg = doc["environment"], doc["dataset"], doc["config"]
    mode = "greedy" if cfg["temperature"] == 0 else f"temperature {cfg['temperature']}"
    run = f" run {doc['run_id']}" if doc.get("run_id") else ""
    quant = f", {env['quantize']}" if env.get("quantize") else ""
    if env.get("server"):  # dflash bench --server
        srv = env["server"]
        dtype = f", {env['dtype']}" if env.get("dtype") not in (None, "-") else ""
        return (
            f"dflash bench{run}: {ds['name']} ({ds['count']} prompts x {cfg['max_new_tokens']} new tokens, {mode}) "
            f"on {env['device_name']}{dtype}{quant}; served model {srv['model']}"
        )
    return (
        f"dflash bench{run}: {ds['name']} ({ds['count']} prompts x {cfg['max_new_tokens']} new tokens, {mode}) "
        f"on {env['device_name']}, {env['dtype']}{quant}; torch {env['torch']}, transformers {env['transformers']}"
    )


def bench_details(doc: dict[str, Any]) -> list[str]:
    """Lines under the table: DFlash acceptance details, divergences from ar, warnings."""
    out = []
    for m in doc["methods"]:
        if m["method"] in ("dflash", "server") and m["acceptance_histogram"]:
            pos = " ".join(f"{p * 100:.0f}%" for p in m["per_position_acceptance"])
            hist = " ".join(f"{i}:{n}" for i, n in enumerate(m["acceptance_histogram"]))
            out.append(f"{m['label']}: acceptance by draft position {pos or '-'} | steps by drafts accepted {hist}")
    for m in doc["methods"]:
        ag = m.get("agreement")
        if ag and ag["first_divergence"]:
            d = ag["first_divergence"]
            out.append(
                f"{m['label']}: {ag['identical']}/{ag['prompts']} prompts identical to ar; first divergence in "
                f"{d['prompt_id']} at token {d['position']}: ar {d['expected_text']!r} ({d['expected']}) vs "
                f"{m['name']} {d['got_text']!r} ({d['got']})"
            )
    for w in doc.get("warnings", []):
        out.append(f"warning: {w['message']}\n  fix: {w['fix']}")
    return out


CSV_FIELDS = (
    "run_id",
    "target",
    "draft",
    "method",
    "block_size",
    "verify_lengths",
    "tok_s_median",
    "tok_s_stdev",
    "ttft_ms",
    "tpot_ms",
    "tau",
    "acceptance_rate",
    "speedup",
    "peak_memory_bytes",
    "identical_to_ar",
    "prompts",
)


def bench_csv(doc: dict[str, Any]) -> str:
    """One CSV row per method."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_FIELDS)
    for m in doc["methods"]:
        ag = m.get("agreement")
        w.writerow(
            [
                doc.get("run_id") or "",
                doc["environment"]["target"]["id"],
                m.get("draft") or "",
                m["name"],
                m["block_size"] or "",
                " ".join(str(v) for v in sorted(set(m["verify_lengths"]))),
                f"{m['tokens_per_second']['median']:.4f}",
                f"{m['tokens_per_second']['stdev']:.4f}",
                f"{m['ttft_seconds'] * 1000:.2f}",
                "" if m["tpot_seconds"] is None else f"{m['tpot_seconds'] * 1000:.3f}",
                "" if m["tau"] is None else f"{m['tau']:.4f}",
                "" if m["acceptance_rate"] is None else f"{m['acceptance_rate']:.4f}",
                "" if m["speedup"] is None else f"{m['speedup']:.4f}",
                m["peak_memory_bytes"] if m["peak_memory_bytes"] is not None else "",
                "" if ag is None else ag["identical"],
                len(m["runs"]),
            ]
        )
    return buf.getvalue()


def history_table(runs: Sequence[Any]) -> str:
    """``dflash bench history``: one row per stored run, newest first."""
    header = (
        "run",
        "date",
        "label",
        "target",
        "draft",
        "dataset",
        "prompts x tokens",
        "device",
        "ar t/s",
        "best",
        "speedup",
    )
    rows = []
    for r in runs:
        ar = r.methods.get("ar", {})
        others = {k: v for k, v in r.methods.items() if k != "ar" and v.get("tok_s") is not None}
        best = max(others, key=lambda k: others[k]["tok_s"], default=None)
        rows.append(
            [
                str(r.id),
                r.created.replace("T", " ")[:16],
                r.label or "",
                short_name(r.target),
                short_name(r.drafter),
                r.dataset,
                f"{r.prompts} x {r.max_tokens}",
                f"{r.device} {r.dtype}",
                fmt(ar.get("tok_s")),
                f"{best} {others[best]['tok_s']:.2f} t/s" if best else "-",
                fmt(others[best]["speedup"], ".2f", suffix="x") if best else "-",
            ]
        )
    return markdown_table(header, rows)


def _arrow(a: float | None, b: float | None, spec: str = ".2f", scale: float = 1.0) -> str:
    return f"{fmt(a, spec, scale)} -> {fmt(b, spec, scale)}"


def compare_table(cmp: Any) -> str:
    """``dflash bench compare A B``: per method, the change from run A to run B."""
    a, b = cmp.a["run_id"], cmp.b["run_id"]
    header = ("method", f"t/s #{a}", f"t/s #{b}", "change", "TTFT ms", "tau", "accept %", "speedup")
    rows = []
    for r in cmp.rows:
        ch = r.change("tok_s")
        rows.append(
            [
                r.name,
                fmt(r.value("a", "tok_s")),
                fmt(r.value("b", "tok_s")),
                "-" if ch is None else f"{ch * 100:+.1f}%",
                _arrow(r.value("a", "ttft"), r.value("b", "ttft"), ".0f", 1000),
                _arrow(r.value("a", "tau"), r.value("b", "tau")),
                _arrow(r.value("a", "acceptance"), r.value("b", "acceptance"), ".1f", 100),
                _arrow(r.value("a", "speedup"), r.value("b", "speedup")),
            ]
        )
    return markdown_table(header, rows)


def compare_header(cmp: Any) -> list[str]:
    """Which runs are compared and the settings that differ."""

    def desc(d: dict[str, Any]) -> str:
        label = f" '{d['label']}'" if d.get("label") else ""
        return f"#{d['run_id']}{label} ({d['created'].replace('T', ' ')[:16]}, {d['dataset']['name']})"

    lines = [f"run {desc(cmp.a)} -> run {desc(cmp.b)}"]
    if cmp.differences:
        lines.append("settings that differ: " + "; ".join(cmp.differences))
    return lines
