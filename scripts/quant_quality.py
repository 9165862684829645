"""What a quantization scheme does to the embedded target's quality and speed, against its float
weights, on one machine in one run (a benchmark: run it by hand, not in tests).

For the float pair (``--base-dtype``, default bfloat16) and each scheme in ``--schemes`` (default q4,
quantized at load with the activation dtype ``--dtype``, default dflash's auto):

- greedy agreement on held-out prompts (``--dataset``, default chat-coding: chat coding requests
  written for dflash, not in the drafter's training data), ``-n`` tokens each, EOS ignored:
  the share of the float target's greedy tokens that the quantized target also picks when fed the
  same text (teacher forcing), the mean share of each continuation reproduced before the first
  difference, and how many continuations are identical;
- perplexity on held-out text (``--text FILE``, repeatable; default: this checkout's docs/*.md and
  runtime/engine/*.py, written after the model's training data was collected), cut into windows of
  ``--ctx`` tokens and, as llama.cpp's ``llama-perplexity`` does, scoring the second half of each
  window (``--text-out FILE`` writes the text used, for ``llama-perplexity -f FILE -c CTX`` on a GGUF
  of the same model, e.g. its Q4_K_M);
- decode tok/s of plain and DFlash decoding (the runtime's ``GenerationStats``, prompt excluded),
  tau, and whether DFlash output equals plain output on every prompt (it must: lossless with
  respect to the quantized target).

Example (the embedded pair, 2 threads; the Markdown table on stdout, every number with --out):
    python scripts/quant_quality.py --schemes q4,int8 --threads 2 -n 96 --out quality.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def default_texts() -> list[Path]:
    """Held-out text: this checkout's own documentation and engine source."""
    return sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "runtime" / "engine").glob("*.py"))


def perplexity(pipe: Any, ids: list[int], ctx: int) -> tuple[float, int]:
    """(perplexity, tokens scored) of ``ids`` under ``pipe``'s target: windows of ``ctx`` tokens, the
    second half of each scored (its first half is context), as llama.cpp's llama-perplexity does."""
    import math

    import torch

    nll, scored = 0.0, 0
    first = ctx // 2
    with torch.inference_mode():
        for start in range(0, len(ids) - ctx + 1, ctx):
            window = ids[start : start + ctx]
            seq = torch.tensor([window], device=pipe.target.device)
            logits, _ = pipe.target.forward(seq, pipe.target.new_cache(capacity=ctx + 8), capture=False)
            logp = torch.log_softmax(logits.float(), dim=-1)  # logits[j] predicts token j + 1
            target = torch.tensor(window[first:], device=logp.device)
            nll -= float(logp[first - 1 : ctx - 1].gather(1, target[:, None]).sum())
            scored += ctx - first
    return (math.exp(nll / scored) if scored else float("nan")), scored


