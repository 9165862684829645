"""Chain vs tree verification (DDTree) on one pair: tau and decode tok/s per tree budget.

Runs greedy decoding of chat coding prompts with the chain (``tree_budget=0``, the runtime's own
verify length), fixed tree budgets, and the budget the runtime chooses for this machine
(``auto``: from the measured verify costs, as ``dflash run`` does), then prints per-method medians
and the per-prompt speed-up over the chain. Methods are interleaved prompt by prompt (the order
rotates) so that a machine getting slower or faster affects every method alike.

Default pair: the embedded one (as ``dflash run`` without a model). Examples:

    python scripts/bench_tree.py                                  # embedded pair, 12 prompts, 96 tokens
    python scripts/bench_tree.py --budgets 0,4,8,16,32,auto --max-tokens 96 --json out.json
    python scripts/bench_tree.py --target DIR --drafter DIR --dtype float32 --limit 2 --max-tokens 16

The same rows are available as ``dflash bench --methods dflash --tree-budgets 0,4,8,16,32,auto``
(end-to-end tok/s and TPOT there; decode tok/s here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# Chat coding requests written for this benchmark (not taken from the drafter's training prompts).
PROMPTS = [
    "Write a Python function that returns the second largest distinct number in a list, or None.",
    "Write a Python function that turns a snake_case string into camelCase.",
    "Implement a small LRU cache class in Python with get and put methods.",
    "Write a Python function that checks whether a string of brackets ()[]{} is balanced.",
    "Write a Python function that flattens an arbitrarily nested list of integers.",
    "Write a Python function that returns the run-length encoding of a string, e.g. 'aaab' -> 'a3b1'.",
    "Write a Python function that merges overlapping intervals given as a list of (start, end) pairs.",
    "Write a Python function that reads a CSV file and returns the average of a named numeric column.",
    "Write a Python function that finds all prime numbers below n with the sieve of Eratosthenes.",
    "Write a Python function that rotates a square matrix 90 degrees clockwise in place.",
    "Write a Python dataclass for a bank account with deposit and withdraw methods that reject overdrafts.",
    "Write a Python function that returns the longest common prefix of a list of strings.",
]


def parse_budgets(text: str) -> list[int | None]:
    out: list[int | None] = []
    for part in text.replace(" ", ",").split(","):
        if part:
            out.append(None if part.lower() == "auto" else int(part))
    return out


def name_of(budget: int | None) -> str:
    return "auto" if budget is None else ("chain" if budget == 0 else f"tree{budget}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="target folder or Hub id (default: the embedded pair)")
    ap.add_argument("--drafter", help="drafter folder or Hub id (with --target)")
    ap.add_argument("--budgets", default="0,4,8,16,32,auto", help="tree budgets: 0 = chain, auto = runtime's choice")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="auto", help="auto (as dflash run), float32, bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--limit", type=int, default=None, help="first N prompts")
    ap.add_argument("--prompts", help="text file, one chat prompt per line (default: the built-in 12)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs per method first")
    ap.add_argument("--with-ar", action="store_true", help="also time plain decoding")
    ap.add_argument("--json", dest="json_out", help="write every measurement to this file")
    args = ap.parse_args(argv)

    from dflash_cli.common import session_options
    from runtime import DecodeOptions, SamplingParams
    from runtime.session import open_pipeline

    prompts = Path(args.prompts).read_text().splitlines() if args.prompts else list(PROMPTS)
    prompts = [p for p in prompts if p.strip()][: args.limit]
    budgets = parse_budgets(args.budgets)
    # as `dflash run`: load, then this machine's verify costs (measured once, cached; up to 65 tokens)
    session = session_options(None, args.target, args.drafter, "auto", args.dtype, threads=args.threads)
    pipe = open_pipeline(session, progress=lambda m: print(m, file=sys.stderr))
    if pipe.drafter is None:
        print("bench_tree: no drafter loaded", file=sys.stderr)
        return 2
    block = pipe.block_size
    d = pipe.describe()
    print(f"pair: {d['target']} + {d['drafter']} | {d['device']} {d['dtype']} | block {block}", file=sys.stderr)
    if pipe.costs is not None:
        c = pipe.costs.verify
        pts = [n for n in (1, block, 9, 17, 33, 65) if n <= len(c)]
        costs = ", ".join(f"{n}: {c[n - 1]:.2f}" for n in dict.fromkeys(pts))
        print(f"verify cost vs one token: {costs}; drafter {pipe.costs.draft:.2f}", file=sys.stderr)
    planner = pipe.make_decoder(DecodeOptions()).planner
    print(f"auto plan at start: {planner.plan()}", file=sys.stderr)

    methods: list[tuple[str, Any]] = [("ar", DecodeOptions(decoder="ar"))] if args.with_ar else []
    methods += [(name_of(b), DecodeOptions(tree_budget=b)) for b in budgets]
    params = SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True)
    encoded = [pipe.encode(p, chat=True) for p in prompts]

    def run(opts: Any, ids: list[int]) -> dict[str, Any]:
        t0 = time.perf_counter()
        events = list(pipe.stream(ids, params, opts))
        s = events[-1].stats
        return {
            "tokens": [t.token_id for e in events[:-1] for t in e.tokens],
            "tau": s.tau,
            "steps": s.verify_steps,
            "committed": s.tau * s.verify_steps,
            "decode_tok_s": s.decode_tokens_per_second,
            "tok_s": s.tokens_per_second,
            "tree_budget": getattr(s, "tree_budget", 0),
            "seconds": time.perf_counter() - t0,
        }

    for _ in range(args.warmup):
        for _, opts in methods:
            run(opts, encoded[0])
    results: dict[str, list[dict[str, Any]]] = {n: [] for n, _ in methods}
    for i, ids in enumerate(encoded):
        order = methods[i % len(methods) :] + methods[: i % len(methods)]
        for n, opts in order:
            results[n].append(run(opts, ids))
        print(f"prompt {i + 1}/{len(encoded)} done", file=sys.stderr)

    ref = "chain" if "chain" in results else methods[0][0]
    rows = []
    for n, runs in results.items():
        pooled = sum(r["committed"] for r in runs) / max(sum(r["steps"] for r in runs), 1)
        speed = [r["decode_tok_s"] / max(b["decode_tok_s"], 1e-9) for r, b in zip(runs, results[ref], strict=True)]
        same = sum(r["tokens"] == b["tokens"] for r, b in zip(runs, results[ref], strict=True))
        budgets_used = sorted({r["tree_budget"] for r in runs})
        rows.append(
            {
                "method": n,
                "tau_median": statistics.median(r["tau"] for r in runs),
                "tau_pooled": pooled,
                "decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in runs),
                "speedup_vs_chain_median": statistics.median(speed),
                "identical_to_chain": same,
                "tree_budgets_used": budgets_used,
            }
        )
    print(f"\n{len(encoded)} chat coding prompts, {args.max_tokens} tokens, greedy")
    print(f"{'method':<8} {'tau med':>8} {'tau pool':>9} {'dec tok/s':>10} {'vs chain':>9} {'same':>6}  budgets")
    for r in rows:
        print(
            f"{r['method']:<8} {r['tau_median']:>8.2f} {r['tau_pooled']:>9.2f} {r['decode_tok_s_median']:>10.2f} "
            f"{r['speedup_vs_chain_median']:>8.2f}x {r['identical_to_chain']:>3}/{len(encoded):<2}  "
            f"{','.join(map(str, r['tree_budgets_used']))}"
        )
    if args.json_out:
        doc = {"pair": d, "costs": pipe.costs.verify if pipe.costs else None, "rows": rows, "runs": results}
        Path(args.json_out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
