"""A run's datasets: build (or finish building) the training data and the OOD evaluation set,
report their size and mix, and open them as training / held-out sequences."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from runtime.engine.models.target import TargetModel
from runtime.errors import ConfigError
from runtime.train.data import Progress, dataset_summary, generate_dataset
from runtime.train.heldout import ood_prompts
from runtime.train.prompt_list import PROMPTS_FILE, TrainPrompt, read_prompts
from runtime.train.prompt_sources import stored_prompts
from runtime.train.shards import ShardDataset, dataset_meta, iter_shards
from runtime.train.specs import DataSpec
from runtime.train.text import build_text_dataset


def prepare_data(
    target: TargetModel,
    tokenizer: Any,
    data_dir: Path,
    taps: Sequence[int],
    spec: DataSpec,
    stop_ids: Sequence[int],
    progress: Progress | None = None,
) -> Path:
    """Generate (or finish generating) the dataset in ``data_dir``.

    Raises:
        ConfigError: an existing dataset was made with other taps than requested.
    """
    meta_path = data_dir / "dataset.json"
    if meta_path.exists():
        # An existing dataset keeps the settings it was made with (shard i answers prompts
        # i*B..(i+1)*B-1); only an explicit larger --prompts extends it with more shards.
        meta = json.loads(meta_path.read_text())
        missing = [t for t in taps if t not in meta["taps"]]
        if missing:
            raise ConfigError(f"{data_dir} holds features of layers {meta['taps']}, not {missing}; use another --data")
        taps = meta["taps"]
        spec = DataSpec(
            num_prompts=spec.num_prompts or meta.get("spec", {}).get("num_prompts") or meta.get("num_prompts"),
            max_new_tokens=meta.get("max_new_tokens", spec.max_new_tokens),
            batch_size=meta.get("spec", {}).get("batch_size", spec.batch_size),
            seed=meta.get("spec", {}).get("seed", spec.seed),
            taps=spec.taps,
            topk=int(meta.get("topk", 0)),  # a dataset keeps its labels' kind (datasets before v2 have none)
            generator=meta.get("spec", {}).get("generator", "v1"),
            source=Path(meta["spec"]["source"]) if meta.get("spec", {}).get("source") else None,
            text_roots=tuple(Path(p) for p in meta.get("spec", {}).get("text_roots", ())),
        )
    asked = None
    if spec.generator == "self" and meta_path.exists() and (data_dir / PROMPTS_FILE).exists():
        # the self generator keeps fewer requests than it is asked for (the cleaning drops some):
        # reopening the dataset (to train on it, or rerunning the command) keeps what it kept, and
        # only a --prompts above the number asked before samples more
        asked = int(meta.get("spec", {}).get("num_prompts") or 0)
        if (spec.num_prompts or asked) <= asked:
            spec = replace(spec, num_prompts=len(read_prompts(data_dir)))
        else:
            asked = spec.num_prompts
    prompts = stored_prompts(data_dir, spec, tokenizer, target=target.model, progress=progress)
    spec_meta = {
        "num_prompts": asked if asked is not None else spec.num_prompts,
        "batch_size": spec.batch_size,
        "seed": spec.seed,
        "generator": spec.generator,
        **({"source": str(spec.source)} if spec.source is not None else {}),
        **({"text_roots": [str(p) for p in spec.text_roots]} if spec.text_roots else {}),
    }
    if spec.generator == "text":
        build_text_dataset(
            target,
            tokenizer,
            prompts,
            data_dir,
            taps,
            batch_size=spec.batch_size,
            max_tokens=spec.max_new_tokens,
            topk=spec.topk or 8,
            progress=progress,
            extra_meta={"spec": spec_meta},
        )
        return data_dir
    if spec.generator == "fim":  # a middle ends at the family's end-of-middle tokens too
        from runtime.fim import require

        stop_ids = tuple(sorted(set(stop_ids) | set(require(tokenizer, "the target").stop_ids)))
    generate_dataset(
        target,
        tokenizer,
        prompts,
        data_dir,
        taps,
        batch_size=spec.batch_size,
        max_new_tokens=spec.max_new_tokens,
        stop_ids=stop_ids,
        progress=progress,
        extra_meta={"spec": spec_meta},
        topk=spec.topk,
    )
    return data_dir


def data_report(data_dir: Path) -> dict[str, Any]:
    """Size and mix of a dataset (``dataset_summary`` plus its generator settings)."""
    meta = dataset_meta(data_dir)
    report = dataset_summary(data_dir)
    report["generator"] = meta.get("spec", {}).get("generator", "v1")
    report["max_new_tokens"] = meta.get("max_new_tokens")
    report["labels"] = meta.get("labels", "generated")
    return report


def prepare_eval_data(
    target: TargetModel,
    tokenizer: Any,
    dest: Path,
    taps: Sequence[int],
    stop_ids: Sequence[int],
    prompts: Sequence[TrainPrompt] | None = None,
    max_new_tokens: int = 320,
    topk: int = 8,
) -> Path:
    """The target's answers (with features and top-k) to the OOD prompts, for teacher-forced
    held-out evaluation during and after training; built once (one shard per 16 prompts)."""
    meta_path = dest / "dataset.json"
    if meta_path.exists():
        missing = [t for t in taps if t not in json.loads(meta_path.read_text())["taps"]]
        if not missing:
            return dest
        shutil.rmtree(dest)
    generate_dataset(
        target,
        tokenizer,
        list(prompts) if prompts is not None else ood_prompts(),
        dest,
        taps,
        batch_size=16,
        max_new_tokens=max_new_tokens,
        max_prompt_tokens=min(2048, (target.max_positions or 1 << 30) - max_new_tokens),
        stop_ids=stop_ids,
        topk=topk,
    )
    return dest


def open_eval_set(data_dir: Path, use_taps: Sequence[int], hidden: int) -> ShardDataset:
    """Every shard of a dataset folder as one held-out set."""
    meta = dataset_meta(data_dir)
    return ShardDataset(list(iter_shards(data_dir)), meta["taps"], use_taps, hidden)


def open_datasets(
    data_dir: Path, use_taps: Sequence[int], hidden: int, val_shards: int = 1, extra: Sequence[Path] = ()
) -> tuple[ShardDataset, ShardDataset]:
    """Training and validation sequences: the last ``val_shards`` shards of ``data_dir`` and of each
    ``extra`` dataset folder are held out, the others are trained on.

    Raises:
        ConfigError: a dataset has fewer than 2 shards, or an extra one stores other taps.
    """
    meta = dataset_meta(data_dir)
    train_shards, val_shards_all = [], []
    for folder in [data_dir, *extra]:
        fmeta = dataset_meta(folder)
        if fmeta["taps"] != meta["taps"] or fmeta.get("hidden_size") != meta.get("hidden_size"):
            raise ConfigError(
                f"{folder} stores layers {fmeta['taps']}, {data_dir} stores {meta['taps']}: datasets trained "
                "on together need the same taps"
            )
        shards = list(iter_shards(folder))
        if fmeta.get("labels") == "teacher-forced" and folder != data_dir and shards:
            # text scored by the target: trained on whole; the held-out sets stay generated answers,
            # so the in-distribution numbers keep their meaning
            train_shards += shards
            continue
        if len(shards) < 2:
            raise ConfigError(f"{folder} has {len(shards)} shard(s); training needs at least 2 (one is held out)")
        val_n = min(val_shards, len(shards) - 1)
        train_shards += shards[:-val_n]
        val_shards_all += shards[-val_n:]
    train = ShardDataset(train_shards, meta["taps"], use_taps, hidden)
    val = ShardDataset(val_shards_all, meta["taps"], use_taps, hidden)
    return train, val
