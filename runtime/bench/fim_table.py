"""The tables of ``dflash bench --dataset fim``: one row per case and engine, as Markdown or CSV,
and the header lines above them. No UI imports here: the CLI prints them."""

from __future__ import annotations

from collections.abc import Sequence

from runtime.bench.fim_results import FimBenchResult

# -- rendering ---------------------------------------------------------------------------------------
COLUMNS = (
    "case",
    "language",
    "cut",
    "engine",
    "prompt",
    "tokens",
    "tau",
    "decode tok/s",
    "TTFT ms",
    "1st line ms",
    "warm cached",
    "warm TTFT ms",
    "warm 1st line ms",
    "= ar",
)


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.0f}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _same(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "NO")


def table_rows(result: FimBenchResult) -> list[list[str]]:
    """The table's rows (cells as text): one per case and engine, then one median row per engine."""
    rows: list[list[str]] = []
    for cr in result.cases:
        c = cr.case
        for name in result.engines:
            e = cr.engines.get(name)
            if e is None:
                continue
            r, w = e.cold, e.warm
            rows.append(
                [
                    c.id,
                    c.language,
                    c.cut,
                    name,
                    str(r.prompt_tokens),
                    str(r.generated),
                    _num(r.tau, ".2f"),
                    _num(r.decode_tps, ".1f"),
                    _ms(r.ttft_s),
                    _ms(r.first_line_s),
                    "-" if w is None else f"{w.cached_share:.0%}",
                    "-" if w is None else _ms(w.ttft_s),
                    "-" if w is None else _ms(w.first_line_s),
                    _same(e.same_as_ar),
                ]
            )
    for name, s in result.summary().items():
        rows.append(
            [
                "**median**",
                f"{s['cases']} cases",
                "",
                name,
                _num(s["prompt_tokens"], ".0f"),
                _num(s["generated_tokens"], ".0f"),
                _num(s["tau"], ".2f"),
                _num(s["decode_tokens_per_second"], ".1f"),
                _ms(s["ttft_seconds"]),
                _ms(s["first_line_seconds"]),
                _num(s["warm_cached_share"], ".0%"),
                _ms(s["warm_ttft_seconds"]),
                _ms(s["warm_first_line_seconds"]),
                "-" if s["same_as_ar"] is None else f"{s['same_as_ar']}/{s['compared']}",
            ]
        )
    return rows


def markdown_table(result: FimBenchResult) -> str:
    """The Markdown table of ``table_rows`` under ``COLUMNS``."""
    lines = [_row(COLUMNS), _row(["---"] * len(COLUMNS))]
    lines += [_row(r) for r in table_rows(result)]
    return "\n".join(lines)


def csv_text(result: FimBenchResult) -> str:
    """``table_rows`` as CSV (header first)."""
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for r in table_rows(result):
        w.writerow([cell.replace("**", "") for cell in r])
    return buf.getvalue()


def header_lines(result: FimBenchResult) -> list[str]:
    """What ran, and the speedups of the medians (for stderr above the table)."""
    env = result.environment or {}
    where = (
        f"{env.get('target', {}).get('id')} + {(env.get('drafter') or {}).get('id')}, "
        f"{env.get('device_name') or env.get('device')}, {result.dtype}"
        + (f", {env['quantize']} weights" if env.get("quantize") else "")
        if env
        else "servers only"
    )
    out = [
        f"dflash bench --dataset fim: {len(result.cases)} cases, greedy, up to {result.config.max_new_tokens} "
        f"new tokens, end-of-middle stops; {where}"
    ]
    for label, url in result.servers.items():
        out.append(f"  {label}: {url}/infill (decode tok/s = its timings.predicted_per_second)")
    s = result.summary()
    base = (s.get("ar") or {}).get("decode_tokens_per_second")
    df = (s.get("dflash") or {}).get("decode_tokens_per_second")
    if df and base:
        out.append(f"  dflash decode speedup over ar (medians): {df / base:.2f}x")
    for label in result.servers:
        other = s[label]["decode_tokens_per_second"]
        if df and other:
            out.append(f"  dflash decode speedup over {label} (medians): {df / other:.2f}x")
    if "dflash" in s and s["dflash"]["same_as_ar"] is not None:
        same, n = s["dflash"]["same_as_ar"], s["dflash"]["compared"]
        note = "" if result.dtype == "float32" or same == n else " (outside float32, rounding may part them)"
        out.append(f"  dflash tokens equal plain decoding's on {same}/{n} cases{note}")
    return out
