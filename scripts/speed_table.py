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

Example (see docs/speed.md and docs/llamacpp.md):
    python scripts/speed_table.py --llama-server ~/.cache/llamacpp/src/build/bin/llama-server \\
        --gguf bf16=target-bf16.gguf --gguf Q4_K_M=target-q4_k_m.gguf -n 96 --out speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any


def _post(url: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def llama_rows(args: argparse.Namespace, prompts: list[str]) -> list[dict[str, Any]]:
    rows = []
    modes = [("plain", [])] + ([("ngram", ["--spec-type", "ngram-simple"])] if args.llama_ngram else [])
    for spec in args.gguf:
        name, _, path = spec.partition("=")
        for mode, extra in modes:
            port = args.port
            cmd = [args.llama_server, "-m", path, "-t", str(args.threads), "-tb", str(args.threads), "-c", "4096"]
            cmd += ["--no-webui", "-np", "1", "--port", str(port), *extra]
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                base = f"http://127.0.0.1:{port}"
                for _ in range(240):
                    try:
                        with urllib.request.urlopen(base + "/health", timeout=2) as r:
                            if r.status == 200:
                                break
                    except OSError:
                        time.sleep(0.5)
                speeds, drafted, accepted = [], 0, 0
                for i, text in enumerate([prompts[0], *prompts]):
                    body = {
                        "messages": [{"role": "user", "content": text}],
                        "max_tokens": args.max_tokens,
                        "temperature": 0,
                        "cache_prompt": False,
                    }
                    t = _post(base + "/v1/chat/completions", body)["timings"]
                    if i == 0:
                        continue  # warm-up
                    speeds.append(float(t["predicted_per_second"]))
                    drafted += int(t.get("draft_n", 0) or 0)
                    accepted += int(t.get("draft_n_accepted", 0) or 0)
                row = {"engine": "llama.cpp", "weights": name, "method": mode, "tok_s": speeds}
                if drafted:
                    row["accept"] = accepted / drafted
                rows.append(row)
                print(f"  llama.cpp {name} {mode}: median {statistics.median(speeds):.2f} tok/s", file=sys.stderr)
            finally:
                proc.terminate()
                proc.wait(30)
    return rows


def dflash_rows(args: argparse.Namespace, prompt_texts: list[str]) -> list[dict[str, Any]]:
    import torch

    from runtime import DecodeOptions, LoadOptions, ModelRef, RuntimeConfig, SamplingParams, load_pipeline
    from runtime.engine.calibrate import TREE_VERIFY_TOKENS, cached_costs
    from runtime.engine.events import Finished
    from runtime.engine.models.target import TargetModel

    torch.set_num_threads(args.threads)
    rows = []
    params = SamplingParams(max_new_tokens=args.max_tokens)
    from runtime.engine.models.device import dtype_name

    configs = [
        (quant, dtype, engine)
        for quant in args.quantize
        for dtype in (args.float_dtypes if quant == "none" else ["auto"])
        for engine in (["lean", "hf"] if args.with_hf and quant == "none" else ["lean"])
    ]
    for quant, dtype, engine in configs:
        ref = ModelRef(target=args.target, drafter=args.drafter) if args.target else ModelRef()
        opts = LoadOptions(quantize=None if quant == "none" else quant, offline=True)
        if args.models_dir:
            opts = LoadOptions(quantize=opts.quantize, offline=True, models_dir=Path(args.models_dir))
        pipe = load_pipeline(ref, RuntimeConfig(device="cpu", dtype=dtype, engine=engine), opts)
        if engine == "hf":
            assert type(pipe.target) is TargetModel
        with tempfile.TemporaryDirectory() as tmp:
            # measured now, on this machine, up to tree sizes as `dflash run` does (else only chains are chosen)
            pipe.costs = cached_costs(pipe, Path(tmp) / "calibration.json", max_tokens=TREE_VERIFY_TOKENS)
        ids = [pipe.encode(t) for t in prompt_texts]
        short = {"bfloat16": "bf16", "float32": "fp32"}.get(dtype_name(pipe.dtype), dtype_name(pipe.dtype))
        label = short if quant == "none" else f"{quant} ({short} act.)"
        outputs: dict[str, list[list[int]]] = {}
        fixed = [f"dflash@{k}" for k in args.verify_lengths] + (["dflash@lookup0"] if args.lookup_off else [])
        for method in ("ar", "dflash", *fixed):
            name, _, k = method.partition("@")
            if k == "lookup0":  # the runtime's choice without the context lookup
                dopts = DecodeOptions(decoder=name, lookup=0, cache_prompt=False)
            else:
                dopts = DecodeOptions(decoder=name, verify_length=int(k) if k else None, cache_prompt=False)
            speeds, taus, verify, steps, committed = [], [], 0, 0, 0.0
            outs = []
            for i, p in enumerate([ids[0], *ids]):
                toks: list[int] = []
                for ev in pipe.stream(p, params, dopts):
                    if isinstance(ev, Finished):
                        st = ev.stats
                    else:
                        toks.extend(t.token_id for t in ev.tokens)
                if i == 0:
                    continue
                outs.append(toks)
                speeds.append(st.decode_tokens_per_second)
                taus.append(st.tau)
                verify = f"tree {st.tree_budget}" if st.tree_budget else st.verify_length
                steps += st.verify_steps
                committed += st.tau * st.verify_steps
            outputs[method] = outs
            row = {"engine": f"dflash ({engine})", "weights": label, "method": method, "tok_s": speeds}
            if name == "dflash":
                row["tau"] = committed / steps if steps else 1.0
                row["verify"] = verify
                row["same_as_ar"] = sum(a == b for a, b in zip(outputs["ar"], outs, strict=True))
            rows.append(row)
            print(f"  dflash {engine} {label} {method}: median {statistics.median(speeds):.2f} tok/s", file=sys.stderr)
        del pipe
    return rows


def baseline_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The dflash rows of the checkout at ``args.baseline`` (its own speed_table.py, same arguments)."""
    base = Path(args.baseline).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "before.json"
        cmd = [sys.executable, str(base / "scripts" / "speed_table.py"), "--dataset", args.dataset]
        cmd += ["-n", str(args.max_tokens), "--threads", str(args.threads), "--out", str(out)]
        cmd += ["--quantize", ",".join(args.quantize), "--float-dtypes", ",".join(args.float_dtypes)]
        if args.limit is not None:
            cmd += ["--limit", str(args.limit)]
        for flag in ("target", "drafter", "models_dir"):
            if getattr(args, flag):
                cmd += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
        env = {**__import__("os").environ, "PYTHONPATH": str(base)}
        print(f"baseline: {base}", file=sys.stderr)
        subprocess.run(cmd, cwd=base, env=env, check=True, stdout=subprocess.DEVNULL)
        return list(json.loads(out.read_text())["rows"])


def print_comparison(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> None:
    """Before/after medians of the same rows, with the ratio and whether the text stayed the same."""
    print("\n| weights | method | before tok/s | after tok/s | after/before | tau before | tau after | = ar after |")
    print("|---|---|---|---|---|---|---|---|")
    old = {(r["weights"], r["method"]): r for r in before}
    for r in after:
        b = old.get((r["weights"], r["method"]))
        if b is None or not r["engine"].startswith("dflash"):
            continue
        mb, ma = statistics.median(b["tok_s"]), statistics.median(r["tok_s"])
        tb = f"{b['tau']:.2f}" if "tau" in b else "-"
        ta = f"{r['tau']:.2f}" if "tau" in r else "-"
        same = f"{r['same_as_ar']}/{len(r['tok_s'])}" if "same_as_ar" in r else "-"
        print(f"| {r['weights']} | {r['method']} | {mb:.2f} | {ma:.2f} | {ma / mb:.3f} | {tb} | {ta} | {same} |")
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
    ap.add_argument("--with-hf", action="store_true", help="also transformers' forward on bf16 (the step before)")
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--models-dir")
    ap.add_argument("--port", type=int, default=8091)
    ap.add_argument("--out")
    ap.add_argument("--baseline", help="another checkout: its dflash rows first, then these, side by side")
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
    if args.llama_server:
        rows += llama_rows(args, prompts)
    before = baseline_rows(args) if args.baseline else None
    rows += dflash_rows(args, prompts)
    if before is not None:
        print_comparison(before, rows)
    print("| engine | weights | method | median decode tok/s | min-max | tau | verify / tree | = ar |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["tok_s"]
        tau = f"{r['tau']:.2f}" if "tau" in r else ("-" if "accept" not in r else f"accept {100 * r['accept']:.0f}%")
        same = f"{r['same_as_ar']}/{len(s)}" if "same_as_ar" in r else "-"
        print(
            f"| {r['engine']} | {r['weights']} | {r['method']} | {statistics.median(s):.2f} | "
            f"{min(s):.1f}-{max(s):.1f} | {tau} | {r.get('verify', '-')} | {same} |"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"prompts": args.dataset, "max_tokens": args.max_tokens, "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
