"""The environment a bench run records: device, CPU/GPU name, dtype, library versions, and the
models with their revisions."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_revision(path: Path | None) -> str | None:
    """Revision of a model folder: the Hub commit of a cache snapshot, or the embedded GGUF's sha256."""
    if path is None:
        return None
    parts = Path(path).parts
    if "snapshots" in parts and parts.index("snapshots") + 1 < len(parts):
        return parts[parts.index("snapshots") + 1]
    marker = Path(path) / "dflash-embedded.json"
    if marker.exists():
        import json

        try:
            return "gguf-sha256:" + str(json.loads(marker.read_text()).get("gguf_sha256"))
        except (OSError, ValueError):
            return None
    return None


def environment(pipe: Any, assistant: Any | None = None, quantize: str | None = None) -> dict[str, Any]:
    """Device, dtype, library versions, CPU/GPU name, models with their revisions."""
    import torch
    import transformers

    from runtime.engine.models.device import device_description, dtype_name

    try:
        from importlib.metadata import version

        from runtime.config import DISTRIBUTION

        dflash_version = version(DISTRIBUTION)
    except Exception:
        dflash_version = None
    gpu = torch.cuda.get_device_name(pipe.device) if pipe.device.type == "cuda" else None
    pair = pipe.pair
    return {
        "device": str(pipe.device),
        "device_name": device_description(pipe.device),
        "cpu": _cpu_name(),
        "gpu": gpu,
        "dtype": dtype_name(pipe.dtype),
        "threads": torch.get_num_threads(),
        "quantize": quantize,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "dflash": dflash_version,
        "target": {"id": pair.target_name, "path": str(pair.target_dir), "revision": model_revision(pair.target_dir)},
        "drafter": None
        if pair.drafter_dir is None
        else {"id": pair.drafter_name, "path": str(pair.drafter_dir), "revision": model_revision(pair.drafter_dir)},
        "assistant": None
        if assistant is None
        else {"id": assistant.name, "path": str(assistant.path), "revision": model_revision(assistant.path)},
    }
