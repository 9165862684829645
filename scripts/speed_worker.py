"""One dflash configuration held in memory, decoding prompts on request (for ``speed_table.py``).

``speed_table.py`` uses it in-process for its own rows, and as two subprocesses for ``--baseline``:
one with ``PYTHONPATH`` set to the other checkout, one to this one. Both decode the same prompt one
after the other, in alternating order, so the machine's drift (shared 2-core machines swing by 10-20%
over minutes) falls on both sides alike instead of on whichever ran second.

It uses only the runtime API both checkouts share (``load_pipeline``, ``DecodeOptions``, ``stream``
and the ``Finished`` event's stats), so the baseline can be older code.

Subprocess protocol: ``python speed_worker.py CONFIG_JSON``; the worker prints ``ready``, then answers
each stdin line ``{"method": M, "prompt": I}`` with one JSON line (``Runner.run``'s result).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any


class Runner:
    """A loaded pair in one configuration, its verify costs measured on this machine.

    Args:
        config: ``quant`` (none, int8, int4, q4), ``dtype`` (float dtype for ``none``, else auto),
            ``engine`` (lean or hf), ``threads``, ``max_tokens``, ``prompts`` (texts), and optionally
            ``target``, ``drafter``, ``models_dir``.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        import torch

        from runtime import LoadOptions, ModelRef, RuntimeConfig, SamplingParams, load_pipeline
        from runtime.engine.calibrate import TREE_VERIFY_TOKENS, cached_costs

        torch.set_num_threads(config["threads"])
        quant = config["quant"]
        ref = ModelRef(target=config["target"], drafter=config.get("drafter")) if config.get("target") else ModelRef()
        kw: dict[str, Any] = {"quantize": None if quant == "none" else quant, "offline": True}
        if config.get("models_dir"):
            kw["models_dir"] = Path(config["models_dir"])
        rc = RuntimeConfig(device="cpu", dtype=config["dtype"], engine=config["engine"])
        self.pipe = load_pipeline(ref, rc, LoadOptions(**kw))
        with tempfile.TemporaryDirectory() as tmp:
            # measured now, on this machine, up to tree sizes as `dflash run` does (else only chains are chosen)
            self.pipe.costs = cached_costs(self.pipe, Path(tmp) / "calibration.json", max_tokens=TREE_VERIFY_TOKENS)
        self.ids = [self.pipe.encode(t) for t in config["prompts"]]
        self.params = SamplingParams(max_new_tokens=config["max_tokens"])
        short = {"torch.bfloat16": "bf16", "torch.float32": "fp32"}
        act = getattr(self.pipe.target, "dtype", self.pipe.dtype)  # activations (float32 over bf16 or int8 weights)
        act_name = short.get(str(act), str(act).removeprefix("torch."))
        weights = short.get(str(self.pipe.dtype), str(self.pipe.dtype).removeprefix("torch."))
        if quant != "none":
            self.label = f"{quant} ({act_name} act.)"
        else:
            self.label = weights if act == self.pipe.dtype else f"{weights} ({act_name} act.)"
        self.target_class = type(self.pipe.target).__name__
        from dataclasses import fields

        from runtime import DecodeOptions

        self.has_prompt_cache = any(f.name == "cache_prompt" for f in fields(DecodeOptions))  # older checkouts: none
        self._prefill_text: str | None = None
        self._prefill_ids: list[int] = []

    def run(self, method: str, prompt: int) -> dict[str, Any]:
        """Decode prompt ``prompt`` with ``method`` (``ar``, ``dflash``, ``dflash@K``, ``dflash@lookup0``)."""
        from runtime import DecodeOptions
        from runtime.engine.events import Finished

        name, _, k = method.partition("@")
        kw: dict[str, Any] = {"cache_prompt": False} if self.has_prompt_cache else {}  # every prompt read whole
        if k == "lookup0":  # the runtime's choice without the context lookup
            opts = DecodeOptions(decoder=name, lookup=0, **kw)
        else:
            opts = DecodeOptions(decoder=name, verify_length=int(k) if k else None, **kw)
        toks: list[int] = []
        for ev in self.pipe.stream(self.ids[prompt], self.params, opts):
            if isinstance(ev, Finished):
                st = ev.stats
            else:
                toks.extend(t.token_id for t in ev.tokens)
        verify = f"tree {st.tree_budget}" if st.tree_budget else st.verify_length
        return {
            "tok_s": st.decode_tokens_per_second,
            "tau": st.tau,
            "steps": st.verify_steps,
            "verify": verify,
            "tokens": toks,
        }

    def prefill(self, text: str, n: int) -> float:
        """Prompt tok/s reading the first ``n`` tokens of ``text`` (raw, no chat template): ``n`` over
        the time to the first token."""
        from runtime import DecodeOptions, SamplingParams
        from runtime.engine.events import PrefillDone

        if self._prefill_text is not text:  # tokenized once per text, not per timed reading
            self._prefill_text, self._prefill_ids = text, self.pipe.encode(text, chat=False)
        ids = self._prefill_ids[:n]
        if len(ids) < n:
            raise SystemExit(f"the prefill text has {len(ids)} tokens, fewer than {n}")
        kw: dict[str, Any] = {"cache_prompt": False} if self.has_prompt_cache else {}
        for ev in self.pipe.stream(ids, SamplingParams(max_new_tokens=1), DecodeOptions(decoder="ar", **kw)):
            if isinstance(ev, PrefillDone):
                return n / ev.seconds
        raise AssertionError("no PrefillDone event")


def main() -> None:
    runner = Runner(json.loads(sys.argv[1]))
    print(json.dumps({"ready": True, "label": runner.label, "target": runner.target_class}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        print(json.dumps(runner.run(ask["method"], int(ask["prompt"]))), flush=True)


if __name__ == "__main__":
    main()
