"""Pitfalls of a bench run: the known ways a result misleads, each reported with its fix.

Pure functions over measured results and a drafter's config.json (training metadata:
``training.max_len``, ``training.dtype``, ``training.thinking``, at top level or inside
``dflash_config``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BenchWarning:
    """A pitfall found in a run, with its fix."""

    code: str
    message: str
    fix: str


def drafter_training(raw: dict[str, Any]) -> dict[str, Any]:
    """Training metadata a drafter config may carry (``training`` or inside ``dflash_config``)."""
    info = dict(raw.get("dflash_config", {}).get("training") or {})
    info.update(raw.get("training") or {})
    return info


def drafter_training_length(raw: dict[str, Any]) -> int | None:
    """Sequence length the drafter was trained on, when its config records it.

    Looks at ``training.max_len`` (also ``max_length``/``seq_len``, at top level or inside
    ``dflash_config``); published configs do not record it (None).
    """
    info = drafter_training(raw)
    for key in ("max_len", "max_length", "seq_len", "max_seq_len"):
        if info.get(key):
            return int(info[key])
    return None


def drafter_dtype(raw: dict[str, Any]) -> str | None:
    """Dtype of the target features the drafter was trained on (``training.dtype``, else the
    checkpoint's ``torch_dtype``/``dtype``)."""
    info = drafter_training(raw)
    value = info.get("dtype") or raw.get("torch_dtype") or raw.get("dtype")
    return str(value) if value else None


def find_pitfalls(
    results: Sequence[Any],
    *,
    drafter_name: str | None = None,
    thinking: bool = False,
    drafter_thinking: bool = False,
    quantized: str | None = None,
    drafter_dtype_name: str | None = None,
    longest_context: int = 0,
    drafter_train_length: int | None = None,
) -> list[BenchWarning]:
    """The known ways a bench result misleads, each with its fix.

    Args:
        results: the rows (``ar`` included).
        drafter_name: the DFlash drafter (None: no DFlash row).
        thinking: the chat template's thinking mode was on.
        drafter_thinking: the drafter was trained on thinking-mode answers.
        quantized: the target's quantization scheme (None: not quantized).
        drafter_dtype_name: dtype of the features the drafter was trained on.
        longest_context: the longest prompt + new tokens of the run.
        drafter_train_length: the drafter's training sequence length (None: unknown).
    """
    out: list[BenchWarning] = []
    fixes = {
        "dflash-b": (
            "a long verify block costs more than it saves at this acceptance: leave --block-size out so the runtime "
            "picks the verify length for the device, or sweep smaller blocks (--block-size 2,3,4)"
        ),
        "dflash": (
            "the drafter's acceptance is too low to pay for drafting on this device: train it longer (`dflash train`), "
            "or decode plainly here (dflash run --decoder ar)"
        ),
        "pld": "prompt lookup only pays when the answer repeats the prompt (edits, refactors); for new code use dflash",
        "assisted": "the assistant is too slow or too often wrong for this target: pick a smaller assistant or dflash",
    }
    for m in results:
        key = "dflash-b" if m.name.startswith("dflash-b") else m.method
        if key in fixes and m.speedup is not None and m.speedup < 1.0:
            tau = f", tau {m.tau:.2f}" if m.tau is not None else ""
            out.append(
                BenchWarning(
                    "slower-than-ar",
                    f"{m.label} is slower than plain decoding ({m.speedup:.2f}x{tau})",
                    fixes[key],
                )
            )
    has_dflash = drafter_name is not None and any(m.method == "dflash" for m in results)
    if has_dflash and thinking and not drafter_thinking:
        out.append(
            BenchWarning(
                "thinking-mode",
                f"thinking mode is on but drafter {drafter_name} was trained on answers without thinking, "
                "so acceptance drops on the reasoning text",
                "drop --thinking (published DFlash results are with thinking off) or use a drafter trained with it",
            )
        )
    if has_dflash and quantized:
        dt = drafter_dtype_name or "bfloat16"
        if dt in ("bfloat16", "float16", "float32"):
            out.append(
                BenchWarning(
                    "quantized-target",
                    f"the target is quantized ({quantized}) but drafter {drafter_name} was trained on {dt} features "
                    "of the unquantized target; its inputs shift and acceptance can drop",
                    "compare with the unquantized target (run without --quantize), or fine-tune the drafter on the "
                    "quantized target with `dflash train`",
                )
            )
    if has_dflash and drafter_train_length and longest_context > drafter_train_length:
        out.append(
            BenchWarning(
                "context-beyond-training",
                f"prompts run to {longest_context} tokens, beyond the {drafter_train_length} tokens drafter "
                f"{drafter_name} was trained on; acceptance falls off past that",
                "use shorter prompts or fewer --max-tokens, or a drafter trained on longer sequences",
            )
        )
    return out
