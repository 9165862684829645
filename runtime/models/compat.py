"""Pair compatibility: is this drafter made for this target?

Checked from the two config files before any weights are loaded, so a wrong pair fails in
milliseconds with a message that says what differs and how to fix it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.engine.models.drafter_config import DraftModelConfig
from runtime.errors import IncompatibleDraftError

FIX = "use the drafter trained for this target (`dflash models --presets`) or train one with `dflash train`"


@dataclass(frozen=True)
class PairProblem:
    """One incompatibility: what differs and how to fix it."""

    field: str
    message: str
    fix: str = FIX


def _text_config(cfg: Any) -> Any:
    getter = getattr(cfg, "get_text_config", None)
    return getter() if callable(getter) else cfg


def target_dims(target_config: Any) -> tuple[int, int, int]:
    """(hidden size, vocab size, decoder layers) of a transformers config."""
    c = _text_config(target_config)
    return int(c.hidden_size), int(c.vocab_size), int(c.num_hidden_layers)


def check_pair(target_config: Any, drafter: DraftModelConfig) -> list[PairProblem]:
    """List every way ``drafter`` does not fit the target described by ``target_config``."""
    hidden, vocab, layers = target_dims(target_config)
    d = drafter.dflash
    problems: list[PairProblem] = []
    if drafter.hidden_size != hidden:
        problems.append(
            PairProblem("hidden_size", f"drafter hidden size {drafter.hidden_size} != target hidden size {hidden}")
        )
    if drafter.vocab_size != vocab:
        problems.append(PairProblem("vocab_size", f"drafter vocab {drafter.vocab_size} != target vocab {vocab}"))
    bad = [i for i in d.target_layer_ids if i >= layers]
    if bad:
        problems.append(
            PairProblem("target_layer_ids", f"drafter taps target layers {bad} but the target has {layers} layers")
        )
    if drafter.num_target_layers > 0 and drafter.num_target_layers != layers and not bad:
        problems.append(
            PairProblem(
                "num_target_layers",
                f"drafter was trained on a {drafter.num_target_layers}-layer target, this target has {layers}",
            )
        )
    if d.mask_token_id >= vocab:
        problems.append(
            PairProblem(
                "mask_token_id",
                f"drafter mask id {d.mask_token_id} is outside the target vocab (size {vocab})",
            )
        )
    return problems


def ensure_compatible(target_config: Any, drafter: DraftModelConfig, target_name: str, drafter_name: str) -> None:
    """Raise ``IncompatibleDraftError`` with every problem on one line, or return.

    Raises:
        IncompatibleDraftError: the pair does not fit.
    """
    problems = check_pair(target_config, drafter)
    if problems:
        what = "; ".join(p.message for p in problems)
        raise IncompatibleDraftError(f"drafter {drafter_name} does not fit target {target_name}: {what}; {FIX}")
