"""One-call GPU check (issue 43): exactness, speed, host reads, kernels and verify costs of the decode
loop on random-weight pairs, offline, with only the repository and its wheels.

    python scripts/gpu_check.py --out gpu-check            # CUDA, the full check (a few minutes)
    python scripts/gpu_check.py --device cpu --quick --out /tmp/dry   # the CI dry run (tiny shapes)

Sections, each written to ``OUT/<section>.json`` as it ends (a failing section records its error
and the next one runs):

- ``exactness``: plain, chain and tree greedy decoding against a cache-free reference (the whole
  sequence through the model for every token) on tiny random pairs; float32 must match exactly, bf16
  agreement is reported with the reference's top-2 logit margin at the first divergence.
- ``speed``: plain vs chain vs tree tok/s on random-weight targets shaped like the embedded target
  (Qwen2.5-Coder-0.5B) and like an 8B model, with oracle drafts (the target's own continuation,
  each slot right with probability ``--accept``), so speed-ups at a fixed tau compare across machines.
- ``host_reads``: device reads per step (``runtime.engine.transfer.download``) for chain and tree.
- ``profile``: CUDA kernels per chain step, the share of step time outside kernels, which attention
  kernels ran (torch.profiler); skipped on the CPU.
- ``costs``: the verify cost curve measured on the device (chains and tree sizes) beside the prior
  the planner would use without it.
- ``compile``: chain decode tok/s eager vs ``torch.compile`` (default) vs ``reduce-overhead`` (CUDA
  graphs) on the lean forward.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.config import SamplingParams  # noqa: E402
from runtime.engine import chain_decoder, plain_decoder, transfer, tree_decoder  # noqa: E402
from runtime.engine.events import BlockVerified, Finished  # noqa: E402
from runtime.engine.models.drafter import DFlashDraftModel
from runtime.engine.models.drafter_config import DraftModelConfig  # noqa: E402
from runtime.engine.models.lean_target import LeanTarget  # noqa: E402
from runtime.engine.propose import DrafterProposer  # noqa: E402
from runtime.engine.step import RequestContext  # noqa: E402

SHAPES = {  # (hidden, layers, heads, kv heads, intermediate, vocab)
    "tiny": (64, 4, 4, 2, 128, 256),
    "qwen2.5-coder-0.5b": (896, 24, 14, 2, 4864, 151936),
    "8b": (4096, 36, 32, 8, 12288, 151936),
}


def target_model(shape: str, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Any:
    """A random Qwen2-architecture target of the given shape."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    hidden, layers, heads, kv, inter, vocab = SHAPES[shape]
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
        intermediate_size=inter, vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=shape == "tiny",
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    return model.eval()


