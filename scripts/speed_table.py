"""Decode speed of dflash and llama.cpp on the same prompts, same machine, one run.

Rows (each: one warm-up prompt, then every prompt of the set; decode tok/s excludes the prompt):

- llama.cpp ``llama-server`` on a GGUF (``--gguf NAME=FILE``, repeatable; e.g. the embedded
  target converted to bf16, and the shipped Q4_K_M), plain decoding, read from llama.cpp's own
  ``timings``; ``--llama-ngram`` adds its model-free ngram speculation on the same files;
- dflash on the embedded pair (or ``--target/--drafter``): plain (``ar``) and DFlash, for each
  precision in ``--quantize`` (``none`` = float weights in each of ``--float-dtypes``, ``int8``,
  ``int4``, ``q4`` with the machine's default activation dtype), with the lean target forward; ``--with-hf`` adds transformers' own forward (the step before the lean engine).

The verify costs (chains and tree-sized verifies) are measured for this machine at the start of each dflash pair (as ``dflash run``
does on first use). Prints a Markdown table of medians; ``--out FILE`` keeps every number as JSON.

``--baseline OTHER_CHECKOUT`` compares two builds: both stay loaded (``speed_worker.py`` in two
processes, one decoding at a time) and decode every prompt back to back, the first of the two
alternating, so the machine's drift over the run falls on both alike (running one build after the
other made a build that ran second look up to 8% slower on a shared 2-core machine).

Example (see docs/speed.md and docs/llamacpp.md):
    python scripts/speed_table.py --llama-server ~/.cache/llamacpp/src/build/bin/llama-server \\
        --gguf bf16=target-bf16.gguf --gguf Q4_K_M=target-q4_k_m.gguf -n 96 --out speed.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _post(url: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


PREFILL_RUNS = 3  # timed prompt readings per length, after one warm-up


@functools.cache
def prefill_text() -> str:
    """The long prompt of the prefill rows: this checkout's engine source (code, as editors send it);
    each engine reads the first N tokens of it as its own tokenizer splits it (the same tokenizer)."""
    root = Path(__file__).resolve().parent.parent / "runtime" / "engine"
    return "\n".join(p.read_text() for p in sorted(root.rglob("*.py")))


class LlamaServer:
    """``llama-server`` on one GGUF, started on enter and stopped on exit.

    Args:
        args: the script's arguments (``llama_server``, ``threads``, ``port``, ``max_tokens``).
        path: the GGUF file.
        extra: more server flags (e.g. llama.cpp's ngram speculation).
    """

    def __init__(self, args: argparse.Namespace, path: str, extra: list[str] | None = None) -> None:
        self.args, self.path, self.extra = args, path, extra or []
        self.base = f"http://127.0.0.1:{args.port}"
        self._prefill_ids: list[int] | None = None

    def __enter__(self) -> LlamaServer:
        a = self.args
        cmd = [a.llama_server, "-m", self.path, "-t", str(a.threads), "-tb", str(a.threads), "-c", "4096"]
        cmd += ["--no-webui", "-np", "1", "--port", str(a.port), *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(240):
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise SystemExit(f"llama-server did not come up on {self.base} with {self.path}")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(30)

    def chat(self, text: str) -> dict[str, Any]:
        """One greedy chat request, prompt not cached: llama.cpp's own ``timings``."""
        body = {
            "messages": [{"role": "user", "content": text}],
            "max_tokens": self.args.max_tokens,
            "temperature": 0,
            "cache_prompt": False,
        }
        return dict(_post(self.base + "/v1/chat/completions", body)["timings"])

    def prefill(self, n: int) -> float:
        """Prompt tok/s reading the first ``n`` tokens of ``prefill_text()`` (llama.cpp's own timing)."""
        if self._prefill_ids is None:
            self._prefill_ids = _post(self.base + "/tokenize", {"content": prefill_text()})["tokens"]
        body = {"prompt": self._prefill_ids[:n], "n_predict": 1, "cache_prompt": False, "temperature": 0}
        t = _post(self.base + "/completion", body)["timings"]
        assert int(t["prompt_n"]) == n, t
        return float(t["prompt_per_second"])


def _llama_row(name: str, mode: str, timings: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"engine": "llama.cpp", "weights": name, "method": mode}
    row["tok_s"] = [float(t["predicted_per_second"]) for t in timings]
    drafted = sum(int(t.get("draft_n", 0) or 0) for t in timings)
    if drafted:
        row["accept"] = sum(int(t.get("draft_n_accepted", 0) or 0) for t in timings) / drafted
    return row


def llama_rows(args: argparse.Namespace, prompts: list[str]) -> list[dict[str, Any]]:
    rows = []
    modes = [("plain", [])] + ([("ngram", ["--spec-type", "ngram-simple"])] if args.llama_ngram else [])
    for spec in args.gguf:
        name, _, path = spec.partition("=")
        for mode, extra in modes:
            with LlamaServer(args, path, extra) as server:
                server.chat(prompts[0])  # warm-up
                rows.append(_llama_row(name, mode, [server.chat(text) for text in prompts]))
                print(
                    f"  llama.cpp {name} {mode}: median {statistics.median(rows[-1]['tok_s']):.2f} tok/s",
                    file=sys.stderr,
                )
                if mode == "plain" and args.prefill:
                    for n in args.prefill:
                        server.prefill(n)  # warm-up
                        prefill = [server.prefill(n) for _ in range(PREFILL_RUNS)]
                        rows.append({"engine": "llama.cpp", "weights": name, "prefill": n, "tok_s": prefill})
                        print(
                            f"  llama.cpp {name} prefill {n}: median {statistics.median(prefill):.1f} tok/s",
                            file=sys.stderr,
                        )
    return rows


def _configs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every dflash configuration the arguments ask for, as ``speed_worker.Runner`` configs."""
    return [
        {
            "quant": quant,
            "dtype": dtype,
            "engine": engine,
            "threads": args.threads,
            "max_tokens": args.max_tokens,
            "target": args.target,
            "drafter": args.drafter,
            "models_dir": args.models_dir,
        }
        for quant in args.quantize
        for dtype in (args.float_dtypes if quant == "none" else ["auto"])
        for engine in (["lean", "hf"] if args.with_hf and quant == "none" else ["lean"])
    ]


def _methods(args: argparse.Namespace) -> list[str]:
    return [
        "ar",
        "dflash",
        *[f"dflash@{k}" for k in args.verify_lengths],
        *(["dflash@lookup0"] if args.lookup_off else []),
    ]


def _row(
    engine: str, label: str, method: str, results: list[dict[str, Any]], ar: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """One table row from per-prompt results (``ar``: the plain row's, to count equal texts)."""
    row: dict[str, Any] = {"engine": f"dflash ({engine})", "weights": label, "method": method}
    row["tok_s"] = [r["tok_s"] for r in results]
    if method.startswith("dflash"):
        steps = sum(r["steps"] for r in results)
        row["tau"] = sum(r["tau"] * r["steps"] for r in results) / steps if steps else 1.0
        row["verify"] = results[-1]["verify"]
        if ar is not None:
            row["same_as_ar"] = sum(a["tokens"] == b["tokens"] for a, b in zip(ar, results, strict=True))
    return row


def dflash_rows(args: argparse.Namespace, prompt_texts: list[str]) -> list[dict[str, Any]]:
    """This checkout's rows: each configuration loaded once, one warm-up prompt, then every prompt."""
    from speed_worker import Runner

    rows = []
    for config in _configs(args):
        runner = Runner({**config, "prompts": prompt_texts})
        if config["engine"] == "hf":
            assert runner.target_class == "TargetModel", runner.target_class
        ar: list[dict[str, Any]] | None = None
        for n in args.prefill:
            runner.prefill(prefill_text(), n)  # warm-up
            prefill = [runner.prefill(prefill_text(), n) for _ in range(PREFILL_RUNS)]
            rows.append(
                {"engine": f"dflash ({config['engine']})", "weights": runner.label, "prefill": n, "tok_s": prefill}
            )
            print(
                f"  dflash {runner.label} prefill {n}: median {statistics.median(prefill):.1f} tok/s", file=sys.stderr
            )
        for method in _methods(args):
            runner.run(method, 0)  # warm-up
            results = [runner.run(method, i) for i in range(len(prompt_texts))]
            ar = results if method == "ar" else ar
            rows.append(_row(config["engine"], runner.label, method, results, ar))
            print(
                f"  dflash {config['engine']} {runner.label} {method}: median {statistics.median(rows[-1]['tok_s']):.2f} tok/s",
                file=sys.stderr,
            )
        del runner
    return rows


def rotated(rounds: int, sides: list[Any], run: Callable[[Any, int], Any]) -> dict[Any, list[Any]]:
    """``run(side, i)`` for every side back to back in each round i, the order rotated by one each
    round, so a shared machine's drift over the run falls on every side alike: side -> results in
    round order."""
    out: dict[Any, list[Any]] = {side: [] for side in sides}
    for i in range(rounds):
        k = i % len(sides)
        for side in sides[k:] + sides[:k]:
            out[side].append(run(side, i))
    return out


def interleaved_rows(args: argparse.Namespace, prompt_texts: list[str]) -> list[dict[str, Any]]:
    """llama.cpp and dflash rows measured side by side: the i-th ``--gguf`` is paired with the i-th
    dflash configuration (``--quantize`` order, float weights in the first of ``--float-dtypes``); the
    server and the pair stay loaded together and each prompt (and each prompt reading) is decoded by
    every engine back to back, the order rotating, so a shared machine's swings in memory speed (seen:
    one engine's tok/s moving 25% within a run) fall on both sides alike. Each dflash row gets
    ``vs_llama``: the median over prompts of its tok/s over llama.cpp's on the same prompt."""
    from speed_worker import Runner

    configs = _configs(args)
    if args.with_hf or args.baseline or len(configs) != len(args.gguf):
        raise SystemExit(
            f"--interleave pairs each --gguf with one dflash configuration: {len(args.gguf)} GGUF(s), "
            f"{len(configs)} configuration(s) (--quantize x --float-dtypes); --with-hf and --baseline do not apply"
        )
    rows: list[dict[str, Any]] = []
    methods = _methods(args)
    for spec, config in zip(args.gguf, configs, strict=True):
        name, _, path = spec.partition("=")
        with LlamaServer(args, path) as server:
            runner = Runner({**config, "prompts": prompt_texts})
            for n in args.prefill:
                server.prefill(n)
                runner.prefill(prefill_text(), n)  # warm-ups

                def read(who: str, _: int, n: int = n, r: Runner = runner) -> float:
                    return float(server.prefill(n) if who == "llama" else r.prefill(prefill_text(), n))

                got = rotated(PREFILL_RUNS, ["llama", "dflash"], read)
                rows.append({"engine": "llama.cpp", "weights": name, "prefill": n, "tok_s": got["llama"]})
                rows.append(
                    {
                        "engine": f"dflash ({config['engine']})",
                        "weights": runner.label,
                        "prefill": n,
                        "tok_s": got["dflash"],
                    }
                )
                ratio = statistics.median(got["dflash"]) / statistics.median(got["llama"])
                print(
                    f"  prefill {n}: llama.cpp {name} {statistics.median(got['llama']):.1f}, "
                    f"dflash {runner.label} {statistics.median(got['dflash']):.1f} tok/s ({ratio:.2f}x)",
                    file=sys.stderr,
                )
            engines = ["llama", *methods]
            server.chat(prompt_texts[0])
            for m in methods:
                runner.run(m, 0)  # warm-ups

            def decode(who: str, i: int, r: Runner = runner) -> dict[str, Any]:
                return dict(server.chat(prompt_texts[i]) if who == "llama" else r.run(who, i))

            results = rotated(len(prompt_texts), engines, decode)
            llama = _llama_row(name, "plain", results["llama"])
            rows.append(llama)
            for m in methods:
                row = _row(config["engine"], runner.label, m, results[m], results.get("ar"))
                row["vs_llama"] = statistics.median(a / b for a, b in zip(row["tok_s"], llama["tok_s"], strict=True))
                rows.append(row)
                print(
                    f"  {runner.label} {m}: median {statistics.median(row['tok_s']):.2f} tok/s, "
                    f"{row['vs_llama']:.2f}x llama.cpp {name} (median per prompt)",
                    file=sys.stderr,
                )
            del runner
    return rows


class _Worker:
    """``speed_worker.py`` in a subprocess on the checkout at ``root`` (its ``runtime`` package)."""

    def __init__(self, root: Path, config: dict[str, Any]) -> None:
        script = Path(__file__).with_name("speed_worker.py")
        env = {**os.environ, "PYTHONPATH": str(root)}
        self.proc = subprocess.Popen(
            [sys.executable, str(script), json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=root, env=env,
        )  # fmt: skip
        self.info = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"speed_worker.py failed on {self.proc.args}")
        return dict(json.loads(line))

    def run(self, method: str, prompt: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"method": method, "prompt": prompt}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(60)


def ab_rows(args: argparse.Namespace, prompt_texts: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows of the checkout at ``args.baseline`` and of this one, interleaved prompt by prompt.

    Both checkouts stay loaded (two worker processes, one decoding at a time); for every prompt both
    decode it back to back, the first of the two alternating, so drift cannot favour either side."""
    base, here = Path(args.baseline).resolve(), Path(__file__).resolve().parent.parent
    print(f"baseline: {base} (interleaved with {here})", file=sys.stderr)
    before: list[dict[str, Any]] = []
    after: list[dict[str, Any]] = []
    for config in _configs(args):
        workers = [
            _Worker(base, {**config, "prompts": prompt_texts}),
            _Worker(here, {**config, "prompts": prompt_texts}),
        ]
        try:
            label = workers[1].info["label"]
            ar: list[list[dict[str, Any]] | None] = [None, None]
            for method in _methods(args):
                for w in workers:
                    w.run(method, 0)  # warm-up

                def decode(k: int, i: int, m: str = method, ws: list[_Worker] = workers) -> dict[str, Any]:
                    return ws[k].run(m, i)

                results = rotated(len(prompt_texts), [0, 1], decode)
                for k, rows in ((0, before), (1, after)):
                    ar[k] = results[k] if method == "ar" else ar[k]
                    rows.append(_row(config["engine"], label, method, results[k], ar[k]))
                b, a = (statistics.median(rows[-1]["tok_s"]) for rows in (before, after))
                print(
                    f"  dflash {config['engine']} {label} {method}: before {b:.2f}, after {a:.2f} tok/s",
                    file=sys.stderr,
                )
        finally:
            for w in workers:
                w.close()
    return before, after


def print_comparison(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> None:
    """Before/after medians of the same rows, the ratio of the medians and the median of the per-prompt
    ratios (the two sides decoded each prompt back to back), and whether the text stayed the same."""
    print(
        "\n| weights | method | before tok/s | after tok/s | after/before | per-prompt ratio (median) | tau before | tau after | = ar after |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    old = {(r["weights"], r["method"]): r for r in before}
    for r in after:
        b = old.get((r["weights"], r["method"]))
        if b is None or not r["engine"].startswith("dflash"):
            continue
        mb, ma = statistics.median(b["tok_s"]), statistics.median(r["tok_s"])
        paired = statistics.median(x / y for x, y in zip(r["tok_s"], b["tok_s"], strict=True))
        tb = f"{b['tau']:.2f}" if "tau" in b else "-"
        ta = f"{r['tau']:.2f}" if "tau" in r else "-"
        same = f"{r['same_as_ar']}/{len(r['tok_s'])}" if "same_as_ar" in r else "-"
        print(
            f"| {r['weights']} | {r['method']} | {mb:.2f} | {ma:.2f} | {ma / mb:.3f} | {paired:.3f} | {tb} | {ta} | {same} |"
        )
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", help="path of llama.cpp's llama-server (omit: dflash rows only)")
    ap.add_argument("--gguf", action="append", default=[], help="NAME=FILE of a GGUF for llama-server (repeatable)")
    ap.add_argument("--llama-ngram", action="store_true", help="also llama.cpp's ngram-simple speculation")
    ap.add_argument("--dataset", default="chat-coding", help="dflash bench dataset (default chat-coding)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("-n", "--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantize", default="none,int4", help="comma list of none,int8,int4,q4 (default none,int4)")
    ap.add_argument(
        "--float-dtypes",
        default="bfloat16",
        help="comma list of dtypes for the unquantized rows (bfloat16,float32); quantized rows use the "
        "machine's default activation dtype (dflash's --dtype auto)",
    )
    ap.add_argument(
        "--verify-lengths",
        type=lambda v: [int(x) for x in v.split(",") if x.strip()],
        default=[],
        help="also DFlash rows with these fixed verify lengths (e.g. 1,2,3), beside the runtime's choice",
    )
    ap.add_argument(
        "--lookup-off", action="store_true", help="also a DFlash row without the context lookup (dflash@lookup0)"
    )
    ap.add_argument(
        "--prefill",
        type=lambda v: [int(x) for x in v.split(",") if x.strip()],
        default=[],
        help="also prompt-reading rows: prompt tok/s on the first N tokens of a long code prompt (e.g. 512,2048)",
    )
    ap.add_argument("--with-hf", action="store_true", help="also transformers' forward on bf16 (the step before)")
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--models-dir")
    ap.add_argument("--port", type=int, default=8091)
    ap.add_argument("--out")
    ap.add_argument(
        "--baseline", help="another checkout: its dflash rows and these, interleaved prompt by prompt, side by side"
    )
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="llama.cpp and dflash side by side: the i-th --gguf against the i-th dflash configuration, "
        "every prompt decoded by each engine back to back (fair ratios on a machine whose speed drifts)",
    )
    args = ap.parse_args()
    args.quantize = [q.strip() for q in args.quantize.split(",") if q.strip()]
    args.float_dtypes = [d.strip() for d in args.float_dtypes.split(",") if d.strip()]

    from runtime.bench.datasets import load_dataset

    prompts = [p.text for p in load_dataset(args.dataset).limit(args.limit).prompts]
    print(
        f"{len(prompts)} prompts ({args.dataset}), {args.max_tokens} tokens, greedy, {args.threads} threads",
        file=sys.stderr,
    )
    rows: list[dict[str, Any]] = []
    if args.interleave and not args.llama_server:
        raise SystemExit("--interleave needs --llama-server and one --gguf per dflash configuration")
    if args.llama_server and not args.interleave:
        rows += llama_rows(args, prompts)
    if args.interleave:
        rows += interleaved_rows(args, prompts)
    elif args.baseline:
        before, after = ab_rows(args, prompts)
        rows += after
        print_comparison(before, after)
    else:
        rows += dflash_rows(args, prompts)
    prefill = [r for r in rows if "prefill" in r]
    if prefill:
        print("| engine | weights | prompt tokens | median prompt tok/s | min-max |")
        print("|---|---|---|---|---|")
        for r in prefill:
            s = r["tok_s"]
            print(
                f"| {r['engine']} | {r['weights']} | {r['prefill']} | {statistics.median(s):.1f} | {min(s):.1f}-{max(s):.1f} |"
            )
        print()
    vs = any("vs_llama" in r for r in rows)
    print(
        "| engine | weights | method | median decode tok/s | min-max | tau | verify / tree | = ar |"
        + (" vs llama.cpp |" if vs else "")
    )
    print("|---|---|---|---|---|---|---|---|" + ("---|" if vs else ""))
    for r in (r for r in rows if "prefill" not in r):
        s = r["tok_s"]
        tau = f"{r['tau']:.2f}" if "tau" in r else ("-" if "accept" not in r else f"accept {100 * r['accept']:.0f}%")
        same = f"{r['same_as_ar']}/{len(s)}" if "same_as_ar" in r else "-"
        print(
            f"| {r['engine']} | {r['weights']} | {r['method']} | {statistics.median(s):.2f} | "
            f"{min(s):.1f}-{max(s):.1f} | {tau} | {r.get('verify', '-')} | {same} |"
            + (f" {r['vs_llama']:.2f}x |" if "vs_llama" in r else (" - |" if vs else ""))
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"prompts": args.dataset, "max_tokens": args.max_tokens, "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