def measure(pipe: Any, prompts: list[list[int]], n: int, text_ids: list[int], ctx: int) -> dict[str, Any]:
    """Greedy runs (DFlash when the pair has a drafter, and plain) and the perplexity of one pair."""
    from runtime.quantize.report import measure_pair

    t0 = time.perf_counter()
    runs = measure_pair(pipe, prompts, n)
    ppl, scored = perplexity(pipe, text_ids, ctx)
    out: dict[str, Any] = {
        "plain_tok_s": runs.ar.tokens_per_second,
        "ar_tokens": [list(t) for t in runs.ar.tokens],
        "perplexity": ppl,
        "scored_tokens": scored,
    }
    if runs.dflash is not None:
        same = sum(a == b for a, b in zip(runs.dflash.tokens, runs.ar.tokens, strict=True))
        out.update(dflash_tok_s=runs.dflash.tokens_per_second, tau=runs.dflash.tau, dflash_equals_plain=same)
    out["seconds"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default="q4", help="comma list of quantization schemes (default q4)")
    ap.add_argument("--base-dtype", default="bfloat16", help="dtype of the float pair (default bfloat16)")
    ap.add_argument("--dtype", default="auto", help="activation dtype of the quantized pairs (default auto)")
    ap.add_argument("--dataset", default="chat-coding", help="dflash bench dataset of prompts (default chat-coding)")
    ap.add_argument("--limit", type=int, default=12, help="prompts of the dataset (default 12)")
    ap.add_argument("-n", "--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text", action="append", default=[], help="held-out text file (repeatable)")
    ap.add_argument("--text-out", help="write the held-out text used here (for llama-perplexity -f)")
    ap.add_argument("--ctx", type=int, default=512, help="perplexity window in tokens (default 512)")
    ap.add_argument("--max-text-tokens", type=int, default=8192, help="tokens of held-out text (default 8192)")
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--models-dir")
    ap.add_argument("--out", help="write every number as JSON")
    args = ap.parse_args()
    if args.ctx < 4:
        ap.error("--ctx must be at least 4")

    import torch

    from runtime import LoadOptions, ModelRef, RuntimeConfig, load_pipeline
    from runtime.bench.datasets import load_dataset
    from runtime.quantize.report import prefix_share

    torch.set_num_threads(args.threads)
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    ref = ModelRef(target=args.target, drafter=args.drafter) if args.target else ModelRef()
    models = {"models_dir": Path(args.models_dir)} if args.models_dir else {}
    texts = [Path(t) for t in args.text] or default_texts()
    text = "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in texts)
    prompt_texts = [p.text for p in load_dataset(args.dataset).limit(args.limit).prompts]
    print(
        f"{len(prompt_texts)} prompts ({args.dataset}), {args.max_tokens} tokens, greedy, {args.threads} threads; "
        f"perplexity over {len(texts)} files, windows of {args.ctx}",
        file=sys.stderr,
    )

    rows: list[dict[str, Any]] = []
    base_tokens: list[list[int]] = []
    prompts: list[list[int]] = []
    text_ids: list[int] = []
    for scheme in ["none", *schemes]:
        dtype = args.base_dtype if scheme == "none" else args.dtype
        opts = LoadOptions(quantize=None if scheme == "none" else scheme, offline=True, **models)
        pipe = load_pipeline(ref, RuntimeConfig(device="cpu", dtype=dtype, threads=args.threads), opts)
        if not prompts:
            if pipe.tokenizer is None:
                sys.exit("quant_quality: the target has no tokenizer")
            prompts = [pipe.encode(t) for t in prompt_texts]
            text_ids = pipe.tokenizer(text, add_special_tokens=False)["input_ids"][: args.max_text_tokens]
            if args.text_out:
                Path(args.text_out).write_text(pipe.tokenizer.decode(text_ids), encoding="utf-8")
        label = "float" if scheme == "none" else scheme
        act = str(pipe.dtype).removeprefix("torch.")
        print(f"  measuring {label} ({act} activations)", file=sys.stderr)
        row = {"weights": label, "dtype": act, **measure(pipe, prompts, args.max_tokens, text_ids, args.ctx)}
        if scheme == "none":
            base_tokens = row["ar_tokens"]
        else:
            from runtime.quantize.report import agreement

            row["agreement"] = agreement(pipe, prompts, base_tokens)
            pairs = list(zip(row["ar_tokens"], base_tokens, strict=True))
            row["prefix_share"] = statistics.mean(prefix_share(a, b) for a, b in pairs)
            row["identical"] = sum(a == b for a, b in pairs)
        rows.append(row)
        del pipe

    n = len(prompts)
    print(
        "| weights | act. | greedy agreement | prefix kept | identical | perplexity | plain tok/s | DFlash tok/s "
        "| tau | DFlash = plain |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        agree = f"{100 * r['agreement']:.1f}%" if "agreement" in r else "-"
        prefix = f"{100 * r['prefix_share']:.1f}%" if "prefix_share" in r else "-"
        ident = f"{r['identical']}/{n}" if "identical" in r else "-"
        dfl = f"{r['dflash_tok_s']:.2f}" if "dflash_tok_s" in r else "-"
        tau = f"{r['tau']:.2f}" if "tau" in r else "-"
        same = f"{r['dflash_equals_plain']}/{n}" if "dflash_equals_plain" in r else "-"
        print(
            f"| {r['weights']} | {r['dtype']} | {agree} | {prefix} | {ident} | {r['perplexity']:.3f} | "
            f"{r['plain_tok_s']:.2f} | {dfl} | {tau} | {same} |"
        )
    if args.out:
        meta = {"dataset": args.dataset, "prompts": n, "max_tokens": args.max_tokens, "threads": args.threads}
        meta |= {"ctx": args.ctx, "text_files": [str(p) for p in texts], "text_tokens": len(text_ids)}
        Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
