"""Server commands of the engines that serve DFlash at scale: vLLM and SGLang.

dflash does not build a distributed engine: ``dflash serve --engine vllm|sglang`` writes the
engine's own command line with DFlash speculative decoding configured and runs it (or prints it).
Flags as documented by the engines, checked against the released packages:

vLLM 0.33.0 (vLLM's documentation: features/speculative_decoding/dflash.md, acceptance_metrics.md)
    vllm serve TARGET --speculative-config '{"method": "dflash", "model": DRAFTER,
    "num_speculative_tokens": K}' --tensor-parallel-size N --host H --port P
    K counts the drafted tokens: the query block is the anchor plus K masks, so K = block size - 1
    (15 for a -b16 drafter, as in z-lab's README). ``--per-request-spec-decode-metrics summary``
    puts acceptance statistics in each response (``metrics.speculative_decoding``).
SGLang 0.5.23 (server arguments: --speculative-algorithm DFLASH; z-lab's model cards)
    python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH
    --speculative-draft-model-path DRAFTER --speculative-num-draft-tokens B --tp-size N --host H --port P
    For DFLASH, --speculative-num-draft-tokens is the block size (alias --speculative-dflash-block-size);
    left out, SGLang reads it from the drafter's config.

Both take ``--default-chat-template-kwargs '{"enable_thinking": false}'``: Qwen3 drafters were
trained with thinking off.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from runtime import ConfigError
from runtime.models import presets

ENGINES = ("vllm", "sglang")
DEFAULT_PORTS = {"local": 8000, "vllm": 8000, "sglang": 30000}
VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23"}


@dataclass(frozen=True)
class EnginePlan:
    """What to serve and how.

    Attributes:
        engine: "vllm" or "sglang".
        target: target Hub id or folder.
        drafter: drafter Hub id or folder.
        block_size: drafter block size (anchor + drafts); None: unknown.
        draft_tokens: drafts verified per step (None: block_size - 1).
        tensor_parallel: GPUs per model replica.
        host, port: where the engine listens.
        thinking_off: ask the chat template for enable_thinking=False by default.
        served_name: model name clients use (None: the engine's default, the target id).
        extra: further arguments passed to the engine as they are.
    """

    engine: str
    target: str
    drafter: str
    block_size: int | None
    draft_tokens: int | None = None
    tensor_parallel: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    thinking_off: bool = False
    served_name: str | None = None
    extra: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"unknown engine {self.engine!r}; use local, vllm or sglang")
        if self.tensor_parallel < 1:
            raise ConfigError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel}")
        if self.block_size is not None and self.block_size < 2:
            raise ConfigError(f"--block-size must be >= 2 for speculative decoding, got {self.block_size}")
        if self.draft_tokens is not None and self.draft_tokens < 1:
            raise ConfigError(f"--draft-tokens must be >= 1, got {self.draft_tokens}")


def block_size_of(drafter: str, hf_cache_dir: Path | None = None) -> int | None:
    """The drafter's block size from its local config.json, the Hub cache, or a ``-bNN`` name."""
    cfg_path: Path | None = Path(drafter) / "config.json" if Path(drafter).is_dir() else None
    if cfg_path is None:
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(drafter, "config.json", cache_dir=hf_cache_dir)
            cfg_path = Path(found) if isinstance(found, str) else None
        except Exception:  # noqa: BLE001 - the cache is only a hint
            cfg_path = None
    if cfg_path is not None and cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text())
            size = cfg.get("block_size") or (cfg.get("dflash_config") or {}).get("block_size")
            if isinstance(size, int):
                return size
        except (OSError, ValueError):
            pass
    m = re.search(r"-b(\d+)(?:$|[-_/])", drafter)
    return int(m.group(1)) if m else None


def resolve_engine_pair(model: str | None, target: str | None, drafter: str | None) -> tuple[str, str, bool]:
    """(target, drafter, thinking) for an engine: Hub ids of a preset, or what the user named.

    Raises:
        ConfigError: the embedded pair, a missing drafter, or a drafter without a target.
        ModelNotFoundError: an unknown preset.
    """
    preset = presets.get_preset(model) if model else None
    if preset is None and not target:
        raise ConfigError("name the pair to serve: --model PRESET or --target ID --drafter ID")
    if preset is not None and preset.target == "embedded" and not target:
        raise ConfigError(
            f"the embedded pair ({presets.EMBEDDED}) runs on the local engine only; use --engine local, "
            "or name a preset such as qwen3-8b"
        )
    t = target or (preset.target if preset else None)
    d = drafter or (preset.drafter if preset else None)
    if preset is None and target:
        for p in presets.PRESETS.values():
            if p.target.lower() == target.lower():
                preset = p
                d = d or p.drafter
    if not d or d in ("none", "embedded"):
        raise ConfigError("vLLM and SGLang need a DFlash drafter: pass --drafter ID (Hub id or folder)")
    assert t is not None
    return t, d, bool(preset.thinking) if preset else False


def vllm_command(plan: EnginePlan) -> list[str]:
    """``vllm serve`` with DFlash speculative decoding."""
    k = plan.draft_tokens or (plan.block_size - 1 if plan.block_size else None)
    if k is None:
        raise ConfigError(
            f"cannot tell the block size of {plan.drafter} (not a local folder, not in the Hub cache); "
            "pass --block-size N (vLLM needs num_speculative_tokens = N - 1)"
        )
    spec = {"method": "dflash", "model": plan.drafter, "num_speculative_tokens": k}
    argv = ["vllm", "serve", plan.target, "--host", plan.host, "--port", str(plan.port)]
    argv += ["--tensor-parallel-size", str(plan.tensor_parallel)]
    argv += ["--speculative-config", json.dumps(spec)]
    argv += ["--per-request-spec-decode-metrics", "summary"]
    if plan.served_name:
        argv += ["--served-model-name", plan.served_name]
    if plan.thinking_off:
        argv += ["--default-chat-template-kwargs", json.dumps({"enable_thinking": False})]
    return argv + list(plan.extra)


def sglang_command(plan: EnginePlan, python: str = "python") -> list[str]:
    """``python -m sglang.launch_server`` with DFLASH speculative decoding."""
    argv = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        plan.target,
        "--host",
        plan.host,
        "--port",
        str(plan.port),
    ]
    argv += ["--tp-size", str(plan.tensor_parallel)]
    argv += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", plan.drafter]
    block = plan.draft_tokens + 1 if plan.draft_tokens else plan.block_size
    if block:
        argv += ["--speculative-num-draft-tokens", str(block)]
    if plan.served_name:
        argv += ["--served-model-name", plan.served_name]
    if plan.thinking_off:
        argv += ["--default-chat-template-kwargs", json.dumps({"enable_thinking": False})]
    return argv + list(plan.extra)


def command(plan: EnginePlan, python: str = "python") -> list[str]:
    """The engine's argv."""
    return vllm_command(plan) if plan.engine == "vllm" else sglang_command(plan, python)


def shell_line(argv: list[str]) -> str:
    """The argv as one copy-pasteable shell line."""
    return shlex.join(argv)


def installed_launcher(engine: str) -> str | None:
    """How to start the engine here: the ``vllm`` executable, or this Python when it has sglang."""
    if engine == "vllm":
        return shutil.which("vllm")
    if importlib.util.find_spec("sglang") is not None:
        return sys.executable
    return None
