"""Which bf16 GEMM a CPU runs, chosen by measurement (issue 45).

On a CPU, bf16 weights can run on several paths: dflash's own kernel with float32 activations
(``bf16_gemm``, AVX2 + FMA), dflash's AVX-512-BF16 kernel (``bf16dp_gemm``: ``vdpbf16ps``, the
activations rounded per row to bf16) where the CPU has it, its AMX kernel (``bf16amx_gemm``:
``tdpbf16ps`` tiles, the same rounding) where AMX runs, and oneDNN's packed GEMM with bf16
activations where oneDNN has native bf16. Which one is fastest depends on the machine (an ISA flag
does not tell: on a 2-core AVX-512-BF16 EPYC oneDNN's one-token step ran at 0.60x llama.cpp's), and
only some of them compute a verify row exactly as a one-token row (oneDNN's batched rows do not),
which greedy DFlash needs to equal plain greedy decoding.

So at first use on a machine, for a target's own weight shapes, every candidate is timed for a
one-token step and an ``VERIFY_ROWS``-row verify (the GEMMs of a step, on the target's real weights:
a sample of its layers scaled to all of them, and its output head), and checked: a row computed in
a ``VERIFY_ROWS``-row call must equal (``torch.equal``) the same row computed alone, on every weight
shape. ``pick`` takes the fastest (one-token + verify time) of the candidates that pass; one that
fails is never chosen. The result is cached in ``kernel-choice.json`` beside the verify-cost
calibration (``$DFLASH_HOME``; see ``choice_file``), keyed by the CPU, the thread count, torch's
version, the kernels' source and the weight shapes, and read through one schema
(``read_choices``): a file that does not fit it is ignored with one line on stderr and replaced.
``dflash doctor`` shows the choice and the times.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

# The candidate paths, by name (what each computes).
PATHS = {
    "dflash-avx2": "dflash's bf16 kernel, float32 activations (AVX2 + FMA)",
    "dflash-avx512bf16": "dflash's bf16 kernel, bf16 activations (AVX-512-BF16 vdpbf16ps)",
    "dflash-amx": "dflash's bf16 kernel, bf16 activations (AMX tdpbf16ps tiles)",
    "onednn-bf16": "oneDNN's packed GEMM, bf16 activations",
}
VERIFY_ROWS = 8  # rows of the verify timed and checked (a typical DFlash block)
REPS = 3  # timed rounds per candidate (after a warm-up round); the least time of each GEMM is kept

Gemm = Callable[[torch.Tensor], object]


@dataclass(frozen=True)
class Timing:
    """One candidate on one target: seconds per step's GEMMs for one row and a verify, and whether
    a verify row equals the row computed alone (on every weight shape)."""

    one_token_s: float
    verify_s: float
    row_independent: bool


@dataclass(frozen=True)
class Choice:
    """The chosen path (None: no candidate computes verify rows as one-token rows) and every
    candidate's timing."""

    chosen: str | None
    timings: dict[str, Timing]
    shapes: str = ""
    measured_at: float = field(default_factory=time.time)


@dataclass
class Candidate:
    """One path's GEMMs over a target's sampled weights.

    Attributes:
        gemms: (GEMM, in_features, how many such GEMMs a step runs per one timed), in step order.
        dtype: the activations it takes.
        check: whether a row computed in a ``VERIFY_ROWS``-row call equals the row computed alone
            (its GEMMs on every weight shape, and a step through whatever runs between them).
    """

    gemms: Sequence[tuple[Gemm, int, float]]
    dtype: torch.dtype
    check: Callable[[], bool]


def pick(timings: Mapping[str, Timing]) -> str | None:
    """The fastest candidate (least one-token + verify time: a plain step costs the first, a DFlash
    step the second) among those whose verify rows equal one-token rows; None when none does."""
    ok = {name: t for name, t in timings.items() if t.row_independent and math.isfinite(t.one_token_s + t.verify_s)}
    if not ok:
        return None
    return min(ok, key=lambda name: (ok[name].one_token_s + ok[name].verify_s, name))


def row_independent(gemm: Gemm, k: int, dtype: torch.dtype, rows: int = VERIFY_ROWS, seed: int = 0) -> bool:
    """Whether every row of a ``rows``-row call of ``gemm`` equals (bit for bit) the row computed alone."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    block = _out(gemm(x))
    return all(torch.equal(block[i : i + 1], _out(gemm(x[i : i + 1]))) for i in range(rows))


def _out(y: object) -> torch.Tensor:
    """A GEMM's output (a tensor, or a tuple of the split outputs of a fused projection) as one tensor."""
    if isinstance(y, torch.Tensor):
        return y
    assert isinstance(y, tuple | list)
    return torch.cat([t for t in y if isinstance(t, torch.Tensor)], dim=-1)


@torch.inference_mode()
def measure(candidates: Mapping[str, Candidate], rows: int = VERIFY_ROWS, reps: int = REPS) -> dict[str, Timing]:
    """Time every candidate's step GEMMs at 1 and ``rows`` rows, in interleaved rounds (a busy spell
    hits one round of every candidate, not every round of one), the least time of each GEMM kept,
    and check its rows (``row_independent``)."""
    g = torch.Generator().manual_seed(1)
    inputs = {
        name: [(torch.randn(1, k, generator=g), torch.randn(rows, k, generator=g)) for _, k, _ in c.gemms]
        for name, c in candidates.items()
    }
    inputs = {
        name: [(one.to(candidates[name].dtype), block.to(candidates[name].dtype)) for one, block in xs]
        for name, xs in inputs.items()
    }
    best = {name: [[math.inf, math.inf] for _ in c.gemms] for name, c in candidates.items()}
    for _ in range(reps + 1):  # the first round warms up (and is kept only where it is the least)
        for name, c in candidates.items():
            for i, (fn, _, _) in enumerate(c.gemms):
                for j, x in enumerate(inputs[name][i]):
                    t0 = time.perf_counter()
                    fn(x)
                    best[name][i][j] = min(best[name][i][j], time.perf_counter() - t0)
    out = {}
    for name, c in candidates.items():
        one = sum(b[0] * weight for b, (_, _, weight) in zip(best[name], c.gemms, strict=True))
        verify = sum(b[1] * weight for b, (_, _, weight) in zip(best[name], c.gemms, strict=True))
        out[name] = Timing(one, verify, c.check())
    return out


