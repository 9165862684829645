"""Context lookup's n-gram sizes on a prompt set: pooled tau, median tok/s and copied tokens.

    python scripts/tune_lookup.py ood-chat 0,0 1,4 2,4 3,6     # 0,0 = lookup off

Embedded pair, bf16, 2 threads, 96 tokens per prompt (fixed length); variants run prompt by prompt
in the order given. Used to pick the context lookup's default (2, 4); see docs/decoding.md, "Context lookup".
"""

from __future__ import annotations

import statistics
import sys
import time

from dflash_cli.common import open_pipeline, session_options
from runtime.bench.datasets import load_dataset
from runtime.bench.runner import encode_prompt
from runtime.config import DecodeOptions, SamplingParams


def main(dataset: str, variants: list[tuple[int, int]], tokens: int = 96) -> None:
    pipe = open_pipeline(session_options(model="qwen2.5-coder-0.5b", dtype="bfloat16", threads=2))
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    res: dict[tuple[int, int], dict[str, list[float]]] = {
        v: {"steps": [], "committed": [], "tps": [], "copied": []} for v in variants
    }
    for p in load_dataset(dataset).prompts:
        ids = encode_prompt(pipe, p)
        for v in variants:
            dec = pipe.make_decoder(DecodeOptions(lookup=0 if v == (0, 0) else None))
            if v != (0, 0):
                dec.lookup_ngram = v  # type: ignore[attr-defined]
            t0 = time.perf_counter()
            st = list(dec.stream(ids, params))[-1].stats
            r = res[v]
            r["steps"].append(st.acceptance.steps)
            r["committed"].append(st.acceptance.committed)
            r["tps"].append(st.generated_tokens / (time.perf_counter() - t0))
            r["copied"].append(st.copied_tokens)
    for v, r in res.items():
        name = "off" if v == (0, 0) else f"n-grams {v[0]}..{v[1]}"
        print(
            f"{name:14} tau {sum(r['committed']) / sum(r['steps']):.3f}  tok/s median {statistics.median(r['tps']):.2f}"
            f"  copied {int(sum(r['copied']))}"
        )


if __name__ == "__main__":
    main(sys.argv[1], [(int(a), int(b)) for a, b in (v.split(",") for v in sys.argv[2:])])
