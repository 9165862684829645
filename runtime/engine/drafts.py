"""What the target verifies in one step: a chain left on the device, or a tree built on the host.

Both give the verify forward's inputs, read the step's outcome in ONE host read (``resolve``) and
describe themselves in the step's event. The walk is the same rule for both: follow the target's
choice at each node (for a chain: the longest prefix the target agrees with, ``accept_prefix``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.engine.acceptance import accept_prefix
from runtime.engine.detok import TextAssembler, TokenizerLike
from runtime.engine.events import BlockVerified, TokenEvent
from runtime.engine.step import RequestContext, SlotCandidates
from runtime.engine.transfer import download, upload
from runtime.engine.tree import DraftTree, ancestor_mask, chain_is_path, chain_tree, walk


class DeviceChain:
    """The argmax chain [anchor, d_1..d_k], its drafts on the device (``k`` may be 0: a plain step).

    Args:
        drafts: [k] draft ids on the target's device.
    """

    candidates: SlotCandidates | None = None
    copied = 0

    def __init__(self, drafts: torch.Tensor) -> None:
        self.drafts = drafts
        self.tree = DraftTree((0,), (-1,), (0,), (-1,))  # known after ``resolve``
        self.drafted = int(drafts.shape[0])

    def inputs(self, ctx: RequestContext) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """[1, k+1] ids (the anchor, taken from the device where the last step left it) and no tree
        positions or mask: a causal verify."""
        anchor = ctx.anchor_on_device
        if anchor is None:
            anchor = upload([ctx.anchor], torch.long, self.drafts.device)
        return torch.cat([anchor, self.drafts]).unsqueeze(0), None, None

    def resolve(self, ctx: RequestContext, choices: torch.Tensor) -> tuple[list[int], list[int]]:
        """The step's one host read (drafts and the target's choices together): (path, choices).
        The bonus token stays on the device as the next anchor."""
        k = self.drafted
        host = download(torch.cat([self.drafts, choices]))
        drafts, picked = host[:k], host[k:]
        a = accept_prefix(drafts, picked)
        self.tree = chain_tree(ctx.anchor, drafts)
        ctx.anchor_on_device = choices[a : a + 1]
        return list(range(a + 1)), picked

    def event(
        self,
        path: Sequence[int],
        events: Sequence[TokenEvent],
        seconds: float,
        asm: TextAssembler,
        tokenizer: TokenizerLike | None,
    ) -> BlockVerified:
        """The step's event: accepted drafts shown as the committed text, rejected ones decoded alone."""
        a, draft = len(path) - 1, self.tree.tokens[1:]
        rejected = tuple(asm.decode_one(t) for t in draft[a:]) if tokenizer is not None else ()
        shown = tuple(events[i].text if i < len(events) else "" for i in range(a))
        text = shown + (rejected or ("",) * (len(draft) - a))
        return BlockVerified(draft=draft, draft_text=text, accepted=a, tokens=tuple(events), seconds=seconds)


class HostTree:
    """A draft tree built on the host (best-first, a chain with candidates, plus grafted branches).

    Args:
        tree: the tree (root = the anchor).
        candidates: the slots' candidates it was built from (None: nothing was drafted).
        drafted: its nodes from the proposer (the rest, at the end, were grafted).
    """

    def __init__(self, tree: DraftTree, candidates: SlotCandidates | None, drafted: int) -> None:
        self.tree, self.candidates, self.drafted = tree, candidates, drafted
        self.copied = len(tree) - 1 - drafted

    def inputs(self, ctx: RequestContext) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """[1, N] ids; for a tree that is not a chain, positions start + depth and the ancestor mask."""
        tree, device = self.tree, ctx.device
        ids = upload([tree.tokens], torch.long, device)
        if len(tree) > 1 and not chain_is_path(tree):
            positions = upload([d + ctx.start for d in tree.depths], torch.long, device)
            return ids, positions, upload(ancestor_mask(tree.parents), torch.bool, device)
        return ids, None, None

    def resolve(self, ctx: RequestContext, choices: torch.Tensor) -> tuple[list[int], list[int]]:
        """The step's host read of the target's choices: (path, choices)."""
        picked = download(choices)
        ctx.anchor_on_device = None
        return walk(self.tree, picked), picked

    def event(
        self,
        path: Sequence[int],
        events: Sequence[TokenEvent],
        seconds: float,
        asm: TextAssembler,
        tokenizer: TokenizerLike | None,
    ) -> BlockVerified:
        """The step's event: every node's text, parents, the accepted path, the grafted nodes."""
        tree = self.tree
        draft = tree.tokens[1:]
        return BlockVerified(
            draft=draft,
            draft_text=_texts(draft, asm, tokenizer),
            accepted=len(path) - 1,
            tokens=tuple(events),
            seconds=seconds,
            parents=tuple(p - 1 for p in tree.parents[1:]),
            path=tuple(i - 1 for i in path[1:]),
            copied=self.copied,
        )


def _texts(ids: Sequence[int], asm: TextAssembler, tokenizer: TokenizerLike | None) -> tuple[str, ...]:
    """Display text of each drafted id, decoded on its own (one tokenizer call for the tree)."""
    if tokenizer is None or not ids:
        return ("",) * len(ids)
    batch = getattr(tokenizer, "batch_decode", None)
    if batch is None:
        return tuple(asm.decode_one(t) for t in ids)
    return tuple(str(t) for t in batch([[int(t)] for t in ids], skip_special_tokens=False))
