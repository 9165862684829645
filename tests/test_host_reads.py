"""The decode step reads the device as little as a GPU step can afford: one host read per chain step
(the drafts and the target's choices together), two per tree step (the candidates, then the
choices), with copy inputs and the context lookup too; every other transfer is a non-blocking
upload. Counted on the CPU, where the same code runs: a read anywhere else in a step is a GPU sync."""

from __future__ import annotations

import collections

import pytest
import torch

from runtime.config import SamplingParams
from runtime.engine import chain_decoder, plain_decoder, transfer, tree_decoder
from runtime.engine.events import BlockVerified
from runtime.engine.models.bucketed_target import BucketedTarget
from runtime.engine.models.lean_target import LeanTarget
from runtime.engine.propose_bucketed import BucketedProposer
from tests.fakes import make_drafter, make_target
from tests.test_copy_inputs import add_copy_inputs

READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture(scope="module")
def target():
    model = make_target("qwen3", vocab_size=96, seed=3)
    return LeanTarget(model)  # the CLI's default forward on CPU and CUDA


class Counter:
    """Counts ``transfer.download`` calls and any other host read or blocking list->tensor build."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.downloads = 0
        self.other: collections.Counter[str] = collections.Counter()
        self.inside = False  # counting happens only inside the download helper's own read
        real_download = transfer.download

        def download(t):
            self.downloads += 1
            self.inside = True
            try:
                return real_download(t)
            finally:
                self.inside = False

        monkeypatch.setattr(transfer, "download", download)
        for mod in ("runtime.engine.drafts", "runtime.engine.tree"):
            monkeypatch.setattr(f"{mod}.download", download)
        for name in READS:
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, real))
        real_tensor = torch.tensor

        def tensor(*a, **k):
            if not self.inside and k.get("device") is not None and torch.device(k["device"]).type != "cpu":
                self.other["torch.tensor(device=...)"] += 1
            return real_tensor(*a, **k)

        monkeypatch.setattr(torch, "tensor", tensor)

    def _wrap(self, name, real):
        def read(t, *a, **k):
            if not self.inside:
                self.other[name] += 1
            return real(t, *a, **k)

        return read


def per_step(decoder, monkeypatch, prompt=(5, 6, 7, 5, 6, 7, 8, 5, 6), n=40) -> tuple[list[int], dict[str, int]]:
    events = decoder.stream(list(prompt), SamplingParams(max_new_tokens=n, ignore_eos=True))
    next(events)  # the prefill (its one read: the first token) is not a step
    counter = Counter(monkeypatch)
    reads, before = [], 0
    for event in events:
        if isinstance(event, BlockVerified):
            reads.append(counter.downloads - before)
            before = counter.downloads
    monkeypatch.undo()
    return reads, dict(counter.other)


def test_plain_and_chain_steps_read_the_device_once(target, monkeypatch):
    d = make_drafter(target.config, block_size=4)
    copy = add_copy_inputs(make_drafter(target.config, block_size=4, taps=[0, 2, 3]), (1, 4))
    for decoder in (plain_decoder(target), chain_decoder(target, d), chain_decoder(target, copy)):
        reads, other = per_step(decoder, monkeypatch)
        assert reads and set(reads) == {1}, reads
        assert other == {}, other


def test_tree_steps_read_the_device_twice_with_copy_inputs_and_lookup(target, monkeypatch):
    copy = add_copy_inputs(make_drafter(target.config, block_size=4, taps=[0, 2, 3]), (1, 4))
    plain = make_drafter(target.config, block_size=4)
    for decoder in (tree_decoder(target, plain, tree_budget=6), tree_decoder(target, copy, tree_budget=6, lookup=8)):
        reads, other = per_step(decoder, monkeypatch)
        assert reads and max(reads) == 2 and min(reads) >= 1, reads  # 1: a last step with nothing to draft
        assert other == {}, other


@pytest.mark.parametrize("kind", ["chain", "tree", "tree+lookup"])
def test_the_bucketed_step_reads_the_device_as_little(kind, monkeypatch):
    """The capturable step (``--engine bucketed``, the CUDA path): one read per chain step, at most
    two per tree step (with copy inputs and the context lookup), nothing else read."""
    bucketed = BucketedTarget(make_target("qwen3", vocab_size=96, seed=3))
    copy = add_copy_inputs(make_drafter(bucketed.config, block_size=4, taps=[0, 2, 3]), (1, 4))
    if kind == "chain":
        decoder = chain_decoder(bucketed, copy, block_size=4)
    else:
        decoder = tree_decoder(bucketed, copy, block_size=4, tree_budget=6, lookup=8 if "lookup" in kind else 0)
    assert isinstance(decoder.proposer, BucketedProposer)
    reads, other = per_step(decoder, monkeypatch)
    if kind == "chain":
        assert reads and set(reads) == {1}, reads
    else:
        assert reads and max(reads) == 2 and min(reads) >= 1, reads
    assert other == {}, other
