"""Which configuration decodes fastest on this machine, measured (``dflash doctor --speed``).

For each weight precision (unquantized, then the torchao weight-only schemes that run here) the
pair is loaded, its verify costs are measured, and one short chat prompt is decoded greedily with
plain decoding and with DFlash (after a warm-up). Every configuration is lossless with respect to
its own target; quantized ones change the target itself, which the result says. The result is
kept in a JSON file keyed by the pair, device, dtype, threads and torch version, so ``doctor``
can show it later without measuring again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.config import DecodeOptions, SamplingParams
from runtime.engine.events import Finished
from runtime.errors import DFlashError

PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring."


@dataclass(frozen=True)
class ProbeRow:
    """One measured configuration: decode tok/s (prompt excluded) and tokens per verify step."""

    quantize: str  # "none" or a scheme name
    decoder: str  # "ar" or "dflash"
    tok_s: float
    tau: float
    verify_length: int

    @property
    def flags(self) -> str:
        """The command-line flags that select this configuration."""
        parts = [] if self.quantize == "none" else [f"--quantize {self.quantize}"]
        if self.decoder == "ar":
            parts.append("--decoder ar")
        return " ".join(parts) or "(defaults)"


@dataclass(frozen=True)
class ProbeResult:
    """All rows of one probe, fastest first, with when and where it ran."""

    key: str
    measured_at: float
    rows: tuple[ProbeRow, ...]

    @property
    def fastest(self) -> ProbeRow:
        """The row with the highest decode speed."""
        return self.rows[0]


def probe_key(target_name: str, device: str, dtype: str) -> str:
    """Identity of a probe: pair, device, dtype, threads, torch version."""
    return "|".join([target_name, device, dtype, str(torch.get_num_threads()), torch.__version__])


def measure_speed(
    load: Callable[[str | None], Any],
    schemes: Sequence[str] = ("none", "int8", "int4"),
    max_tokens: int = 64,
    progress: Callable[[str], None] | None = None,
    calibrate: Callable[[Any], None] | None = None,
    too_slow: float = 4.0,
) -> ProbeResult:
    """Decode one prompt with every configuration and rank them.

    Args:
        load: loads the pair with a quantization scheme (None: unquantized) and returns a
            ``Pipeline`` (its verify costs measured, or measured by ``calibrate``).
        schemes: precisions to try; a scheme that cannot run here is skipped.
        max_tokens: new tokens per run.
        progress: one-line status callback.
        calibrate: measures a loaded pipeline's verify costs, after the quick check below.
        too_slow: a scheme whose first few plain tokens decode this many times slower than the
            fastest scheme so far is skipped (e.g. torchao's int4 CPU kernel on AVX2 CPUs: seconds
            per token), before its verify costs are measured.

    Returns:
        The ranked rows.
    """
    rows: list[ProbeRow] = []
    params = SamplingParams(max_new_tokens=max_tokens)
    key = ""
    for scheme in schemes:
        if progress:
            progress(f"measuring {'unquantized' if scheme == 'none' else scheme} weights")
        try:
            pipe = load(None if scheme == "none" else scheme)
        except DFlashError as e:
            if progress:
                progress(f"skipping {scheme}: {e}")
            continue
        d = pipe.describe()
        key = key or probe_key(d["target"], d["device"], d["dtype"])
        ids = pipe.encode(PROMPT)
        quick = _plain_speed(pipe, ids, 4)
        best = max((r.tok_s for r in rows if r.decoder == "ar"), default=0.0)
        if best and quick * too_slow < best:
            if progress:
                progress(f"skipping {scheme}: plain decoding runs {quick:.2f} tok/s here, {best / quick:.0f}x slower")
            del pipe
            continue
        if calibrate is not None:
            calibrate(pipe)
        decoders = ("ar", "dflash") if pipe.drafter is not None else ("ar",)
        for decoder in decoders:
            opts = DecodeOptions(decoder=decoder)
            stats = None
            for _ in range(2):  # the first run warms up
                for ev in pipe.stream(ids, params, opts):
                    if isinstance(ev, Finished):
                        stats = ev.stats
            assert stats is not None
            rows.append(ProbeRow(scheme, decoder, stats.decode_tokens_per_second, stats.tau, stats.verify_length))
        del pipe
    rows.sort(key=lambda r: r.tok_s, reverse=True)
    return ProbeResult(key, time.time(), tuple(rows))


def _plain_speed(pipe: Any, ids: list[int], tokens: int) -> float:
    """Decode tok/s of a few plain greedy tokens (a quick look before anything is measured)."""
    stats = None
    for ev in pipe.stream(ids, SamplingParams(max_new_tokens=tokens, ignore_eos=True), DecodeOptions(decoder="ar")):
        if isinstance(ev, Finished):
            stats = ev.stats
    return float(stats.decode_tokens_per_second) if stats is not None else 0.0


def save_result(result: ProbeResult, path: Path) -> None:
    """Store a probe under its key (best effort: an unwritable folder only loses the memory)."""
    data: dict[str, Any] = {}
    try:
        if path.exists():
            data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        data = {}
    data[result.key] = {"measured_at": result.measured_at, "rows": [asdict(r) for r in result.rows]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(path)
    except OSError:
        pass


def load_result(path: Path, key: str) -> ProbeResult | None:
    """A stored probe for ``key``, or None."""
    try:
        entry = json.loads(path.read_text())[key]
        rows = tuple(ProbeRow(**r) for r in entry["rows"])
        return ProbeResult(key, float(entry["measured_at"]), rows) if rows else None
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return None


def describe(result: ProbeResult) -> str:
    """One line: the fastest configuration and the others' speeds."""
    best = result.fastest
    others = ", ".join(
        f"{'bf16' if r.quantize == 'none' else r.quantize} {r.decoder} {r.tok_s:.1f}" for r in result.rows[1:]
    )
    what = f"{'unquantized' if best.quantize == 'none' else best.quantize} {best.decoder}"
    return f"fastest here: {what} at {best.tok_s:.1f} tok/s ({best.flags}); others: {others or 'none'}"
