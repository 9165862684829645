"""Drafter training (docs/method.md "Training recipe", docs/training.md): frozen target embedding and head, features from the
tapped target layers, random anchors, block-sparse attention, position-decayed cross-entropy,
AdamW with warm-up and cosine decay, checkpoints that resume and continue over several runs.

One step packs ``seqs_per_step`` sequences; each contributes ``anchors`` blocks of ``block_size``
slots. A block query sees the context features strictly before its anchor plus every slot of its
own block, nothing of other blocks. Slot k (1..b-1) is trained to predict the token at anchor + k,
weighted exp(-(k-1)/gamma).

Distillation (``distill``): "hard" trains on the target's greedy token only; "soft" mixes in a soft
cross-entropy against the target's own distribution at that position, restricted to the top-k
tokens the dataset stored (renormalised over those inside the draft vocabulary):
loss = (1 - soft_weight) * CE(hard label) + soft_weight * CE(top-k target distribution).
Soft CE and KL differ by the target's entropy, a constant, so they have the same gradient.
"""

from __future__ import annotations

import math
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from runtime.engine.models.corpus import CorpusCounts
from runtime.engine.models.drafter import DFlashDraftModel
from runtime.engine.models.drafter_io import load_draft_model, save_draft_model
from runtime.errors import ConfigError
from runtime.train import metrics
from runtime.train.batching import CorpusSource, build_batch
from runtime.train.config import COPY_LR_SCALE, TrainConfig, TrainState
from runtime.train.scorer import DraftScorer
from runtime.train.shards import ShardDataset
from runtime.train.state import load_trainer_state, save_trainer_state

__all__ = ["COPY_LR_SCALE", "CorpusSource", "Progress", "TrainConfig", "TrainState", "Trainer", "build_batch"]

Progress = Callable[[dict[str, Any]], None]


