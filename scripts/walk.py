"""tau_walk of one or more drafters on a dataset folder of the target's answers (e.g. a run's
OUT/eval-data/ood): the drafts at every anchor, walked as the chain decoder walks them, in float32.
It equals the decoder's own tau (chain of the whole block, no lookup, no confidence cut) on those
answers when they are the target's float32 answers.

    python scripts/walk.py DATA_DIR DRAFTER [DRAFTER ...]      (DRAFTER: a folder or "embedded")
"""

import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from runtime.engine.models.drafter_io import load_draft_model
from runtime.models.embedded import embedded_drafter_dir, embedded_target_dir
from runtime.train.api import open_eval_set
from runtime.train.trainer import TrainConfig, Trainer

torch.set_num_threads(2)
mdir = Path(os.environ.get("DFLASH_TARGET_DIR") or embedded_target_dir(Path.home() / ".cache" / "dflash" / "models"))
w = load_file(str(mdir / "model.safetensors"))
embed = w["model.embed_tokens.weight"]
head = w.get("lm_head.weight", embed)
data_dir = Path(sys.argv[1])
for name in sys.argv[2:]:
    dr = load_draft_model(embedded_drafter_dir() if name == "embedded" else Path(name), "cpu", torch.float32)
    ds = open_eval_set(data_dir, list(dr.dflash.target_layer_ids), embed.shape[1])
    tr = Trainer(
        dr, embed, head, ds, ds, TrainConfig(steps=1, bf16=False, max_len=1 << 14), Path("/tmp/dflash-walk"), "cpu"
    )
    m = tr.walk_metrics(ds, max_seqs=1 << 30)
    print(
        f"{name}: tau_walk {m['tau_walk']:.3f} | slot 1 right at the walk's anchors {m['walk_top1']:.1%} | {len(ds)} answers"
    )
