"""Trainer state on disk without pickle: ``trainer/state.json`` + ``trainer/optimizer.safetensors``
in the checkpoint folder (a sub-folder: the checkpoint's own ``*.safetensors`` are the drafter's).

A run folder may come from anywhere, so nothing in it is unpickled: the optimiser's tensors go to
safetensors, everything else (counters, hyper-parameters, the RNG state, the optimiser's param
groups) to JSON. A ``trainer_state.pt`` from older runs is read with ``torch.load(weights_only=True)``
(tensors and plain types only); a file that needs more (a pickled object, code) is refused.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch

from runtime.errors import ModelLoadError

STATE_JSON = "trainer/state.json"
OPTIM_TENSORS = "trainer/optimizer.safetensors"
LEGACY_PICKLE = "trainer_state.pt"
FORMAT = "dflash.trainer_state/1"


def _plain(value: Any) -> Any:
    """Tuples as lists, recursively (JSON)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def save_trainer_state(
    folder: Path, optimizer: dict[str, Any], state: dict[str, Any], config: dict[str, Any], rng: Any
) -> None:
    """Write the trainer state of a checkpoint into ``folder``.

    Args:
        folder: the checkpoint folder (exists).
        optimizer: ``optimizer.state_dict()``.
        state: ``asdict(TrainState)``.
        config: ``asdict(TrainConfig)``.
        rng: ``random.Random.getstate()``.
    """
    from safetensors.torch import save_file

    (folder / STATE_JSON).parent.mkdir(exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, per_param in optimizer["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(idx), {})[name] = value
    save_file(tensors, str(folder / OPTIM_TENSORS))
    doc = {
        "format": FORMAT,
        "state": _plain(state),
        "config": _plain(config),
        "rng": _plain(rng),
        "optimizer": {"param_groups": _plain(optimizer["param_groups"]), "scalars": scalars},
    }
    (folder / STATE_JSON).write_text(json.dumps(doc))


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def load_trainer_state(folder: Path) -> dict[str, Any]:
    """Read a checkpoint's trainer state: ``{"optimizer", "state", "config", "rng"}``.

    Raises:
        ModelLoadError: no state, a damaged one, or a pickle file that holds more than tensors and
            plain types (it is never executed).
    """
    path = folder / STATE_JSON
    if path.exists():
        return _load_json_state(folder)
    legacy = folder / LEGACY_PICKLE
    if legacy.exists():
        return _load_legacy(legacy)
    raise ModelLoadError(f"{folder} has no trainer state ({STATE_JSON}); it is not a dflash train checkpoint")


def _load_json_state(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    path = folder / STATE_JSON
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        tensors = load_file(str(folder / OPTIM_TENSORS))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"cannot read the trainer state in {folder}: {e}") from None
    except Exception as e:  # safetensors' own errors
        raise ModelLoadError(f"cannot read {folder / OPTIM_TENSORS}: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ModelLoadError(f"{path} is not a trainer state written by this dflash (format {FORMAT})")
    per_param: dict[int, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        idx, _, name = key.partition(".")
        per_param.setdefault(int(idx), {})[name] = tensor
    for idx, values in doc["optimizer"].get("scalars", {}).items():
        per_param.setdefault(int(idx), {}).update(values)
    groups = []
    for group in doc["optimizer"]["param_groups"]:
        g = dict(group)
        if "betas" in g:
            g["betas"] = _tuples(g["betas"])
        groups.append(g)
    rng = doc["rng"]
    rng = (rng[0], tuple(rng[1]), rng[2])  # random.Random.setstate wants tuples
    return {
        "optimizer": {"state": per_param, "param_groups": groups},
        "state": doc["state"],
        "config": doc["config"],
        "rng": rng,
    }


def _load_legacy(path: Path) -> dict[str, Any]:
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError, ValueError, EOFError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelLoadError(
            f"{path} holds pickled objects that dflash does not load (pickle can run code): {first[:200]}; "
            "delete it if you do not trust it, or retrain"
        ) from None
    if not isinstance(blob, dict) or not {"optimizer", "state", "config", "rng"} <= set(blob):
        raise ModelLoadError(f"{path} is not a dflash train checkpoint state")
    return blob


def read_checkpoint_config(folder: Path) -> dict[str, Any]:
    """The drafter config of a checkpoint folder (``config.json``), checked before a run resumes it.

    Raises:
        ModelLoadError: the file is missing, unreadable, not JSON (e.g. cut off), not an object, or
            has no ``dflash_config.target_layer_ids`` list of layer ids; the message names the file.
    """
    path = Path(folder) / "config.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path} is missing: the checkpoint is incomplete") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(f"{path} is damaged (not readable JSON: {e}); the checkpoint was left as it is") from None
    conf = doc.get("dflash_config") if isinstance(doc, dict) else None
    taps = conf.get("target_layer_ids") if isinstance(conf, dict) else None
    if not isinstance(taps, list) or not taps or not all(type(t) is int and t >= 0 for t in taps):
        raise ModelLoadError(
            f"{path} is damaged: no dflash_config.target_layer_ids list of layer ids; the checkpoint was left as it is"
        )
    return dict(doc)
