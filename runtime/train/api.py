"""`dflash train` as library calls: data -> fit -> evaluate -> export, each resumable.

The public facade of ``runtime.train``: each piece lives in its own module (``specs``,
``datasets``, ``prompt_sources``, ``fit``, ``export``; the whole command: ``job``).

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

from runtime.train.data import Progress
from runtime.train.datasets import data_report, open_datasets, open_eval_set, prepare_data, prepare_eval_data
from runtime.train.export import export
from runtime.train.fit import fit, frozen_weights, saved_config
from runtime.train.specs import COPY_NGRAM, DataSpec, DrafterSpec

__all__ = [
    "COPY_NGRAM",
    "DataSpec",
    "DrafterSpec",
    "Progress",
    "data_report",
    "export",
    "fit",
    "frozen_weights",
    "open_datasets",
    "open_eval_set",
    "prepare_data",
    "prepare_eval_data",
    "saved_config",
]
