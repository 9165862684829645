"""`dflash train` as library calls: data -> fit -> evaluate -> export, each resumable.

Run folder layout::

    OUT/data/          generated answers + tapped features (reused by later runs)
    OUT/checkpoint/    latest drafter + optimiser state (resume / continue)
    OUT/drafter/       the exported drafter: config.json, model.safetensors, README.md (model card)
    OUT/train_log.jsonl
    OUT/eval.jsonl     held-out evaluation as training goes: in-distribution (validation shard) and
                       OOD (the target's answers to the hand-written OOD prompts), teacher-forced
    OUT/data-report.json     dataset size and mix (sequences and answer tokens per prompt kind)
    OUT/vocab-coverage.json  OOV share of held-out answer tokens vs draft vocabulary size, head cost
    OUT/eval-data/ood/       the OOD prompts' answers + features (built once, like OUT/data)
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from runtime.engine.models.drafter_io import load_draft_model, save_draft_model
from runtime.engine.models.drafter_surgery import add_copy_corpus, add_copy_inputs
from runtime.engine.models.target import TargetModel
from runtime.errors import ConfigError
from runtime.train import vocab as vocab_mod
from runtime.train.data import dataset_summary, generate_dataset
from runtime.train.model_init import (
    init_drafter,
    init_from_target,
    make_drafter_config,
    pick_mask_token_id,
    target_has_attention_bias,
)
from runtime.train.prompts import TrainPrompt, build_prompts
from runtime.train.state import load_trainer_state
from runtime.train.trainer import ShardDataset, TrainConfig, Trainer, count_corpus, dataset_meta, iter_shards

Progress = Callable[[dict[str, Any]], None]

COPY_NGRAM = (1, 4)  # context n-gram sizes of ``dflash train --copy-inputs``


@dataclass(frozen=True)
class DrafterSpec:
    """Architecture of a new drafter.

    Attributes:
        num_layers: decoder layers.
        block_size: slots per block.
        taps: target layers feeding the drafter (None: the formula of docs/method.md).
        intermediate_size: MLP width (None: half the target's).
        draft_vocab: reduced draft vocabulary size (0: the full vocabulary; "auto": the smallest
            size whose held-out OOV share is at most ``max_oov``, see ``runtime.train.vocab``).
        mask_token_id: id of M (None: first unused embedding row).
        max_oov: the OOV share ``draft_vocab="auto"`` aims for.
        init: "random" (docs/experiments/2026-11-30-cpu-training-feasibility.md) or "target" (copy the target's last layer(s)
            where shapes allow, ``init_from_target``).
        from_drafter: start from this existing drafter folder instead (fine-tune / warm start): its
            architecture (layers, taps, block size, widths, mask token) and weights are kept, the
            draft vocabulary is chosen anew from the data (the source's ids ranked first); the other
            architecture fields are ignored.
        grow_to: with ``from_drafter``, append identity-initialised layers up to this many
            (``warm_start``; None keeps the source's layer count).
        copy_ngram: give the drafter copy inputs for these (shortest, longest) context n-gram
            matches (``runtime.engine.models.drafter_surgery.add_copy_inputs``; they start at zero, so a warm-started
            drafter drafts as before until trained); None: none added (a source drafter keeps its own).
        copy_corpus: give the drafter (which must have copy inputs) a corpus table of these
            (shortest, longest) n-grams, counted over the run's training answers
            (``runtime.engine.models.corpus``); None: none added (a source drafter's is recounted).
    """

    num_layers: int = 1
    block_size: int = 8
    taps: tuple[int, ...] | None = None
    intermediate_size: int | None = None
    draft_vocab: int | str = 16384
    mask_token_id: int | None = None
    max_oov: float = 0.01
    init: str = "random"
    from_drafter: Path | None = None
    grow_to: int | None = None
    copy_ngram: tuple[int, int] | None = None
    copy_corpus: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.block_size < 2:
            raise ConfigError("a drafter needs >= 1 layer and a block size >= 2")
        if self.draft_vocab != "auto" and (not isinstance(self.draft_vocab, int) or self.draft_vocab < 0):
            raise ConfigError(f"draft vocab must be 'auto', 'full' (0) or a size >= 1, got {self.draft_vocab!r}")
        if self.init not in ("random", "target"):
            raise ConfigError(f"init must be 'random' or 'target', got {self.init!r}")


@dataclass(frozen=True)
class DataSpec:
    """How to build the training data.

    Attributes:
        num_prompts: prompts to answer (None: all built-in prompts).
        max_new_tokens: answer length cap.
        batch_size: sequences generated together.
        seed: prompt shuffle seed.
        taps: layers to store (None: the drafter's taps).
        topk: keep the target's top-k log-probabilities per answer position (soft labels; 0: none).
        generator: prompt generator ("v2": the broad mix of ``runtime.train.generator``;
            "answers": requests on the code of an earlier dataset's answers, ``runtime.train.answers``;
            "text": real source files scored by the target, no generation, ``runtime.train.text``;
            "self": requests written by the target itself, ``runtime.train.selfinstruct``).
        source: the earlier dataset folder of the "answers" generator.
        text_roots: source folders of the "text" generator (empty: ``text.default_roots()``).
    """

    num_prompts: int | None = None
    max_new_tokens: int = 320
    batch_size: int = 32
    seed: int = 0
    taps: tuple[int, ...] | None = None
    topk: int = 8
    generator: str = "v2"
    source: Path | None = None
    text_roots: tuple[Path, ...] = ()


def frozen_weights(target: TargetModel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(embedding, lm_head, final norm weight) of the target, detached."""
    base = getattr(target.model, "model", None)
    norm = getattr(base, "norm", None) if base is not None else None
    norm_w = norm.weight.detach() if norm is not None and hasattr(norm, "weight") else None
    return target.embed.weight.detach(), target.lm_head.weight.detach(), norm_w


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
        from runtime.train.text import build_text_dataset

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


PROMPTS_FILE = "prompts.jsonl"


def read_prompts(data_dir: Path) -> list[TrainPrompt]:
    """A dataset's prompt list (``data_dir/prompts.jsonl``), in order."""
    out = []
    for line in (data_dir / PROMPTS_FILE).read_text(encoding="utf-8").splitlines():
        if line.strip():
            r = json.loads(line)
            msgs = tuple(r["messages"]) if r.get("messages") else None
            out.append(TrainPrompt(r["text"], bool(r["chat"]), r["source"], msgs))
    return out


def stored_prompts(
    data_dir: Path, spec: DataSpec, tokenizer: Any = None, target: Any = None, progress: Progress | None = None
) -> list[TrainPrompt]:
    """The dataset's prompt list, fixed in ``data_dir/prompts.jsonl`` the first time.

    Shard i answers prompts i*B..(i+1)*B-1, so a dataset must extend with the very prompts it
    started with even if the generator's inputs (installed packages) changed: stored prompts come
    first, and a larger ``num_prompts`` appends new ones from the generator. ``target`` (the
    transformers model) writes the requests of the "self" generator (``progress`` gets
    ``requests_sampled``/``requests_kept``/``of`` after each batch).
    """
    path = data_dir / PROMPTS_FILE
    stored = read_prompts(data_dir) if path.exists() else []
    want = spec.num_prompts
    if stored and want is not None and len(stored) >= want:
        return stored[:want]
    cap = None if want is None else want + len(stored)
    if spec.generator == "answers":
        fresh = answer_prompts(spec, tokenizer, cap)
    elif spec.generator == "self":
        data_dir.mkdir(parents=True, exist_ok=True)
        fresh = self_prompts(spec, tokenizer, target, cap, progress, journal=data_dir / SELF_JOURNAL)
    elif spec.generator == "text":
        from runtime.train.text import build_text_prompts, default_roots

        fresh = build_text_prompts(list(spec.text_roots) or default_roots(), seed=spec.seed, max_prompts=cap)
        if not fresh and not stored:
            raise ConfigError("no source files to build a text dataset from (give --text-from DIR)")
    else:
        fresh = build_prompts(seed=spec.seed, max_prompts=cap, generator=spec.generator)
    have = {_prompt_key(p) for p in stored}
    new = [p for p in fresh if _prompt_key(p) not in have]
    if want is not None:
        new = new[: max(0, want - len(stored))]
    prompts = stored + bucket_by_length(new, spec.batch_size, seed=spec.seed)
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for p in prompts:
            row = {"text": p.text, "chat": p.chat, "source": p.source}
            if p.messages:
                row["messages"] = list(p.messages)
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)
    return prompts


def answer_prompts(spec: DataSpec, tokenizer: Any, max_prompts: int | None) -> list[TrainPrompt]:
    """The "answers" generator's prompts for ``spec`` (built on ``spec.source``'s answers).

    Raises:
        ConfigError: no source dataset, or one without answers to build on.
    """
    from runtime.train.answers import build_prompts_from_answers, read_answers

    src = spec.source
    if src is None or not (src / "dataset.json").exists() or not (src / PROMPTS_FILE).exists():
        raise ConfigError(f"the answers generator needs an earlier dataset folder, got {src}")
    if tokenizer is None:
        raise ConfigError("the answers generator needs the target's tokenizer to read the answers")
    prompts = build_prompts_from_answers(read_answers(src, tokenizer), seed=spec.seed, max_prompts=max_prompts)
    if not prompts:
        raise ConfigError(f"{src} holds no chat answers with code blocks to build prompts on")
    return prompts


SELF_JOURNAL = "self-requests.jsonl"


def self_prompts(
    spec: DataSpec,
    tokenizer: Any,
    target: Any,
    max_prompts: int | None,
    progress: Progress | None = None,
    journal: Path | None = None,
) -> list[TrainPrompt]:
    """The "self" generator's prompts: requests the target writes (``runtime.train.selfinstruct``);
    ``journal`` keeps the sampled batches so an interrupted run resumes where it stopped.

    Raises:
        ConfigError: no target or tokenizer to write them with, or no usable request came back.
    """
    from runtime.train.selfinstruct import build_self_prompts

    if target is None or tokenizer is None:
        raise ConfigError("the self generator needs the target and its tokenizer to write requests")
    prompts = build_self_prompts(
        target,
        tokenizer,
        seed=spec.seed,
        max_prompts=max_prompts,
        batch_size=spec.batch_size,
        progress=progress,
        journal=journal,
    )
    if not prompts:
        raise ConfigError("the target wrote no usable request (is it an instruction-tuned coding model?)")
    return prompts


BUCKET_BATCHES = 8


def bucket_by_length(prompts: Sequence[TrainPrompt], batch_size: int, seed: int = 0) -> list[TrainPrompt]:
    """Order prompts so that each generation batch holds prompts of similar length.

    A batch is left-padded to its longest prompt, and the padding is computed like real tokens:
    with the generator's mix (median prompt ~100 tokens, edits and source files up to 512) an
    arbitrary batch of 32 is about two thirds padding during prefill. Within each window of
    ``BUCKET_BATCHES`` batches the prompts are sorted by length (characters: the order is fixed
    before any tokenizer runs), cut into batches, and the batches of the window shuffled with
    ``seed``, so every stretch of shards (and the held-out last one) still spans all lengths and
    kinds. Only prompts new to a dataset are ordered; stored ones keep their place.
    """
    import random

    rng = random.Random(seed)
    window = max(1, batch_size) * BUCKET_BATCHES
    out: list[TrainPrompt] = []
    for start in range(0, len(prompts), window):
        chunk = sorted(prompts[start : start + window], key=_prompt_chars)
        batches = [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
        rng.shuffle(batches)
        out.extend(p for b in batches for p in b)
    return out


def _prompt_chars(p: TrainPrompt) -> int:
    return len(p.text) + sum(len(m.get("content", "")) for m in p.messages or ())


def _prompt_key(p: TrainPrompt) -> str:
    return json.dumps([p.text, list(p.messages or ())])


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
    from runtime.train.heldout import ood_prompts

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


def saved_config(ckpt: Path) -> TrainConfig:
    """The hyper-parameters a run recorded in its ``checkpoint/`` folder."""
    saved = dict(load_trainer_state(ckpt)["config"])
    saved["betas"] = tuple(saved["betas"])
    return TrainConfig(**saved)


def fit(
    target: TargetModel,
    tokenizer: Any,
    data_dir: Path,
    out_dir: Path,
    spec: DrafterSpec,
    config: TrainConfig | None,
    resume: bool = False,
    extend: bool = False,
    device: str | torch.device = "cpu",
    progress: Progress | None = None,
    eval_sets: dict[str, Path] | None = None,
    extra_data: Sequence[Path] = (),
    corpus_data: Sequence[Path] = (),
) -> Trainer:
    """Train a drafter on ``data_dir``; checkpoints go to ``out_dir/checkpoint``.

    Args:
        config: hyper-parameters; None with ``resume`` keeps the checkpoint's.
        resume: continue from ``out_dir/checkpoint`` (same schedule).
        extend: with ``resume``, start a new warm-up + cosine segment (continue a finished run).
        eval_sets: more held-out dataset folders (e.g. {"ood": OUT/eval-data/ood}), evaluated with
            the validation shard at every ``eval_every`` steps into ``out_dir/eval.jsonl``.
        extra_data: more dataset folders trained on with ``data_dir`` (``open_datasets``).
        corpus_data: dataset folders counted into a drafter's corpus table (every shard) but not
            trained on; a resumed run without them counts the ones it recorded.

    Raises:
        ConfigError: a checkpoint exists and neither ``resume`` nor a fresh ``out_dir`` was asked for.
    """
    ckpt = out_dir / "checkpoint"
    embed, head, final_norm = frozen_weights(target)
    hidden = target.hidden_size
    init_report = None
    if resume:
        if not ckpt.exists():
            raise ConfigError(f"nothing to resume: {ckpt} does not exist")
        drafter = load_draft_model(ckpt, "cpu", torch.float32)
        cfg = dict(drafter.config.raw)
        if config is None:
            config = saved_config(ckpt)
    else:
        if config is None:
            raise ConfigError("a new training run needs a number of steps or a time budget")
        if ckpt.exists():
            raise ConfigError(f"{ckpt} exists; pass --resume to continue it or choose another --out")
        meta = dataset_meta(data_dir)
    if not resume and spec.from_drafter is not None:
        drafter, init_report = warm_start(spec.from_drafter, target, meta["taps"], spec.grow_to)
    elif not resume:
        taps = list(spec.taps) if spec.taps else list(meta["taps"])
        mask = spec.mask_token_id if spec.mask_token_id is not None else pick_mask_token_id(target.config, tokenizer)
        cfg = make_drafter_config(
            target.config,
            num_layers=spec.num_layers,
            block_size=spec.block_size,
            target_layer_ids=taps,
            mask_token_id=mask,
            intermediate_size=spec.intermediate_size,
        )
        if spec.init == "target":
            cfg["attention_bias"] = target_has_attention_bias(target.model)  # Qwen2: copy q/k/v biases
        drafter = init_drafter(cfg, final_norm)
        if spec.init == "target":
            init_report = init_from_target(drafter, target.model)
    if not resume and spec.copy_ngram is not None:
        drafter = add_copy_inputs(drafter, spec.copy_ngram)
    taps = list(drafter.dflash.target_layer_ids)
    train, val = open_datasets(data_dir, taps, hidden, extra=extra_data)
    out_dir.mkdir(parents=True, exist_ok=True)
    coverage = None
    if not resume:
        coverage = choose_draft_vocab(drafter, train, val, spec, target.vocab_size, _eos_ids(tokenizer))
        (out_dir / "vocab-coverage.json").write_text(json.dumps(coverage, indent=2))
        if init_report is not None:
            (out_dir / "init-report.json").write_text(json.dumps(init_report, indent=2))
    counts = None
    grams = spec.copy_corpus if not resume and spec.copy_corpus is not None else drafter.dflash.copy_corpus
    if resume and not corpus_data:
        corpus_data = [Path(p) for p in (drafter.config.raw.get("dflash_training") or {}).get("corpus_datasets", [])]
    if corpus_data and grams is None:
        raise ConfigError("--corpus-data fills a corpus table: give --copy-corpus (or a drafter that has one)")
    if grams is not None:  # counted afresh from this run's training answers (a resumed run: the same ones)
        more = [open_eval_set(Path(p), taps, hidden) for p in corpus_data]
        counts = count_corpus([train, *more], grams, config.max_len)
        drafter = add_copy_corpus(drafter, grams)  # the Trainer builds its table from the counts
    trainer = Trainer(drafter, embed, head, train, val, config, out_dir, device, corpus=counts)
    for name, path in (eval_sets or {}).items():
        trainer.extra_evals[name] = open_eval_set(path, taps, hidden)
    if resume:
        trainer.load_checkpoint(ckpt, new_segment=extend)
    log = (out_dir / "train_log.jsonl").open("a")
    eval_log = (out_dir / "eval.jsonl").open("a")

    def on_step(info: dict[str, Any]) -> None:
        if "val" in info:
            log.write(json.dumps({"time": time.time(), **info}) + "\n")
            log.flush()
        if progress:
            progress(info)

    def on_eval(entry: dict[str, Any]) -> None:
        eval_log.write(json.dumps({"time": round(time.time(), 1), **entry}) + "\n")
        eval_log.flush()

    trainer.on_eval = on_eval
    recorded = dict(drafter.config.raw.get("dflash_training") or {}) if resume else {}
    init_kind = "drafter" if spec.from_drafter is not None else spec.init
    init_note = recorded.get("init") or (
        {"kind": "not recorded"} if resume else {"kind": init_kind, **({"report": init_report} if init_report else {})}
    )
    vocab_note = recorded.get("draft_vocab") or _vocab_note(coverage, drafter)

    def extra() -> dict[str, Any]:
        rec = _training_record(trainer, data_dir)
        if extra_data:
            rec["extra_datasets"] = [str(p) for p in extra_data]
        if corpus_data:
            rec["corpus_datasets"] = [str(p) for p in corpus_data]
        if counts is not None:
            table = trainer.drafter.corpus
            rec["corpus"] = {"entries": len(table) if table is not None else 0, "answer_tokens": counts.answer_tokens}
        rec["init"], rec["draft_vocab"] = init_note, vocab_note
        return {"dflash_training": rec}

    try:
        trainer.run(on_step, extra)
    finally:
        log.close()
        eval_log.close()
    return trainer


def warm_start(
    source: Path, target: TargetModel, data_taps: Sequence[int], num_layers: int | None = None
) -> tuple[Any, dict[str, Any]]:
    """An existing drafter as the starting point of a new run (fine-tuning on new data).

    The drafter keeps its architecture and weights; only its draft vocabulary is chosen anew (the
    layers do not depend on it: the head is the target's own lm_head restricted to the chosen ids),
    with its own ids ranked first (``choose_draft_vocab``). ``num_layers`` above the source's grows
    it: new layers are appended after the source's, each starting as the identity (zero o_proj and
    down_proj, ``init_drafter``), so the grown drafter drafts exactly as the source before its first
    update and training only adds capacity.

    Raises:
        ConfigError: the drafter does not fit the target (hidden size, vocabulary, layer count),
            taps layers the dataset does not hold, or has more layers than ``num_layers``.
    """
    drafter = load_draft_model(source, "cpu", torch.float32)
    n_source = len(drafter.layers)
    if num_layers is not None and num_layers < n_source:
        raise ConfigError(
            f"--layers {num_layers} is fewer than drafter {source}'s {n_source}; a fine-tune can only add layers"
        )
    dc = drafter.config
    problems = []
    if dc.hidden_size != target.hidden_size:
        problems.append(f"hidden size {dc.hidden_size} vs the target's {target.hidden_size}")
    if dc.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {dc.vocab_size} vs the target's {target.vocab_size}")
    n_target = dc.raw.get("num_target_layers")
    if n_target is not None and int(n_target) != target.num_layers:
        problems.append(f"made for a {n_target}-layer target, this one has {target.num_layers}")
    if problems:
        raise ConfigError(f"drafter {source} does not fit this target: " + "; ".join(problems))
    taps = list(drafter.dflash.target_layer_ids)
    missing = [t for t in taps if t not in data_taps]
    if missing:
        raise ConfigError(
            f"drafter {source} taps layers {taps}; the dataset holds {list(data_taps)} (missing {missing}): "
            "build the data with --taps " + ",".join(str(t) for t in taps)
        )
    if num_layers is not None and num_layers > n_source:  # only a drafter that fits is worth growing
        drafter = grow_layers(drafter, num_layers)
        dc = drafter.config
    previous = dict(dc.raw.get("dflash_training") or {})
    report = {
        "source": str(Path(*Path(source).resolve().parts[-2:])),
        "source_steps": previous.get("steps"),
        "source_train_seconds": previous.get("train_seconds"),
        "source_draft_vocab": int(drafter.draft_vocab_ids.numel()) if drafter.draft_vocab_ids is not None else None,
    }
    if len(drafter.layers) > n_source:
        report["grown_from_layers"] = n_source
        report["added_layers"] = len(drafter.layers) - n_source
    # the draft vocabulary is chosen anew from this run's data, its own ids ranked first (choose_draft_vocab)
    # the source's own record and measured acceptance describe another run: not carried over
    dc.raw.pop("dflash_training", None)
    dc.raw.pop("training", None)
    if isinstance(dc.raw.get("dflash_config"), dict):
        dc.raw["dflash_config"] = {k: v for k, v in dc.raw["dflash_config"].items() if k != "acceptance_conditional"}
    return drafter, report


def grow_layers(drafter: Any, num_layers: int, seed: int = 0) -> Any:
    """``drafter`` with identity layers appended up to ``num_layers`` (see ``warm_start``)."""
    cfg = dict(drafter.config.raw)
    cfg["num_hidden_layers"] = num_layers
    if isinstance(cfg.get("layer_types"), list) and cfg["layer_types"]:
        cfg["layer_types"] = [*cfg["layer_types"], *[cfg["layer_types"][-1]] * (num_layers - len(cfg["layer_types"]))]
    grown = init_drafter(cfg, seed=seed)
    state = {k: v for k, v in drafter.state_dict().items() if k != "draft_vocab_ids"}
    missing, unexpected = grown.load_state_dict(state, strict=False)
    n_source = len(drafter.layers)
    assert not unexpected and all(k.startswith("layers.") and int(k.split(".")[1]) >= n_source for k in missing)
    grown.draft_vocab_ids = drafter.draft_vocab_ids
    return grown


def choose_draft_vocab(
    drafter: Any, train: ShardDataset, val: ShardDataset, spec: DrafterSpec, vocab_size: int, always: Sequence[int]
) -> dict[str, Any]:
    """Set ``drafter.draft_vocab_ids`` from ``spec.draft_vocab`` (N, 0 = full, or "auto") and return
    the coverage report (OOV share on the held-out shard vs N, head cost; ``runtime.train.vocab``).
    A drafter that already has a reduced vocabulary (a warm start) keeps its ids ranked first."""
    train_counts = vocab_mod.answer_counts(train)
    held = vocab_mod.answer_counts(val)
    source = drafter.draft_vocab_ids
    prior = source.tolist() if source is not None else []
    layer_params = sum(p.numel() for p in drafter.layers.parameters())
    report = vocab_mod.coverage_report(
        train_counts, held, vocab_size, drafter.config.hidden_size, layer_params, always=always, prior=prior
    )
    if spec.draft_vocab == "auto":
        n = vocab_mod.choose_size(train_counts, held, vocab_size, spec.max_oov, always, prior)
        rule = f"auto: smallest N with held-out OOV share <= {spec.max_oov:.1%} (0 = full vocabulary)"
    else:
        n = int(spec.draft_vocab)
        rule = "given" if n else "full vocabulary"
    drafter.draft_vocab_ids = vocab_mod.vocab_ids(train_counts, n, always, prior) if n else None
    chosen = int(drafter.draft_vocab_ids.numel()) if n else vocab_size
    report["chosen"] = {
        "n": chosen,
        "full": not n,
        "rule": rule,
        "oov_share": round(vocab_mod.oov_share(vocab_mod.ranked_tokens(train_counts, prior), held, chosen, always), 5)
        if n
        else 0.0,
    }
    return report


def _vocab_note(coverage: dict[str, Any] | None, drafter: Any) -> dict[str, Any]:
    if coverage is None:
        n = drafter.draft_vocab_ids
        return {"n": int(n.numel()) if n is not None else None}
    return {**coverage["chosen"], "heldout_answer_tokens": coverage["heldout_answer_tokens"]}


def _eos_ids(tokenizer: Any) -> list[int]:
    ids = []
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return ids


def _training_record(trainer: Trainer, data_dir: Path) -> dict[str, Any]:
    s = trainer.state
    last = s.history[-1] if s.history else {}
    return {
        "steps": s.step,
        "train_seconds": round(s.elapsed, 1),
        "segments": s.segments,
        "context_tokens_seen": s.tokens_seen,
        "dataset": str(data_dir),
        "hyperparameters": {
            k: v for k, v in asdict(trainer.cfg).items() if k not in ("eval_every", "checkpoint_every")
        },
        "last_validation": last,
    }


def _portable(path: Path | str, base: Path) -> str:
    """``path`` relative to the run folder when inside it, else its last two parts: no machine-
    specific absolute path ends up in a shipped drafter's config or card."""
    p, b = Path(path), Path(base)
    try:
        return str(p.resolve().relative_to(b.resolve()))
    except ValueError:
        return str(Path(*p.parts[-2:])) if p.is_absolute() else str(p)


def export(out_dir: Path, evaluation: dict[str, Any] | None, card: str) -> Path:
    """Copy the latest checkpoint's drafter to ``out_dir/drafter`` with the model card.

    The evaluation's conditional acceptance is stored in ``dflash_config.acceptance_conditional``
    (the runtime's prior for choosing the verify length).
    """
    ckpt = out_dir / "checkpoint"
    drafter = load_draft_model(ckpt, "cpu", torch.float32)
    dest = out_dir / "drafter"
    tmp = out_dir / "drafter.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    raw = dict(drafter.config.raw)
    dconf = dict(raw.get("dflash_config") or {})
    if evaluation and evaluation.get("conditional_acceptance"):
        dconf["acceptance_conditional"] = evaluation["conditional_acceptance"]
    blob = load_trainer_state(ckpt)
    # what bench's pitfall checks read: training length, feature dtype, thinking mode
    extra: dict[str, Any] = {
        "dflash_config": dconf,
        "training": {"max_len": int(blob["config"]["max_len"]), "dtype": "bfloat16", "thinking": False},
    }
    training = dict(raw.get("dflash_training") or {})
    if "dataset" in training:
        training["dataset"] = _portable(training["dataset"], out_dir)  # no machine-specific path shipped
    for key in ("extra_datasets", "corpus_datasets"):
        if key in training:
            training[key] = [_portable(p, out_dir) for p in training[key]]
    if evaluation:
        training["evaluation"] = evaluation
    extra["dflash_training"] = training
    drafter = drafter.to(torch.bfloat16)
    save_draft_model(drafter, tmp, extra)
    (tmp / "README.md").write_text(card)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.replace(dest)
    return dest
