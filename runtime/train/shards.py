"""A dataset folder's shards as training sequences: tokens, the tapped features the drafter
uses, the target's own labels and top-k distribution."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from runtime.errors import ConfigError
from runtime.train.data import Shard, load_shard


class ShardDataset:
    """Sequences of a set of shards, with the tap columns the drafter uses.

    Args:
        shards: loaded shards.
        data_taps: taps stored in the shards, in order.
        use_taps: taps the drafter consumes (a subset of ``data_taps``), in its order.
        hidden_size: D.
    """

    def __init__(
        self, shards: Sequence[Shard], data_taps: Sequence[int], use_taps: Sequence[int], hidden_size: int
    ) -> None:
        missing = [t for t in use_taps if t not in data_taps]
        if missing:
            raise ConfigError(f"the dataset has no features for target layers {missing} (it has {list(data_taps)})")
        self.shards = list(shards)
        self.index = [(si, j) for si, s in enumerate(self.shards) for j in range(s.num_sequences)]
        d = hidden_size
        cols = [torch.arange(data_taps.index(t) * d, (data_taps.index(t) + 1) * d) for t in use_taps]
        self.columns = torch.cat(cols)
        self.contiguous = bool(torch.equal(self.columns, torch.arange(self.columns.numel()) + int(self.columns[0])))

    def __len__(self) -> int:
        return len(self.index)

    def get(self, i: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(tokens [T], features [T, n*D] bf16, prompt length) of sequence ``i`` cut to ``max_len``."""
        si, j = self.index[i]
        s = self.shards[si]
        a, b = int(s.offsets[j]), int(s.offsets[j + 1])
        b = min(b, a + max_len)
        feats = s.features[a:b]
        if self.contiguous:
            c0 = int(self.columns[0])
            feats = feats[:, c0 : c0 + self.columns.numel()]
        else:
            feats = feats[:, self.columns]
        return s.tokens[a:b], feats, int(s.prompt_len[j])

    def get_labels(self, i: int, max_len: int) -> torch.Tensor | None:
        """The target's own choice for each token of sequence ``i`` [T] (-1 at prompt positions)
        when its shard is teacher-forced text (``runtime.train.text``); None for generated answers,
        whose tokens are the target's choices."""
        si, j = self.index[i]
        s = self.shards[si]
        if not s.teacher_forced:
            return None
        a, b = int(s.offsets[j]), int(s.offsets[j + 1])
        t, plen = min(b - a, max_len), int(s.prompt_len[j])
        out = torch.full((t,), -1, dtype=torch.long)
        out[plen:t] = s.answer_labels(j)[: max(t - plen, 0)]
        return out

    @property
    def has_topk(self) -> bool:
        """Every shard stores the target's top-k distribution (soft labels)."""
        return bool(self.shards) and all(s.topk_ids is not None for s in self.shards)

    def get_topk(self, i: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Top-k ids [T, k] (-1 at prompt positions) and log-probs [T, k] of sequence ``i``, row p
        being the target's distribution for token p; None when its shard has no soft labels."""
        si, j = self.index[i]
        s = self.shards[si]
        if s.topk_ids is None or s.topk_logp is None:
            return None
        a, b = int(s.offsets[j]), int(s.offsets[j + 1])
        t = min(b - a, max_len)
        plen = int(s.prompt_len[j])
        k = s.topk_ids.shape[1]
        ids = torch.full((t, k), -1, dtype=torch.long)
        logp = torch.zeros((t, k), dtype=torch.float32)
        r0 = s.answer_start(j)
        n = max(t - plen, 0)
        ids[plen:t] = s.topk_ids[r0 : r0 + n].long()
        logp[plen:t] = s.topk_logp[r0 : r0 + n].float()
        return ids, logp


def iter_shards(data_dir: Path) -> Iterator[Shard]:
    """Load every shard of a dataset folder, in order."""
    for p in sorted(Path(data_dir).glob("shard-*.safetensors")):
        yield load_shard(p)


def dataset_meta(data_dir: Path) -> dict[str, Any]:
    """The ``dataset.json`` of a dataset folder."""
    path = Path(data_dir) / "dataset.json"
    if not path.exists():
        raise ConfigError(
            f"{data_dir} is not a dflash training dataset (no dataset.json); build one with `dflash train --out DIR --data-only`"
        )
    return dict(json.loads(path.read_text()))
