"""Every `dflash train` option as typed (``TrainOptions``) and the parsers of its text values.

A bad value raises ``OptionError``, which the CLI shows as a usage error (exit 2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import ConfigError


class OptionError(ConfigError):
    """An option of `dflash train` has a bad value, or options that cannot go together were given."""


@dataclass(frozen=True)
class TrainOptions:
    """The options of one `dflash train` invocation, as given (see ``dflash train --help``).

    Attributes:
        argv: the command line (``OUT/commands.txt`` and the model card quote it).
        typed: the names of the options given on the command line: a resumed run keeps its own
            settings except these.
    """

    out: Path
    model: str | None = None
    target: str | None = None
    data: Path | None = None
    extra_data: tuple[Path, ...] = ()
    corpus_data: tuple[Path, ...] = ()
    prompts: int | None = None
    prompts_from: Path | None = None
    text_from: tuple[str, ...] = ()
    fim_from: tuple[str, ...] = ()
    self_instruct: bool = False
    file_requests: bool = False
    answer_tokens: int = 320
    gen_batch: int = 32
    data_seed: int = 0
    layers: int | None = None
    block_size: int = 8
    taps: str | None = None
    intermediate_size: int | None = None
    draft_vocab: str = "auto"
    max_oov: float = 0.01
    distill: str = "hard"
    soft_weight: float = 0.5
    topk: int = 8
    init: str = "random"
    from_drafter: str | None = None
    copy_inputs: bool = False
    copy_ngram: str | None = None
    copy_corpus: str | None = None
    eval_every: int = 200
    ood_eval: bool = True
    steps: int | None = None
    time_budget: str | None = None
    lr: float = 1e-3
    copy_lr: float | None = None
    anchors: int = 48
    anchor_sampling: str = "uniform"
    seqs_per_step: int = 2
    max_len: int = 640
    precision: str = "auto"
    resume: bool = False
    extend: bool = False
    data_only: bool = False
    eval_only: bool = False
    eval_prompts: int = 8
    eval_tokens: int = 96
    no_eval: bool = False
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    offline: bool = False
    argv: tuple[str, ...] = ()
    typed: frozenset[str] = frozenset()


def duration(text: str | None) -> float | None:
    """'90s', '45m', '2h', '1h30m' or plain seconds -> seconds."""
    if text is None:
        return None
    total, rest = 0.0, text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", rest):
        return float(rest)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", rest)
    if not parts or "".join(n + u for n, u in parts) != rest.replace(" ", ""):
        raise OptionError(f"expected a duration like 90s, 45m, 2h or 1h30m, got {text!r}")
    for n, unit in parts:
        total += float(n) * {"h": 3600, "m": 60, "s": 1}[unit]
    return total


def draft_vocab(text: str) -> int | str:
    """--draft-vocab: auto, full (or 0) or a size."""
    t = text.strip().lower()
    if t in ("auto", "full"):
        return t if t == "auto" else 0
    if t.isdigit():
        return int(t)
    raise OptionError(f"--draft-vocab must be auto, full or a number of ids, got {text!r}")


def ngram_sizes(text: str, flag: str = "--copy-ngram") -> tuple[int, int]:
    """``--copy-ngram`` / ``--copy-corpus`` "SHORTEST,LONGEST" -> (shortest, longest), 1 <= shortest <= longest <= 16."""
    parts = text.split(",")
    try:
        lo, hi = (int(p) for p in parts)
    except ValueError:
        raise OptionError(f"{flag} takes SHORTEST,LONGEST like 1,4, got {text!r}") from None
    if not 1 <= lo <= hi <= 16:
        raise OptionError(f"{flag} needs 1 <= shortest <= longest <= 16, got {text!r}")
    return lo, hi


def layer_ids(text: str) -> tuple[int, ...]:
    """--taps ``1,6,11`` (or space separated) -> the layer ids."""
    parts = [p for p in text.replace(",", " ").split() if p]
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise OptionError(f"expected comma-separated token ids, got {text!r}") from None
    if not ids or any(i < 0 for i in ids):
        raise OptionError(f"expected non-negative token ids, got {text!r}")
    return tuple(ids)
