"""A drafter folder read and written: config.json + safetensors shards (the published z-lab
layout, no remote code), the reduced vocabulary's ids and the corpus table beside them.

Loading checks what it reads against the config (missing or unexpected weights, shapes, token ids
outside the vocabulary) and names the file at fault (``ModelLoadError``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from runtime.engine.models.corpus import CORPUS_FILE, CorpusTable
from runtime.engine.models.drafter import DFlashDraftModel
from runtime.engine.models.drafter_config import copy_rows, read_draft_config
from runtime.engine.models.drafter_schema import read_weight_index
from runtime.errors import ModelLoadError


def _normalise_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    ignored = ("embed_tokens.weight", "lm_head.weight", "rotary_emb.inv_freq")
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        k = key
        for prefix in ("model.", "drafter.", "draft_model."):
            if k.startswith(prefix):
                k = k[len(prefix) :]
        if k.endswith(ignored):
            continue
        out[k] = value
    return out


def read_safetensors(
    folder: Path,
    origins: dict[str, Path] | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Read every safetensors shard of a folder (single file or index).

    Args:
        folder: the model folder.
        origins: filled with the shard each tensor came from, when given.
        device: where the tensors are created (safetensors reads them straight onto a GPU).
        dtype: floating tensors are converted to it as each is read (one tensor at a time in the
            file's dtype, never a whole shard); None keeps the file's dtypes.

    Raises:
        ModelLoadError: no weights, an index that is not valid (named), or a shard that is
            truncated or corrupt.
    """
    from safetensors import safe_open

    where = torch.device(device)
    if where.type == "cuda" and where.index is None:
        where = torch.device("cuda", torch.cuda.current_device())
    files = sorted(f for f in folder.glob("*.safetensors") if f.name != CORPUS_FILE)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = [folder / s for s in read_weight_index(index)]
    if not files:
        raise ModelLoadError(f"no .safetensors weights in {folder} (pickle weights are not loaded)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"missing weight shard {f}; re-download the model (dflash download)")
        try:
            shard: dict[str, torch.Tensor] = {}
            with safe_open(str(f), framework="pt", device=str(where)) as handle:
                for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    t = handle.get_tensor(key)
                    shard[key] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        except Exception as e:  # safetensors raises its own SafetensorError / OSError types
            raise ModelLoadError(
                f"cannot read {f}: truncated or corrupt safetensors ({e}); re-download the model"
            ) from e
        state.update(shard)
        if origins is not None:
            origins.update(dict.fromkeys(shard, f))
    return state


def check_vocab_ids(ids: torch.Tensor, vocab_size: int, where: str) -> torch.Tensor:
    """A draft vocabulary as loaded: 1-D integer ids in [0, vocab_size), returned as int64.

    Raises:
        ModelLoadError: naming ``where`` (the file and the field).
    """
    if ids.dtype in (torch.bool, torch.complex64, torch.complex128) or ids.is_floating_point():
        raise ModelLoadError(f"{where}: token ids must be integers, got {str(ids.dtype).replace('torch.', '')}")
    if ids.dim() != 1:
        raise ModelLoadError(f"{where}: must be a 1-D list of token ids, got shape {list(ids.shape)}")
    if ids.numel() == 0:
        raise ModelLoadError(f"{where}: holds no token ids")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ModelLoadError(f"{where}: token id {bad} is outside the vocabulary [0, {vocab_size})")
    return ids.to(torch.long)


def load_draft_model(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> DFlashDraftModel:
    """Load a drafter folder (config.json + safetensors) as published, without remote code.

    Args:
        path: local folder.
        device: target device.
        dtype: floating dtype for the weights.

    Returns:
        The drafter in eval mode.

    Raises:
        ModelLoadError: missing/corrupt files or weights that do not match the config.
    """
    folder = Path(path)
    device = torch.device(device)
    config = read_draft_config(folder)
    with torch.device("meta"):  # shapes only: no float32 weights built (or initialised) first
        model = DFlashDraftModel(config)
    origins: dict[str, Path] = {}
    state = _normalise_keys(read_safetensors(folder, origins, device, dtype))
    vocab_ids = state.pop("draft_vocab_ids", None)
    expected = {k for k in model.state_dict() if k != "draft_vocab_ids"}
    if config.dflash.copy_ngram is not None and "copy_bias" not in state:  # saved before it existed: no bias
        state["copy_bias"] = torch.zeros(copy_rows(config.dflash), dtype=dtype, device=device)
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if missing or unexpected:
        raise ModelLoadError(
            f"drafter weights in {folder} do not match its config: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    for k, v in model.state_dict().items():
        if k in state and state[k].shape != v.shape:
            raise ModelLoadError(
                f"drafter weight {k} has shape {tuple(state[k].shape)}, config implies {tuple(v.shape)}"
            )
    # read in the drafter's dtype on its device, each tensor becomes the parameter itself: one copy
    # of the weights, never a float32 one built on the CPU first
    model.load_state_dict(state, strict=False, assign=True)
    if vocab_ids is not None:
        source = next((f for k, f in origins.items() if k.endswith("draft_vocab_ids")), folder)
        ids = check_vocab_ids(vocab_ids, config.vocab_size, f"{source}: draft_vocab_ids")
        model.draft_vocab_ids = ids.to(device)
    elif config.dflash.draft_vocab_size:
        raise ModelLoadError(f"{folder}: config declares draft_vocab_size but the weights lack draft_vocab_ids")
    if config.dflash.copy_corpus is not None:
        try:
            model.corpus = CorpusTable.load(folder, config.dflash.copy_corpus, config.vocab_size)
        except FileNotFoundError:
            raise ModelLoadError(f"{folder}: config declares copy_corpus but the folder has no {CORPUS_FILE}") from None
        except ValueError as e:  # a table that does not fit (CorpusTable.load names the file and the field)
            raise ModelLoadError(str(e)) from None
        except Exception as e:  # safetensors raises its own SafetensorError / OSError types
            raise ModelLoadError(f"{folder}/{CORPUS_FILE} is unreadable: truncated or corrupt ({e})") from e
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # every parameter was checked present above: a new parameter the loader does not know
        raise ModelLoadError(f"drafter in {folder}: no weights loaded for {left[:4]}")
    return model.eval()


def save_draft_model(model: DFlashDraftModel, path: str | Path, extra_config: dict[str, Any] | None = None) -> None:
    """Save a drafter in the published layout (config.json + model.safetensors).

    Args:
        model: the drafter.
        path: output folder (created).
        extra_config: keys merged into config.json (e.g. training metadata).
    """
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(model.config.raw)
    dconf = dict(cfg.get("dflash_config") or {})
    dconf.update(
        mask_token_id=model.dflash.mask_token_id,
        target_layer_ids=list(model.dflash.target_layer_ids),
    )
    if model.dflash.copy_ngram is not None:
        dconf["copy_ngram"] = list(model.dflash.copy_ngram)
    else:
        dconf.pop("copy_ngram", None)
    if model.dflash.copy_corpus is not None:
        if model.corpus is None:
            raise ValueError("the drafter declares copy_corpus but has no corpus table to save")
        dconf["copy_corpus"] = list(model.dflash.copy_corpus)
        model.corpus.save(folder)
    else:
        dconf.pop("copy_corpus", None)
        (folder / CORPUS_FILE).unlink(missing_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k != "draft_vocab_ids"}
    if model.draft_vocab_ids is not None:
        state["draft_vocab_ids"] = model.draft_vocab_ids.detach().cpu().to(torch.long).contiguous()
        dconf["draft_vocab_size"] = int(model.draft_vocab_ids.numel())
    else:
        dconf.pop("draft_vocab_size", None)
    cfg["block_size"] = model.dflash.block_size
    if "block_size" in dconf:
        dconf["block_size"] = model.dflash.block_size
    for key in ("mask_token_id", "target_layer_ids", "draft_vocab_size"):
        if key in cfg:  # a top-level copy (older layout) follows dflash_config: the two must agree
            if key in dconf:
                cfg[key] = dconf[key]
            else:
                cfg.pop(key)
    cfg["dflash_config"] = dconf
    cfg.setdefault("architectures", ["DFlashDraftModel"])
    if extra_config:
        cfg.update(extra_config)
    tmp = folder / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
