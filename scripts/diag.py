"""Where does the drafter miss at slot 1? Split by code/prose, target confidence, token kind."""

import collections
import os
import random
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from runtime.engine.models.drafter_io import load_draft_model
from runtime.models.embedded import embedded_target_dir
from runtime.train.api import open_eval_set
from runtime.train.trainer import CorpusSource, TrainConfig, Trainer, build_batch

torch.set_num_threads(2)
# the embedded target in the default models folder, or DFLASH_TARGET_DIR
mdir = Path(os.environ.get("DFLASH_TARGET_DIR") or embedded_target_dir(Path.home() / ".cache" / "dflash" / "models"))
tok = AutoTokenizer.from_pretrained(mdir)
w = load_file(str(mdir / "model.safetensors"))
embed = w["model.embed_tokens.weight"]
head = w.get("lm_head.weight", embed)
drafter_dir, data_dir = sys.argv[1], sys.argv[2]
dr = load_draft_model(Path(drafter_dir), "cpu", torch.float32)
taps = list(dr.dflash.target_layer_ids)
ds = open_eval_set(Path(data_dir), taps, 896)
cfg = TrainConfig(steps=1, bf16=True)
tr = Trainer(dr, embed, head, ds, ds, cfg, Path(os.environ.get("TMPDIR", "/tmp")) / "dflash-diag", "cpu")
tr.drafter.eval()
# a drafter with a corpus table is shown its proposals as the decoder shows them
corpus = CorpusSource(dr.dflash.copy_corpus, table=dr.corpus) if dr.dflash.copy_corpus and dr.corpus else None
stats = collections.defaultdict(lambda: [0, 0])
slots = [[0, 0] for _ in range(3)]
n_seq = min(len(ds), int(sys.argv[3]) if len(sys.argv) > 3 else 999)
for i in range(n_seq):
    tokens, feats, plen = ds.get(i, 640)
    topk = ds.get_topk(i, 640)
    rng = random.Random(0)
    labels = [ds.get_labels(i, 640)]
    b = build_batch([(tokens, feats, plen)], 10_000, tr.block, tr.mask_id, rng, None, labels, tr.copy_ngram, corpus)
    with torch.no_grad():
        _, m = tr._forward(b)
    for k in range(min(3, m["correct"].shape[-1])):  # every anchor, slots 1..3 (the drafter with its copy inputs)
        slots[k][0] += int(m["correct"][0, :, k].sum())
        slots[k][1] += int(m["present"][0, :, k].sum())
    corr, pres, rank = m["correct"][0, :, 0], m["present"][0, :, 0], m["rank"][0, :, 0]
    lo = max(plen, 1)
    text_so_far = ""
    fences = 0
    for j in range(corr.shape[0]):
        a = lo + j
        if not bool(pres[j]):
            continue
        # fences seen in answer tokens up to and including a
        piece = tok.decode(tokens[plen : a + 1])
        in_code = piece.count("```") % 2 == 1
        lab = int(tokens[a + 1])
        s = tok.decode([lab])
        kind = "ws" if s.strip() == "" else ("alnum" if s.strip().replace("_", "").isalnum() else "punct")
        conf = float(topk[1][a + 1, 0].exp()) if topk is not None else -1
        cb = "p>=.9" if conf >= 0.9 else ("p.5-.9" if conf >= 0.5 else "p<.5")
        c = int(corr[j])
        # lookup: most recent earlier occurrence of the 2-gram ending at a (then 1-gram)
        seq = tokens.tolist()
        pred = None
        for ng in (3, 2, 1):
            if a - ng + 1 < 0:
                continue
            key = seq[a - ng + 1 : a + 1]
            for p in range(a - 1, ng - 2, -1):
                if seq[p - ng + 1 : p + 1] == key:
                    pred = seq[p + 1]
                    break
            if pred is not None:
                break
        if pred is not None:
            lk = int(pred == lab)
            stats["lookup_has"][0] += c
            stats["lookup_has"][1] += 1
            stats["lookup_acc_when_has"][0] += lk
            stats["lookup_acc_when_has"][1] += 1
            stats["union_when_has"][0] += max(lk, c)
            stats["union_when_has"][1] += 1
            if lk:
                stats["drafter_when_lookup_right"][0] += c
                stats["drafter_when_lookup_right"][1] += 1
        stats["union_all"][0] += max(c, int(pred == lab) if pred is not None else 0)
        stats["union_all"][1] += 1
        for key in ("all", "code" if in_code else "prose", kind, cb, ("code" if in_code else "prose") + "/" + cb):
            stats[key][0] += c
            stats[key][1] += 1
        stats["top2"][0] += int(rank[j] < 2)
        stats["top2"][1] += 1
print("top-1 at every anchor, slots 1/2/3: " + " / ".join(f"{c / max(n, 1):.1%} (n={n})" for c, n in slots))
print("counts: " + " / ".join(f"{c}/{n}" for c, n in slots))
tot = stats["all"][1]
for k, (c, n) in sorted(stats.items(), key=lambda x: -x[1][1]):
    print(f"{k:16s} n={n:6d} share={n / tot:6.1%} acc={c / max(n, 1):6.1%}")
