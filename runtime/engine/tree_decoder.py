"""DFlash with tree verification (DDTree): one drafter pass, a draft tree, one target verify.

Per step: the drafter scores every slot of the block in one forward; a tree of up to B drafted
nodes is built from those per-slot log-probabilities (``runtime.engine.tree``); the target
verifies anchor + tree in ONE forward with an ancestor-only mask and positions start + depth; the
walk follows the target's choice at each node (argmax, or its sample there: exact sampling); the
target KV cache is compacted to the accepted path and only the accepted nodes' features become the
drafter's next context. Tokens are exactly those of plain decoding (greedy) or an exact sample.

Two host syncs per step: the slots' top candidates (the tree is built on the host) and the target's
choices (the walk).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from runtime.config import ConfigError, SamplingParams
from runtime.engine.decoder import CancelToken, StatsRecorder
from runtime.engine.detok import TextAssembler, TokenizerLike
from runtime.engine.dflash import DFlashDecoder, _sync
from runtime.engine.drafter import DFlashDraftModel
from runtime.engine.events import (
    BlockVerified,
    DecodeEvent,
    Finished,
    PrefillDone,
    TokenStatus,
)
from runtime.engine.kv_cache import DraftKVCache
from runtime.engine.lookup import ContextLookup, chain_is_path
from runtime.engine.sampling import sample
from runtime.engine.target import TargetModel
from runtime.engine.tree import (
    DraftTree,
    ancestor_mask,
    chain_tree,
    choice_ranks,
    slot_candidates,
    tree_from_candidates,
    truncate_tree,
    walk,
)
from runtime.engine.tree_budget import RANKS, AdaptiveTreeBudget, FixedTreeBudget, TreeBudgetPolicy

TREE_ATTENTION = ("sdpa", "eager")  # attention implementations that take a custom 4D mask


def tree_attention_support(target: TargetModel) -> str | None:
    """None when the target's attention takes the tree mask, else the implementation's name."""
    impl = getattr(getattr(target, "config", None), "_attn_implementation", None)
    return None if impl in (None, *TREE_ATTENTION) else str(impl)


class TreeDecoder(DFlashDecoder):
    """Speculative decoder that verifies a draft tree of ``tree_budget`` nodes per step.

    Args:
        target: the wrapped target model.
        drafter: the drafter (required).
        tokenizer: used for text deltas and stop strings (None: text is "").
        block_size: drafter block length (default: the drafter's own); the tree is at most
            block_size - 1 deep.
        tree_budget: drafted nodes per verify (B >= 1; the verify forward holds B + 1 tokens), or a
            policy choosing B per step (``AdaptiveTreeBudget``; B = 0 then means a chain step).
        stop_token_ids: ids that end the generation.
        lookup: most tokens copied per step from the context (``runtime.engine.lookup``): when the
            last committed tokens occurred earlier in the prompt or answer, what followed them
            there joins the tree as one more branch. 0 turns it off.
        lookup_ngram: (shortest, longest) suffix matched by the lookup.
    """

    name = "dflash"

    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDraftModel,
        tokenizer: TokenizerLike | None = None,
        *,
        block_size: int | None = None,
        tree_budget: int | TreeBudgetPolicy = 8,
        stop_token_ids: Sequence[int] = (),
        lookup: int = 0,
        lookup_ngram: tuple[int, int] = (2, 4),
    ) -> None:
        if lookup < 0:
            raise ConfigError(f"lookup length must be >= 0 (0 = off), got {lookup}")
        if isinstance(tree_budget, int):
            if tree_budget < 1:
                raise ConfigError(f"tree budget must be >= 1 (0 means the chain decoder), got {tree_budget}")
            tree_budget = FixedTreeBudget(tree_budget)
        if drafter is None:
            raise ConfigError("tree verification needs a drafter")
        impl = tree_attention_support(target)
        if impl is not None:
            raise ConfigError(
                f"tree verification needs a custom attention mask, which {impl} attention does not take; "
                "load the target with sdpa or eager attention, or use --tree-budget 0"
            )
        super().__init__(target, drafter, tokenizer, block_size=block_size, stop_token_ids=stop_token_ids)
        if self.block_size < 2:
            raise ConfigError("tree verification needs a block size >= 2")
        self.policy: TreeBudgetPolicy = tree_budget
        self.lookup = lookup
        self.lookup_ngram = lookup_ngram

    @property
    def tree_budget(self) -> int:
        """Tree nodes of the next step (0: a chain step chosen by an adaptive policy)."""
        return self.policy.budget()

    def draft_logprobs(
        self,
        anchor: int,
        start: int,
        depth: int,
        pending: torch.Tensor | None,
        d_cache: DraftKVCache | None,
        committed: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Per-slot draft log-probabilities for slots 1..depth, from one drafter forward.

        Args:
            anchor, start, pending, d_cache: as in ``DFlashDecoder.propose``.
            depth: slots wanted (<= block_size - 1).
            committed: prompt + committed ids, ending with the anchor (the copy inputs' context).

        Returns:
            ([depth, V] float log-probabilities, [V_d] full ids of the columns or None, [depth] full
            id of each slot's extra column or None: the copy inputs' proposal outside the draft
            vocabulary, ``DraftHead.with_copies``).
        """
        assert self.head is not None
        logits, extra_ids = self.draft_logits(anchor, start, depth, pending, d_cache, committed)
        return torch.log_softmax(logits, dim=-1), self.head.ids, extra_ids

    def _texts(self, ids: Sequence[int], asm: TextAssembler) -> tuple[str, ...]:
        """Display text of each drafted id, decoded on its own (one tokenizer call for the tree)."""
        tok = self.tokenizer
        if tok is None or not ids:
            return ("",) * len(ids)
        batch = getattr(tok, "batch_decode", None)
        if batch is None:
            return tuple(asm.decode_one(t) for t in ids)
        return tuple(str(t) for t in batch([[int(t)] for t in ids], skip_special_tokens=False))

    @torch.inference_mode()
    def _stream(self, prompt: list[int], params: SamplingParams, cancel: CancelToken | None) -> Iterator[DecodeEvent]:
        target, device = self.target, self.target.device
        n_prompt = len(prompt)
        gen, asm, max_new, limit, commit = self._begin(prompt, params)
        rec = StatsRecorder(n_prompt, self.block_size, "dflash", tree_budget=self.policy.budget(), lookup=self.lookup)

        # 1. Prefill: target on the prompt, capture features of every position, first token.
        room = (
            n_prompt + max_new + max(self.block_size, self.policy.budget(), 64) + self.lookup + 2
        )  # slots a request can reach
        t_cache, first_t, feats = self._prefill(prompt, params, gen, room)
        first = int(first_t.item())
        _sync(device)
        ttft = time.perf_counter() - rec.t0
        events, reason = commit([first], [TokenStatus.TARGET], last=max_new <= 1)
        rec.prefill(ttft, len(events))
        yield PrefillDone(prompt_tokens=n_prompt, seconds=ttft, tokens=tuple(events))

        assert self.drafter is not None
        d_cache = DraftKVCache(len(self.drafter.layers), capacity=room)
        committed = list(prompt) + [first]
        lookup = ContextLookup(committed, self.lookup, self.lookup_ngram) if self.lookup else None
        pending = feats  # [1, C, n*D] target features not yet in the drafter cache
        start, anchor = n_prompt, first
        while reason is None:
            if cancel is not None and cancel.cancelled:
                reason = "cancelled"
                break
            t_step = time.perf_counter()
            room_left = max_new - rec.generated - 1  # tokens the request may still add after the bonus
            if limit is not None:
                room_left = min(room_left, limit - start - 1)
            depth = max(min(self.block_size - 1, room_left), 0)

            budget = self.policy.budget()
            planned = self.block_size - 1  # slots a tree may reach (the stats' verify length)
            pol = self.policy
            sized = pol if isinstance(pol, AdaptiveTreeBudget) and pol.confidence is not None else None
            if budget == 0 and sized is None:  # the policy chose a chain of K argmax drafts for this step
                planned = min(planned, self.policy.chain_length())
                depth = min(depth, planned)

            # 2. Draft: one drafter forward, then a best-first tree of up to B nodes (one host sync).
            tree = DraftTree((anchor,), (-1,), (0,), (-1,))
            if depth > 0:
                logprobs, vocab_ids, extra_ids = self.draft_logprobs(anchor, start, depth, pending, d_cache, committed)
                cap = sized.tree_cap() if sized is not None else budget
                vals, toks = slot_candidates(logprobs, max(cap, RANKS), vocab_ids, extra_ids)  # [depth][w]
                if sized is not None:  # the best-first tree up to the cap, cut where the drafter's confidence ends
                    tree = tree_from_candidates(vals, toks, anchor, cap)
                    tree = truncate_tree(tree, sized.tree_size_for(vals, tree))
                    if budget == 0:
                        planned = tree.max_depth
                elif budget > 0:
                    tree = tree_from_candidates(vals, toks, anchor, budget)
                else:
                    tree = chain_tree(anchor, [row[0] for row in toks], toks)
                pending = pending[:, :0] if pending is not None else None

            # 2b. Lookup: what followed the context's latest earlier occurrence of its last tokens.
            drafted_nodes = len(tree)
            if lookup is not None:
                tree = lookup.add_to(tree, room_left)

            # 3. Verify: one target forward over the tree, ancestor-only mask, positions start + depth.
            n = len(tree)
            tree_ids = torch.tensor([tree.tokens], dtype=torch.long, device=device)  # [1, N]
            if n > 1 and not chain_is_path(tree):
                positions = torch.tensor(tree.depths, dtype=torch.long, device=device) + start  # [N]
                mask = ancestor_mask(tree.parents, device)  # [N, N]
                logits, feats = target.forward(tree_ids, t_cache, positions=positions, tree_mask=mask)
            else:  # a chain: the plain causal verify
                logits, feats = target.forward(tree_ids, t_cache)
            choices = sample(logits, params, gen).tolist()  # [N] the target's choice at every node

            # 4. Walk the target's choices down the tree; commit the path and the target's next token.
            path = walk(tree, choices)  # node indices, root first
            a = len(path) - 1
            bonus = choices[path[-1]]
            new_ids = [tree.tokens[i] for i in path[1:]] + [bonus]
            statuses = [TokenStatus.ACCEPTED] * a + [TokenStatus.TARGET]
            events, reason = commit(new_ids, statuses, last=rec.generated + a + 1 >= max_new)

            # 5. Compact the target cache to the accepted path; its features are the drafter's next context.
            target.keep(t_cache, start, path)
            start += len(path)
            if feats is not None:
                path_feats = feats[:, path]  # [1, a + 1, n*D]
                pending = torch.cat([pending, path_feats], dim=1) if pending is not None else path_feats
            anchor = bonus
            committed.extend(new_ids)
            if lookup is not None:
                lookup.observe(path, new_ids)
            self.policy.observe(choice_ranks(tree, path, choices), tokens=a + 1, nodes=n)
            rec.tree_budget = budget
            rec.step(drafted=n - 1, accepted=a, committed=len(events), planned=planned, depth=tree.max_depth)
            draft = tree.tokens[1:]
            draft_text = self._texts(draft, asm)
            block = BlockVerified(
                draft=draft,
                draft_text=draft_text,
                accepted=a,
                tokens=tuple(events),
                seconds=time.perf_counter() - t_step,
                parents=tuple(p - 1 for p in tree.parents[1:]),
                path=tuple(i - 1 for i in path[1:]),
                copied=n - drafted_nodes,
            )
            rec.copied += len(block.copied_path)
            yield block
        yield Finished(reason=reason, stats=rec.finish())