def choice_file() -> Path:
    """Where choices are kept: beside the verify-cost calibration (``$DFLASH_HOME`` for the CLI,
    whose compiled kernels live in ``$DFLASH_HOME/kernels``)."""
    from runtime.engine.models import kernels

    return kernels.cache_dir().parent / "kernel-choice.json"


_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")


def machine_key() -> str:
    """This machine as a choice sees it: CPU model and the flags that matter, threads, torch's
    version and the native kernels' source (a kernel change measures again). Nothing is built or
    loaded to say it."""
    from runtime.engine.models import kernels

    model, flags = "?", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "?":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    have = ",".join(f for f in _CPU_FLAGS if f in flags)
    parts = [model, have, f"{torch.get_num_threads()}t", torch.__version__, f"kernels-{kernels.source_key()}"]
    return "|".join(parts)


class _StoredTiming(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    one_token_s: float = Field(gt=0)
    verify_s: float = Field(gt=0)
    row_independent: bool


class _StoredChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    chosen: str | None
    timings: dict[str, _StoredTiming]
    shapes: str = ""
    measured_at: float = 0.0


_CHOICE_FILE: TypeAdapter[dict[str, _StoredChoice]] = TypeAdapter(dict[str, _StoredChoice])


def read_choices(path: Path) -> tuple[dict[str, Choice], str | None]:
    """The choices stored in ``path`` by key, read through one schema (an object of ``{"chosen":
    name or null, "timings": {name: {"one_token_s": seconds, "verify_s": seconds, "row_independent":
    bool}}, "shapes": text, "measured_at": time}``).

    Returns:
        (choices, None), or ({}, why the file was ignored) where it is not such a file (not JSON,
        another shape, a folder, a chosen path without a timing or whose rows differ); no file at
        all is ({}, None).
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}, None
    except IsADirectoryError:
        return {}, "a folder, not a file"
    except OSError as e:
        return {}, f"unreadable: {e.strerror}"
    try:
        entries = _CHOICE_FILE.validate_json(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        return {}, f"{where + ': ' if where else ''}{err['msg'].lower()}"
    out = {}
    for key, c in entries.items():
        chosen = c.timings.get(c.chosen) if c.chosen is not None else None
        if c.chosen is not None and (chosen is None or not chosen.row_independent):
            return {}, f"{key}: chosen {c.chosen!r} is not a measured path whose rows match"
        timings = {n: Timing(t.one_token_s, t.verify_s, t.row_independent) for n, t in c.timings.items()}
        out[key] = Choice(c.chosen, timings, c.shapes, c.measured_at)
    return out, None


def store_choices(path: Path, choices: Mapping[str, Choice]) -> None:
    """Write ``choices`` to ``path`` atomically. The file is an optimisation: an unwritable home only
    means measuring again next time."""
    data = {
        key: {
            "chosen": c.chosen,
            "timings": {n: t.__dict__ for n, t in c.timings.items()},
            "shapes": c.shapes,
            "measured_at": c.measured_at,
        }
        for key, c in choices.items()
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(path)
    except OSError:
        pass


def cached_choice(
    shapes: str,
    candidates: Sequence[str],
    build: Callable[[str], Candidate],
    path: Path | None = None,
    remeasure: bool = False,
) -> Choice:
    """The choice for weights of ``shapes`` on this machine among ``candidates`` (the paths that run
    here), from ``path`` (default ``choice_file()``) or measured now (``build(name)`` gives a path's
    GEMMs) and stored. A stored choice whose candidates differ from ``candidates`` is measured again."""
    path = path if path is not None else choice_file()
    key = f"{machine_key()}|{shapes}"
    stored, problem = read_choices(path)
    if problem is not None:
        print(f"dflash: ignoring {path} ({problem}); measuring the bf16 kernels again", file=sys.stderr)
    old = stored.get(key)
    if old is not None and not remeasure and sorted(old.timings) == sorted(candidates):
        return old
    built = {name: build(name) for name in candidates}
    timings = measure(built)
    del built
    choice = Choice(pick(timings), timings, shapes)
    stored[key] = choice
    store_choices(path, stored)
    return choice


def describe(choice: Choice) -> str:
    """One line: the chosen path and every candidate's times (one token / verify, milliseconds)."""

    def ms(t: Timing) -> str:
        rows = "" if t.row_independent else ", verify rows differ from one-token rows"
        return f"{t.one_token_s * 1e3:.2f} / {t.verify_s * 1e3:.2f} ms{rows}"

    order = sorted(choice.timings, key=lambda n: (n != choice.chosen, n))
    times = "; ".join(f"{n} {ms(choice.timings[n])}" for n in order)
    head = f"{choice.chosen} chosen by measurement" if choice.chosen else "no path keeps verify rows exact"
    return f"bf16 GEMM: {head} (one token / {VERIFY_ROWS}-row verify: {times})"
