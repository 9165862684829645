"""What ``dflash bench --dataset fim`` runs and returns: ``FimConfig`` (its settings) and
``FimBenchResult`` (per case, per engine, the cold and warm ``Run``; ``to_json``). ``runtime.bench.fim``
fills them; ``runtime.bench.fim_table`` renders them."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.bench.fim_cases import DEFAULT_MAX_TOKENS, FIM_FILE, FimCase
from runtime.bench.fim_requests import Run
from runtime.config import DecodeOptions
from runtime.errors import ConfigError


def _median(xs: Sequence[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


@dataclass(frozen=True)
class FimConfig:
    """What ``run_fim_bench`` runs.

    Attributes:
        max_new_tokens: new tokens per request (N).
        warmup: untimed runs of each local decoder on the first case before the timed ones.
        dflash: DFlash's decoding options (block size, verify length, tree, lookup, confidence cut);
            the bench sets ``decoder`` and ``cache_prompt`` itself.
    """

    max_new_tokens: int = DEFAULT_MAX_TOKENS
    warmup: int = 1
    dflash: DecodeOptions = field(default_factory=DecodeOptions)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-tokens must be >= 1, got {self.max_new_tokens}")
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {self.warmup}")


@dataclass
class EngineRun:
    """One engine on one case: the cold request, the warm one and the equality with plain decoding."""

    cold: Run
    warm: Run | None = None
    same_as_ar: bool | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return {
            "cold": self.cold.to_json(),
            "warm": None if self.warm is None else self.warm.to_json(),
            "same_as_ar": self.same_as_ar,
        }


@dataclass
class CaseResult:
    """Every engine on one case."""

    case: FimCase
    engines: dict[str, EngineRun]

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form."""
        c = self.case
        return {
            "id": c.id,
            "language": c.language,
            "filename": c.filename,
            "cut": c.cut,
            "engines": {name: e.to_json() for name, e in self.engines.items()},
        }


@dataclass
class FimBenchResult:
    """A FIM bench run: the cases, per engine, and where it ran."""

    config: FimConfig
    cases: list[CaseResult]
    engines: list[str]
    environment: dict[str, Any] | None = None
    servers: dict[str, str] = field(default_factory=dict)
    dtype: str | None = None

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per engine: medians over the cases, and how many cases equalled plain decoding."""
        out: dict[str, dict[str, Any]] = {}
        for name in self.engines:
            runs = [c.engines[name] for c in self.cases if name in c.engines]
            warm = [r.warm for r in runs if r.warm is not None]
            same = [r.same_as_ar for r in runs if r.same_as_ar is not None]
            out[name] = {
                "cases": len(runs),
                "prompt_tokens": _median([r.cold.prompt_tokens for r in runs]),
                "generated_tokens": _median([r.cold.generated for r in runs]),
                "tau": _median([r.cold.tau for r in runs if r.cold.tau is not None]),
                "decode_tokens_per_second": _median([r.cold.decode_tps for r in runs]),
                "ttft_seconds": _median([r.cold.ttft_s for r in runs if r.cold.ttft_s is not None]),
                "first_line_seconds": _median([r.cold.first_line_s for r in runs if r.cold.first_line_s is not None]),
                "lines_completed": sum(r.cold.first_line_s is not None for r in runs),
                "warm_cached_share": _median([w.cached_share for w in warm]),
                "warm_ttft_seconds": _median([w.ttft_s for w in warm if w.ttft_s is not None]),
                "warm_first_line_seconds": _median([w.first_line_s for w in warm if w.first_line_s is not None]),
                "same_as_ar": sum(same) if same else None,
                "compared": len(same),
            }
        return out

    def to_json(self) -> dict[str, Any]:
        """The document ``dflash bench --dataset fim`` prints (``--format json``)."""
        return {
            "kind": "fim",
            "dataset": {"name": "fim", "source": str(FIM_FILE.name), "count": len(self.cases)},
            "config": {
                "max_new_tokens": self.config.max_new_tokens,
                "warmup": self.config.warmup,
                "temperature": 0.0,
                "dflash": _opts_json(self.config.dflash),
                "warm_edit": "prefix + middle[:1] (one character typed at the cursor)",
            },
            "dtype": self.dtype,
            "environment": self.environment,
            "servers": dict(self.servers),
            "engines": list(self.engines),
            "cases": [c.to_json() for c in self.cases],
            "summary": self.summary(),
        }


def _opts_json(o: DecodeOptions) -> dict[str, Any]:
    return {
        "block_size": o.block_size,
        "verify_length": o.verify_length,
        "tree_budget": o.tree_budget,
        "lookup": o.lookup,
        "confidence_cut": o.confidence_cut,
    }