def drafter_model(target: Any, block: int, dtype: torch.dtype, device: torch.device, layers: int = 1) -> Any:
    """A random one-layer DFlash drafter wired to ``target`` (its last-but-one layers tapped)."""
    c = target.config
    n = c.num_hidden_layers
    taps = sorted({max(0, n // 4), n // 2, max(0, n - 2)})
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": block,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.hidden_size // c.num_attention_heads, "vocab_size": c.vocab_size, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "max_position_embeddings": 4096, "num_target_layers": n,
        "dflash_config": {"target_layer_ids": taps, "mask_token_id": c.vocab_size - 1, "block_size": block},
    }  # fmt: skip
    torch.manual_seed(1)
    with torch.device(device):
        model = DFlashDraftModel(DraftModelConfig.from_dict(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.02)
    return model.to(dtype).eval()


def reference(model: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Cache-free greedy ids and the top-2 logit margin at each position."""
    ids, margins = list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids], device=model.device)).logits[0, -1].float()
            top = torch.topk(logits, 2).values
            margins.append(float(top[0] - top[1]))
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :], margins


def prompt_ids(model: Any, n: int) -> list[int]:
    """A fixed prompt of ``n`` ids inside the vocabulary (the last id is the drafter's mask)."""
    return [(13 * i) % min(1000, model.config.vocab_size - 2) + 1 for i in range(n)]


def decode_ids(decoder: Any, prompt: list[int], n: int) -> tuple[list[int], Any]:
    ids, stats = [], None
    for e in decoder.stream(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True)):
        if isinstance(e, Finished):
            stats = e.stats
        else:
            ids.extend(t.token_id for t in e.tokens)
    return ids, stats


class OracleProposer(DrafterProposer):
    """Drafts the target's own continuation (known in advance), each slot right with probability ``p``."""

    def __init__(self, target: Any, drafter: Any, block: int, truth: list[int], p: float) -> None:
        super().__init__(target, drafter, block)
        self.truth, self.p, self.gen = truth, p, torch.Generator().manual_seed(0)

    def _drafts(self, ctx: RequestContext, depth: int) -> list[int]:
        at = len(ctx.committed) - self.n_prompt
        out = []
        for t in self.truth[at : at + depth] + [0] * depth:
            right = float(torch.rand((), generator=self.gen)) < self.p
            out.append(t if right else (t + 1) % self.target.vocab_size)
        return out[:depth]

    def chain(self, ctx: RequestContext, depth: int) -> torch.Tensor:
        return transfer.upload(self._drafts(ctx, depth), torch.long, ctx.device)

    def logprobs(self, ctx: RequestContext, depth: int) -> tuple[torch.Tensor, None, None]:
        scores = torch.full((depth, self.target.vocab_size), -30.0, device=ctx.device)
        for d, t in enumerate(self._drafts(ctx, depth)):
            scores[d, t] = 0.0
            scores[d, (t + 1) % self.target.vocab_size] = -2.0  # a runner-up: trees can find it
        return torch.log_softmax(scores, -1), None, None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def section(out: Path, name: str, fn: Callable[[], dict[str, Any]], results: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    try:
        doc = fn()
    except Exception as e:  # noqa: BLE001 - recorded; the next section runs
        doc = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    doc["seconds"] = round(time.perf_counter() - t0, 2)
    results[name] = doc
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2))
    print(f"{name}: {'error' if 'error' in doc else 'ok'} ({doc['seconds']} s)", file=sys.stderr)


def exactness(device: torch.device, n: int) -> dict[str, Any]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for seed in range(3):
            model = target_model("tiny", dtype, device, seed)
            target = LeanTarget(model)
            drafter = drafter_model(model, 4, dtype, device)
            prompt = [(7 * seed + 3 * i) % 200 + 1 for i in range(9)]
            ref, margins = reference(model, prompt, n)
            for name, dec in (
                ("plain", plain_decoder(target)),
                ("chain", chain_decoder(target, drafter)),
                ("tree", tree_decoder(target, drafter, tree_budget=6, lookup=8)),
            ):
                ids, _ = decode_ids(dec, prompt, n)
                first = next((i for i, (a, b) in enumerate(zip(ids, ref, strict=False)) if a != b), None)
                rows.append({
                    "dtype": str(dtype).removeprefix("torch."), "seed": seed, "decoder": name, "equal": ids == ref,
                    "first_divergence": first, "margin_there": None if first is None else round(margins[first], 4),
                })  # fmt: skip
    f32 = [r for r in rows if r["dtype"] == "float32"]
    return {"rows": rows, "float32_exact": all(r["equal"] for r in f32),
            "bf16_equal": sum(r["equal"] for r in rows if r["dtype"] == "bfloat16")}  # fmt: skip


def speed(device: torch.device, shapes: list[str], n: int, accept: float, dtype: torch.dtype) -> dict[str, Any]:
    rows = []
    for shape in shapes:
        model = target_model(shape, dtype, device)
        target = LeanTarget(model)
        drafter = drafter_model(model, 16, dtype, device)
        prompt = prompt_ids(model, 128)
        truth, _ = decode_ids(plain_decoder(target), prompt, n + 32)
        for name in ("plain", "chain", "tree"):
            decode_ids(speed_decoder(name, target, drafter, truth, accept, prompt), prompt, 8)  # warm-up
            sync(device)
            t0 = time.perf_counter()
            ids, stats = decode_ids(speed_decoder(name, target, drafter, truth, accept, prompt), prompt, n)
            sync(device)
            dt = time.perf_counter() - t0
            rows.append({"shape": shape, "decoder": name, "tok_s": round(len(ids) / dt, 2),
                         "tau": round(stats.tau, 3) if stats else None, "same_as_plain": ids == truth[: len(ids)]})  # fmt: skip
        del model, target, drafter
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"accept": accept, "dtype": str(dtype), "rows": rows}


def speed_decoder(name: str, target: Any, drafter: Any, truth: list[int], p: float, prompt: list[int]) -> Any:
    """Plain decoding, or a chain / tree of oracle drafts."""
    if name == "plain":
        return plain_decoder(target)
    prop = oracle(target, drafter, truth, p, prompt)
    if name == "chain":
        return chain_decoder(target, drafter, proposer=prop)
    return tree_decoder(target, drafter, tree_budget=32, proposer=prop)


def oracle(target: Any, drafter: Any, truth: list[int], p: float, prompt: list[int]) -> OracleProposer:
    prop = OracleProposer(target, drafter, drafter.dflash.block_size, truth, p)
    prop.n_prompt = len(prompt) + 1  # the first token comes from the prefill
    return prop


def host_reads(device: torch.device) -> dict[str, Any]:
    model = target_model("tiny", torch.float32, device)
    target = LeanTarget(model)
    drafter = drafter_model(model, 4, torch.float32, device)
    out = {}
    for name, dec in (("chain", chain_decoder(target, drafter)), ("tree", tree_decoder(target, drafter, tree_budget=6))):
        count = [0]

        def counting(t: torch.Tensor, real: Any = transfer.download, count: list[int] = count) -> list[Any]:
            count[0] += 1
            return real(t)

        import runtime.engine.drafts as drafts_mod
        import runtime.engine.tree as tree_mod

        saved = (drafts_mod.download, tree_mod.download)
        drafts_mod.download = tree_mod.download = counting  # type: ignore[assignment]
        try:
            steps, per = 0, []
            for e in dec.stream([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=24, ignore_eos=True)):
                if isinstance(e, BlockVerified):
                    per.append(count[0])
                    count[0] = 0
                    steps += 1
        finally:
            drafts_mod.download, tree_mod.download = saved
        out[name] = {"steps": steps, "reads_per_step": sorted(set(per))}
    return out


def profile(device: torch.device, shape: str, dtype: torch.dtype) -> dict[str, Any]:
    if device.type != "cuda":
        return {"skipped": "the profiler section needs CUDA"}
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    model = target_model(shape, dtype, device)
    target = LeanTarget(model)
    drafter = drafter_model(model, 16, dtype, device)
    dec = chain_decoder(target, drafter)
    prompt = prompt_ids(model, 128)
    decode_ids(dec, prompt, 8)
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        _, stats = decode_ids(dec, prompt, 32)
        sync(device)
    kernels = [e for e in p.events() if e.device_type.name == "CUDA"]
    steps = max(stats.verify_steps if stats else 1, 1)
    busy = sum(e.device_time for e in kernels) / 1e6
    wall = stats.total_seconds if stats else 1.0
    attn = sorted({e.name for e in kernels if any(k in e.name.lower() for k in ("attention", "flash", "fmha", "sdpa"))})
    return {"kernels_per_step": round(len(kernels) / steps, 1), "share_outside_kernels": round(1 - busy / wall, 3),
            "attention_kernels": attn[:10]}  # fmt: skip


def costs(device: torch.device, shape: str, dtype: torch.dtype) -> dict[str, Any]:
    from types import SimpleNamespace

    from runtime.engine.calibrate import TREE_VERIFY_TOKENS, measure_costs
    from runtime.engine.costs import prior_cost

    model = target_model(shape, dtype, device)
    target = LeanTarget(model)
    drafter = drafter_model(model, 16, dtype, device)
    pipe = SimpleNamespace(target=target, drafter=drafter, block_size=16, device=device)
    measured = measure_costs(pipe, context=96, reps=3, max_tokens=TREE_VERIFY_TOKENS)
    prior = prior_cost(device.type)
    return {"measured": list(measured.verify), "draft": measured.draft, "one_token_s": measured.one_token_seconds,
            "prior": prior[: len(measured.verify)]}  # fmt: skip


def compiled(device: torch.device, shape: str, dtype: torch.dtype, n: int) -> dict[str, Any]:
    rows = {}
    modes: list[str | None] = ["eager", None] + (["reduce-overhead"] if device.type == "cuda" else [])
    for mode in modes:
        model = target_model(shape, dtype, device)
        target = LeanTarget(model)
        if mode != "eager":
            target.compile(mode=mode)
        drafter = drafter_model(model, 16, dtype, device)
        dec = chain_decoder(target, drafter)
        prompt = prompt_ids(model, 64)
        decode_ids(dec, prompt, 16)  # compiles
        sync(device)
        t0 = time.perf_counter()
        ids, _ = decode_ids(dec, prompt, n)
        sync(device)
        rows[str(mode or "default")] = round(len(ids) / (time.perf_counter() - t0), 2)
    return {"tok_s": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few tokens (the CPU dry run)")
    ap.add_argument("--accept", type=float, default=0.8, help="oracle drafts: P(a slot is right)")
    ap.add_argument("--sections", default="exactness,speed,host_reads,profile,costs,compile")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: CUDA is not available here; use --device cpu --quick for the dry run")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    quick = args.quick
    shapes = ["tiny"] if quick else ["qwen2.5-coder-0.5b", "8b"]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    n = 16 if quick else 128
    plan = {
        "exactness": lambda: exactness(device, 12 if quick else 48),
        "speed": lambda: speed(device, shapes, n, args.accept, dtype),
        "host_reads": lambda: host_reads(device),
        "profile": lambda: profile(device, shapes[0], dtype),
        "costs": lambda: costs(device, shapes[0], dtype),
        "compile": lambda: compiled(device, shapes[0], dtype, n) if not quick else {"skipped": "--quick"},
    }
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                               "torch": torch.__version__}  # fmt: skip
    for name in [s.strip() for s in args.sections.split(",") if s.strip()]:
        section(out, name, plan[name], results)
    (out / "summary.json").write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k not in ("exactness",)}, indent=1)[:4000])


if __name__ == "__main__":
    main()
