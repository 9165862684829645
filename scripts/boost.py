"""Slot-k accuracy / tau_tf when the drafter's logit for the context lookup's token gets +beta."""

import os
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from runtime.engine.models.drafter_io import load_draft_model
from runtime.engine.ngram import NgramIndex
from runtime.models.embedded import embedded_target_dir
from runtime.train.api import open_eval_set
from runtime.train.trainer import TrainConfig, Trainer, build_batch

torch.set_num_threads(2)
# the embedded target in the default models folder, or DFLASH_TARGET_DIR
mdir = Path(os.environ.get("DFLASH_TARGET_DIR") or embedded_target_dir(Path.home() / ".cache" / "dflash" / "models"))
w = load_file(str(mdir / "model.safetensors"))
embed = w["model.embed_tokens.weight"]
head = w.get("lm_head.weight", embed)
dr = load_draft_model(Path(sys.argv[1]), "cpu", torch.float32)
ds = open_eval_set(Path(sys.argv[2]), list(dr.dflash.target_layer_ids), 896)
nmax = int(sys.argv[3]) if len(sys.argv) > 3 else 999
tr = Trainer(
    dr, embed, head, ds, ds, TrainConfig(steps=1), Path(os.environ.get("TMPDIR", "/tmp")) / "dflash-diag", "cpu"
)
tr.drafter.eval()
betas = [0, 1, 2, 3, 4, 6, 8, 100]
B = tr.block
res = {(bt, ng): [] for bt in betas for ng in ((2, 4), (1, 4))}
for i in range(min(len(ds), nmax)):
    tokens, feats, plen = ds.get(i, 640)
    b = build_batch([(tokens, feats, plen)], 10_000, B, tr.mask_id, random.Random(0), None, [ds.get_labels(i, 640)])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ctx = tr.drafter.fuse_context(b["features"].to(tr.head.dtype))
        h = tr.drafter(F.embedding(b["block_ids"], tr.embed), ctx, b["positions"], mask=b["mask"])
    A = b["labels"].shape[1]
    h = h.view(A, B, -1)[:, 1:].float()
    logits = h @ tr.head.float().T  # [A, B-1, N]
    labels = tr.vocab.map(b["labels"][0])  # [A, B-1] head idx, -100 oov/absent
    present = b["labels"][0] >= 0
    seq = tokens.tolist()
    lo = max(plen, 1)
    for ng in ((2, 4), (1, 4)):
        idx = NgramIndex(*ng)
        idx.extend(seq[: lo + 1])
        cands = torch.full((A, B - 1), -100, dtype=torch.long)
        for j in range(A):
            a = lo + j
            if j > 0:
                idx.extend([seq[a]])
            n, guess = idx.match(B - 1)
            if guess:
                cands[j] = tr.vocab.map(torch.tensor(guess))
        for bt in betas:
            lg = logits.clone()
            ok = cands >= 0
            lg.view(-1, lg.shape[-1])[ok.view(-1).nonzero().squeeze(1), cands.view(-1)[ok.view(-1)]] += bt
            pred = lg.argmax(-1)
            corr = (pred == labels) & present
            res[(bt, ng)].append((corr, present))
for key, lst in res.items():
    corr = torch.cat([c for c, _ in lst])
    pres = torch.cat([p for _, p in lst])
    acc = (corr.sum(0).float() / pres.sum(0).clamp(min=1)).tolist()
    full = pres.all(-1)
    run = torch.cumprod(corr.long(), -1).sum(-1)
    print(key, "slot1-3", [round(x, 3) for x in acc[:3]], "tau_tf", round(1 + run[full].float().mean().item(), 3))
