"""The results of a bench run as frozen dataclasses: ``BenchResult`` (one run), ``MethodResult`` (one
row: speeds, acceptance, memory, agreement with ``ar``), ``Divergence``; and their JSON documents
(schema ``dflash.bench/1``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from runtime.bench.config import BenchConfig
from runtime.bench.methods import PromptRun
from runtime.bench.pitfalls import BenchWarning

SCHEMA = "dflash.bench/1"


@dataclass(frozen=True)
class Divergence:
    """Where a greedy method first produced a different token from ``ar``.

    Attributes:
        prompt_index: index of the prompt in the set.
        prompt_id: its id.
        position: index of the first differing generated token.
        expected: ``ar``'s token id there (None: ``ar`` had already stopped).
        got: the method's token id there (None: the method had stopped).
        expected_text, got_text: those tokens decoded on their own.
    """

    prompt_index: int
    prompt_id: str
    position: int
    expected: int | None
    got: int | None
    expected_text: str = ""
    got_text: str = ""


@dataclass(frozen=True)
class MethodResult:
    """Everything measured for one method over the prompt set.

    Attributes:
        name: row name (``ar``, ``hf``, ``pld``, ``assisted``, ``dflash`` or ``dflash-bN``).
        method: the method.
        draft: what proposes the drafts (drafter or assistant name, "prompt n-grams"; None).
        block_size: DFlash block size used (None for the others).
        verify_lengths: DFlash verify length the runtime used, per prompt.
        tree_budgets: DFlash tree budget the runtime used, per prompt (0: chain).
        lookups: DFlash context-lookup length, per prompt (0: off).
        runs: per-prompt measurements, in prompt order.
        tok_s_median, tok_s_mean, tok_s_stdev, tok_s_min, tok_s_max: tokens per second over prompts.
        ttft_median: median time to first token (s).
        tpot_median: median time per output token after the first (s).
        speedup: median over prompts of tok/s divided by ``ar``'s tok/s on the same prompt.
        tau: tokens committed per target verify step (DFlash); tokens per ``generate`` step
            (pld, assisted); 1.0 for plain decoding.
        acceptance_rate: accepted / drafted (None when the method does not tell).
        per_position_acceptance: for draft slot k, the share of steps verifying it in which drafts
            1..k were all accepted (DFlash).
        acceptance_histogram: entry i counts steps that accepted exactly i drafts (DFlash).
        peak_memory: largest peak over the runs (bytes; None when unknown).
        agreement: prompts whose tokens equal ``ar``'s (None when not checked: sampling).
        first_divergence: the first prompt and token where they differ.
    """

    name: str
    method: str
    draft: str | None
    block_size: int | None
    verify_lengths: tuple[int, ...]
    runs: tuple[PromptRun, ...]
    tok_s_median: float
    tok_s_mean: float
    tok_s_stdev: float
    tok_s_min: float
    tok_s_max: float
    ttft_median: float
    tpot_median: float | None
    speedup: float | None
    tau: float | None
    acceptance_rate: float | None
    per_position_acceptance: tuple[float, ...]
    acceptance_histogram: tuple[int, ...]
    peak_memory: int | None
    agreement: int | None
    first_divergence: Divergence | None
    tree_budgets: tuple[int, ...] = ()
    lookups: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        """Display name, e.g. ``dflash b8 (verify 3)``, ``dflash b8 tree16`` or ``dflash b8 tree8 lookup16``."""
        if self.method != "dflash":
            return self.name
        text = f"dflash b{self.block_size}" if self.block_size else "dflash"
        tb = sorted(set(self.tree_budgets))
        if tb and tb[-1] > 0:
            text += f" tree{tb[0]}" if len(tb) == 1 else f" tree{tb[0]}-{tb[-1]}"
            lk = sorted(set(self.lookups))
            if lk and lk[-1] > 0:
                text += f" lookup{lk[0]}" if len(lk) == 1 else f" lookup{lk[0]}-{lk[-1]}"
            return text
        vl = sorted(set(self.verify_lengths))
        if vl:
            text += f" (verify {vl[0]})" if len(vl) == 1 else f" (verify {vl[0]}-{vl[-1]})"
        return text

    def to_json(self, prompt_ids: Sequence[str] = (), with_tokens: bool = False) -> dict[str, Any]:
        """Plain-JSON form (per-prompt runs included; token ids only with ``with_tokens``)."""
        runs = []
        for i, r in enumerate(self.runs):
            d: dict[str, Any] = {
                "prompt": prompt_ids[i] if i < len(prompt_ids) else i,
                "new_tokens": r.new_tokens,
                "seconds": r.seconds,
                "tokens_per_second": r.tokens_per_second,
                "ttft_seconds": r.ttft_seconds,
                "tpot_seconds": r.tpot_seconds,
                "steps": r.steps,
                "drafted": r.drafted,
                "accepted": r.accepted,
                "verify_length": r.verify_length,
                "tree_budget": r.tree_budget,
                "lookup": r.lookup,
                "copied": r.copied,
                "peak_memory_bytes": r.peak_memory,
            }
            if with_tokens:  # null: the server streamed text without token ids
                d["tokens"] = list(r.tokens) if r.generated is None else None
            runs.append(d)
        return {
            "name": self.name,
            "label": self.label,
            "method": self.method,
            "draft": self.draft,
            "block_size": self.block_size,
            "verify_lengths": list(self.verify_lengths),
            "tree_budgets": list(self.tree_budgets),
            "tokens_per_second": {
                "median": self.tok_s_median,
                "mean": self.tok_s_mean,
                "stdev": self.tok_s_stdev,
                "min": self.tok_s_min,
                "max": self.tok_s_max,
            },
            "ttft_seconds": self.ttft_median,
            "tpot_seconds": self.tpot_median,
            "speedup": self.speedup,
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance": list(self.per_position_acceptance),
            "acceptance_histogram": list(self.acceptance_histogram),
            "peak_memory_bytes": self.peak_memory,
            "agreement": None
            if self.agreement is None
            else {
                "prompts": len(self.runs),
                "identical": self.agreement,
                "first_divergence": asdict(self.first_divergence) if self.first_divergence else None,
            },
            "runs": runs,
        }


@dataclass(frozen=True)
class BenchResult:
    """One bench run.

    Attributes:
        config: what was asked.
        dataset: name, kind, source, licence and count of the prompts.
        prompt_ids: ids of the prompts, in order.
        prompt_tokens: their lengths in tokens.
        environment: device, dtype, versions, CPU/GPU name, model ids and revisions.
        methods: one result per row, ``ar`` first.
        warnings: pitfalls found, with fixes.
        created: UTC timestamp (ISO 8601).
    """

    config: BenchConfig
    dataset: dict[str, Any]
    prompt_ids: tuple[str, ...]
    prompt_tokens: tuple[int, ...]
    environment: dict[str, Any]
    methods: tuple[MethodResult, ...]
    warnings: tuple[BenchWarning, ...] = ()
    created: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))

    def method(self, name: str) -> MethodResult:
        """The row called ``name``."""
        for m in self.methods:
            if m.name == name:
                return m
        raise KeyError(name)

    def to_json(self, run_id: int | None = None, with_tokens: bool = False) -> dict[str, Any]:
        """The JSON document of ``dflash bench --format json`` (schema ``dflash.bench/1``)."""
        cfg = asdict(self.config)
        cfg["methods"] = list(self.config.methods)
        cfg["block_sizes"] = list(self.config.block_sizes)
        cfg["tree_budgets"] = list(self.config.tree_budgets)
        cfg["lookups"] = list(self.config.lookups)
        return {
            "schema": SCHEMA,
            "run_id": run_id,
            "created": self.created,
            "environment": self.environment,
            "config": cfg,
            "dataset": {**self.dataset, "prompt_ids": list(self.prompt_ids), "prompt_tokens": list(self.prompt_tokens)},
            "methods": [m.to_json(self.prompt_ids, with_tokens) for m in self.methods],
            "warnings": [asdict(w) for w in self.warnings],
        }