class Trainer(DraftScorer):
    """Train a drafter against frozen target embedding/head weights.

    Args:
        drafter: the drafter (float32 master weights).
        embed_weight: [V, D] target embedding (frozen).
        head_weight: [V, D] target lm_head (frozen).
        train: training sequences.
        val: validation sequences (fixed anchors).
        config: hyper-parameters.
        out_dir: run folder (``checkpoint/`` inside).
        device: where to train.
        corpus: for a drafter with a corpus table (``dflash.copy_corpus``), the counts over the
            training answers (``count_corpus``): training leaves each sequence's own n-grams out,
            and the drafter's table becomes theirs. Without them the drafter's own table is used.
    """

    def __init__(
        self,
        drafter: DFlashDraftModel,
        embed_weight: torch.Tensor,
        head_weight: torch.Tensor,
        train: ShardDataset,
        val: ShardDataset | None,
        config: TrainConfig,
        out_dir: Path,
        device: torch.device | str = "cpu",
        corpus: CorpusCounts | None = None,
    ) -> None:
        super().__init__(drafter, embed_weight, head_weight, config, device, corpus)
        self.train_data, self.val_data = train, val
        self.out_dir = Path(out_dir)
        copy = [p for p in (drafter.copy_scale, drafter.copy_bias) if p is not None and p.requires_grad]
        params = [p for p in self.drafter.parameters() if p.requires_grad and all(p is not c for c in copy)]
        # copy_scale and copy_bias start at 0 and must grow to several units: their own (by default
        # COPY_LR_SCALE x larger) learning rate on the same schedule, no weight decay
        groups: list[dict[str, Any]] = [{"params": params, "lr_scale": 1.0}]
        if copy:
            scale = config.copy_lr / config.lr if config.copy_lr is not None else COPY_LR_SCALE
            groups.append({"params": copy, "lr_scale": scale, "weight_decay": 0.0})
        # fused AdamW (one kernel per step) where this torch build has it for the device
        try:
            self.opt = torch.optim.AdamW(
                groups, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay, fused=True
            )
        except (RuntimeError, TypeError, ValueError):
            self.opt = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
        self._last_acc: list[float] = []
        self.state = TrainState()
        self.rng = random.Random(config.seed)
        self._val_batches: dict[str, list[dict[str, torch.Tensor]]] = {}
        self.extra_evals: dict[str, ShardDataset] = {}  # more held-out sets, validated with ``val``
        self.on_eval: Callable[[dict[str, Any]], None] | None = None
        self._soft = config.distill == "soft"
        if self._soft and not train.has_topk:
            raise ConfigError(
                "--distill soft needs a dataset with the target's top-k log-probabilities (built with --topk K); "
                "this dataset has hard labels only: build a new one (--data DIR) or use --distill hard"
            )

    # -- schedule ---------------------------------------------------------------------------
    def progress(self) -> float:
        """Fraction of the current schedule segment done (steps or wall clock, whichever is ahead)."""
        s = self.state
        fracs = []
        if self.cfg.steps:
            fracs.append((s.step - s.segment_start_step) / self.cfg.steps)
        if self.cfg.time_budget:
            fracs.append((s.elapsed - s.segment_start_elapsed) / self.cfg.time_budget)
        return min(max(fracs), 1.0)

    def lr_at(self, progress: float) -> float:
        """Linear warm-up then cosine decay to ``min_lr_ratio`` of the peak."""
        c = self.cfg
        if progress < c.warmup:
            return c.lr * max(progress / c.warmup, 0.02)
        t = (progress - c.warmup) / max(1.0 - c.warmup, 1e-9)
        return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))

    def _window(self, seq: tuple[torch.Tensor, torch.Tensor, int]) -> list[int]:
        """``anchors`` consecutive anchors at a random place in the answer (all of a shorter one)."""
        lo, end = max(seq[2], 1), seq[0].numel() - 1
        n = min(self.cfg.anchors, max(end - lo, 0))
        start = self.rng.randint(lo, end - n) if end - n > lo else lo
        return list(range(start, start + n))

    def step(self) -> dict[str, Any]:
        """One optimiser step on a fresh random batch."""
        t0 = time.perf_counter()
        batch = None
        while batch is None:
            picks = [self.rng.randrange(len(self.train_data)) for _ in range(self.cfg.seqs_per_step)]
            seqs = [self.train_data.get(i, self.cfg.max_len) for i in picks]
            soft = [self.train_data.get_topk(i, self.cfg.max_len) for i in picks] if self._soft else None
            targets = [self.train_data.get_labels(i, self.cfg.max_len) for i in picks]
            walks = [self._window(s) for s in seqs] if self._walk else None
            batch = build_batch(
                seqs,
                self.cfg.anchors,
                self.block,
                self.mask_id,
                self.rng,
                soft,
                targets,
                self.copy_ngram,
                self.corpus_train,
                walks,
            )
        lr = self.lr_at(self.progress())
        for g in self.opt.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        loss, m = self._forward(batch, metrics=self.state.step % 10 == 0)  # argmax metrics every 10th step
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
        self.opt.step()
        dt = time.perf_counter() - t0
        self.state.step += 1
        self.state.elapsed += dt
        self.state.tokens_seen += int(batch["features"].shape[0] * batch["features"].shape[1])
        slots = int((batch["labels"] >= 0).sum())
        if m:
            acc = m["correct"].sum((0, 1)).float() / m["present"].sum((0, 1)).clamp(min=1).float()
            self._last_acc = [round(x, 3) for x in acc[:4].tolist()]
        extra = {"soft_loss": m["soft"]} if m and "soft" in m else {}
        return {
            **extra,
            "step": self.state.step,
            "loss": float(loss.detach()),
            "lr": lr,
            "grad_norm": float(gnorm),
            "slot_acc": self._last_acc,
            "slots_per_s": slots / dt,
            "step_s": dt,
            "progress": self.progress(),
        }

    @torch.no_grad()
    def validate(self, max_seqs: int = 16, dataset: ShardDataset | None = None, name: str = "val") -> dict[str, Any]:
        """Teacher-forced metrics on fixed held-out blocks: ``val_loss`` (slot-weighted hard CE,
        comparable across --distill modes), ``val_soft`` / ``val_kl`` (soft CE and KL to the target's
        top-k distribution, when the data has it),
        slot accuracies, tau_tf, top-1/2/4/8 coverage at slots 1..3 and the OOV share.

        Args:
            max_seqs: held-out sequences used (the first ones, fixed anchors).
            dataset: the held-out set (default: the validation shard).
            name: cache key of its fixed batches.
        """
        data = self.val_data if dataset is None else dataset
        if data is None or len(data) == 0:
            return {}
        if name not in self._val_batches:
            rng = random.Random(1234)
            idx = list(range(min(max_seqs, len(data))))
            batches = []
            for i in range(0, len(idx), 2):
                pick = idx[i : i + 2]
                seqs = [data.get(j, self.cfg.max_len) for j in pick]
                soft = [data.get_topk(j, self.cfg.max_len) for j in pick] if data.has_topk else None
                targets = [data.get_labels(j, self.cfg.max_len) for j in pick]
                b = build_batch(
                    seqs,
                    self.cfg.anchors,
                    self.block,
                    self.mask_id,
                    rng,
                    soft,
                    targets,
                    self.copy_ngram,
                    self.corpus_eval,
                )
                if b is not None:
                    batches.append(b)
            self._val_batches[name] = batches
        self.drafter.eval()
        hards, softs, kls, corrects, presents, ranks, oovs = [], [], [], [], [], [], []
        for b in self._val_batches[name]:
            _, m = self._forward(b)
            hards.append(m["hard"])
            if "soft" in m:
                softs.append(m["soft"])
                kls.append(m["kl"])
            corrects.append(m["correct"].flatten(0, 1))
            presents.append(m["present"].flatten(0, 1))
            ranks.append(m["rank"].flatten(0, 1))
            oovs.append(m["oov"].flatten(0, 1))
        self.drafter.train()
        if not corrects:
            return {}
        present = torch.cat(presents)
        out = metrics.block_metrics(torch.cat(corrects)[None], present[None])
        out["val_loss"] = round(sum(hards) / len(hards), 4)
        if softs:
            out["val_soft"] = round(sum(softs) / len(softs), 4)
            out["val_kl"] = round(sum(kls) / len(kls), 4)
        out.update(metrics.coverage_metrics(torch.cat(ranks), present, torch.cat(oovs)))
        out.update(self.walk_metrics(data, max_seqs=min(max_seqs, self.cfg.walk_seqs)))
        return out

    def _record(self, val: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Append a validation to the history and report it, with the extra held-out sets, to
        ``on_eval`` (the run folder's eval.jsonl). Returns the extra sets' metrics."""
        entry = {"step": self.state.step, "elapsed": round(self.state.elapsed, 1)}
        self.state.history.append({**entry, **val})
        evals = self.evaluate_extra() if self.extra_evals else {}
        if self.on_eval is not None:
            self.on_eval({**entry, "in_distribution": val, **evals})
        return evals

    def evaluate_extra(self) -> dict[str, dict[str, Any]]:
        """``validate`` on every set of ``extra_evals`` (e.g. the OOD prompts' target answers)."""
        return {name: self.validate(max_seqs=64, dataset=ds, name=name) for name, ds in self.extra_evals.items()}

    # -- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self, extra_config: dict[str, Any] | None = None) -> Path:
        """Write ``checkpoint/`` (drafter in the published layout + trainer state) atomically."""
        ckpt = self.out_dir / "checkpoint"
        tmp = self.out_dir / "checkpoint.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        save_draft_model(self.drafter, tmp, extra_config)
        save_trainer_state(tmp, self.opt.state_dict(), asdict(self.state), asdict(self.cfg), self.rng.getstate())
        if ckpt.exists():
            shutil.rmtree(ckpt)
        tmp.replace(ckpt)
        return ckpt

    def load_checkpoint(self, ckpt: Path, new_segment: bool = False) -> None:
        """Restore weights, optimiser moments, counters and RNG from ``ckpt``.

        Args:
            ckpt: a ``checkpoint/`` folder.
            new_segment: start a fresh schedule segment (warm-up + cosine) from these weights,
                to continue a finished run with more steps or time.
        """
        loaded = load_draft_model(ckpt, self.device, torch.float32)
        self.drafter.load_state_dict(loaded.state_dict(), strict=False)
        blob = load_trainer_state(ckpt)  # never unpickles: safetensors + JSON
        self.opt.load_state_dict(blob["optimizer"])
        self.state = TrainState(**blob["state"])
        self.rng.setstate(blob["rng"])
        if new_segment:
            self.state.segment_start_step = self.state.step
            self.state.segment_start_elapsed = self.state.elapsed
            self.state.segments += 1

    # -- the loop ---------------------------------------------------------------------------
    def run(
        self, progress: Progress | None = None, extra_config: Callable[[], dict[str, Any]] | None = None
    ) -> TrainState:
        """Train until the schedule segment is done; checkpoint on the way and at the end.

        A KeyboardInterrupt saves a checkpoint and re-raises, so ``--resume`` continues.
        """
        last_ckpt = time.perf_counter()
        if self.state.step == 0 and not self.state.history:
            self._record(self.validate())
        try:
            while self.progress() < 1.0:
                info = self.step()
                if self.state.step % self.cfg.eval_every == 0:
                    info["val"] = self.validate()
                    info["evals"] = self._record(info["val"])
                if progress:
                    progress(info)
                if time.perf_counter() - last_ckpt > self.cfg.checkpoint_every:
                    self.save_checkpoint(extra_config() if extra_config else None)
                    last_ckpt = time.perf_counter()
        except KeyboardInterrupt:
            self.save_checkpoint(extra_config() if extra_config else None)
            raise
        if not self.state.history or self.state.history[-1]["step"] != self.state.step:
            self._record(self.validate())
        self.save_checkpoint(extra_config() if extra_config else None)
        return self.state
