"""The decode loop (batch 1): plain decoding, DFlash chains and draft trees are one loop.

    prefill -> [plan -> propose -> verify -> walk -> commit -> compact caches -> observe -> event]*

- plan: the ``Planner`` sizes the step (``StepPlan``); plain decoding is a plan of depth 0.
- propose: the ``Proposer`` (the DFlash drafter) scores the block's slots in ONE forward: an argmax
  chain left on the device, or per-slot candidates on the host, from which a best-first tree (or a
  chain) is built and cut by the planner; a ``Brancher`` (the context lookup) grafts one more branch.
- verify: ONE target forward over the anchor and the drafts (causal for a chain; positions
  start + depth and an ancestor-only mask for a tree).
- walk: follow the target's choice (argmax, or its sample: exact sampling) down the drafts; commit
  the accepted path plus the target's own next token. Output equals the target's alone.
- compact: the target cache keeps the accepted path; its features become the drafter's context.

Host reads per step: one for a device chain (drafts and choices together); a host tree reads the
candidates, then the choices. See ``docs/decoding.md``.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator, Sequence
from typing import NamedTuple

import torch

from runtime.config import SamplingParams
from runtime.engine.commit import Committer
from runtime.engine.confidence import RANKS
from runtime.engine.decoder import CancelToken, StatsRecorder
from runtime.engine.detok import TextAssembler, TokenizerLike
from runtime.engine.drafts import DeviceChain, HostTree
from runtime.engine.events import DecodeEvent, Finished, FinishReason, PrefillDone, TokenStatus
from runtime.engine.guards import ensure_finite_logits
from runtime.engine.lookup import ContextLookup
from runtime.engine.models.target import TargetModel
from runtime.engine.ngram import NgramIndex
from runtime.engine.prompt_cache import CachedState, PromptCache, Reuse
from runtime.engine.sampling import sample
from runtime.engine.step import Planner, Proposer, RequestContext, StepOutcome
from runtime.engine.transfer import upload
from runtime.engine.tree import DraftTree, chain_tree, choice_ranks, tree_from_candidates, truncate_tree
from runtime.errors import ConfigError, InputError, OutOfMemoryError


class _Request(NamedTuple):
    """What one generation needs before its prefill (``SpeculativeDecoder._begin``)."""

    gen: torch.Generator | None
    asm: TextAssembler
    max_new: int
    limit: int | None
    commit: Committer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class SpeculativeDecoder:
    """The one decode loop (the ``runtime.engine.decoder.Decoder`` protocol).

    Args:
        target: the wrapped target model.
        proposer: the drafter's proposer, or None for plain decoding.
        planner: sizes each step (its ``max_depth`` is block size - 1; 0 for plain decoding).
        tokenizer: used for text deltas and stop strings (None: text is "").
        stop_token_ids: ids that end the generation (EOS ids, added by the pipeline).
        lookup: most tokens per step the context lookup grafts onto the step's tree (0: off;
            needs a planner whose steps are host trees).
        lookup_ngram: (shortest, longest) suffix the lookup matches.
        prompt_cache: the pair's prompt cache (``runtime.engine.prompt_cache``): the request reuses
            a slot's caches for the prefix its prompt shares with them and leaves its own there.
        slot: the prompt cache's slot to use (None: the one sharing the longest prefix).
    """

    def __init__(
        self,
        target: TargetModel,
        proposer: Proposer | None,
        planner: Planner,
        tokenizer: TokenizerLike | None = None,
        *,
        stop_token_ids: Sequence[int] = (),
        lookup: int = 0,
        lookup_ngram: tuple[int, int] = (2, 4),
        prompt_cache: PromptCache | None = None,
        slot: int | None = None,
    ) -> None:
        if planner.max_depth > 0 and proposer is None:
            raise ConfigError(f"block size {planner.max_depth + 1} needs a drafter; use --decoder ar or name a drafter")
        if lookup < 0:
            raise ConfigError(f"lookup length must be >= 0 (0 = off), got {lookup}")
        if lookup and not planner.plan().on_host:
            raise ConfigError("the context lookup grafts onto draft trees; it needs a tree plan")
        self.target, self.proposer, self.planner = target, proposer, planner
        self.tokenizer = tokenizer
        self.block_size = planner.max_depth + 1
        self.name = "dflash" if proposer is not None else "ar"
        self.stop_token_ids = frozenset(int(i) for i in stop_token_ids)
        self.lookup, self.lookup_ngram = lookup, lookup_ngram
        self.prompt_cache, self.slot = prompt_cache, slot

    @property
    def tree_budget(self) -> int:
        """Tree nodes the planner plans for the next step (0: a chain)."""
        return self.planner.plan().budget

    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, cancel: CancelToken | None = None
    ) -> Iterator[DecodeEvent]:
        """Generate from ``prompt_ids`` and yield typed events.

        Yields:
            ``PrefillDone``, ``BlockVerified`` per verify step, ``Finished``.

        Raises:
            InputError: empty prompt or a prompt that fills the target's context.
            OutOfMemoryError: the device ran out of memory.
        """
        try:
            yield from self._stream(list(prompt_ids), params, cancel)
        except torch.OutOfMemoryError as e:
            raise OutOfMemoryError(
                f"out of memory on {self.target.device}: {str(e).splitlines()[0]}; try a shorter prompt, "
                "fewer --max-tokens, --dtype bfloat16, --quantize int8 or a smaller model"
            ) from e

    def _begin(self, prompt: list[int], params: SamplingParams) -> _Request:
        """Check the prompt and set up one request.

        Raises:
            InputError: empty prompt, a prompt that fills the target's context, ids out of the vocabulary.
        """
        target, n_prompt = self.target, len(prompt)
        if n_prompt == 0:
            raise InputError("the prompt is empty; give some text (or --prompt-ids)")
        limit = target.max_positions
        if limit is not None and n_prompt >= limit:
            raise InputError(f"the prompt has {n_prompt} tokens but the target's context is {limit} tokens; shorten it")
        if any(not (0 <= t < target.vocab_size) for t in prompt):
            raise InputError(f"prompt ids must be in [0, {target.vocab_size}), got {max(prompt)}")
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.stop_token_ids)
        gen = None if params.greedy else torch.Generator(device=target.device).manual_seed(params.seed)
        asm = TextAssembler(self.tokenizer, params.stop_strings, context_ids=prompt)
        max_new = params.max_new_tokens if limit is None else min(params.max_new_tokens, limit - n_prompt)
        return _Request(gen, asm, max_new, limit, Committer(stop_ids, asm))

    def _index(self, lookup: ContextLookup | None) -> NgramIndex | None:
        """The request's one n-gram index, covering every size its users match (None: no user)."""
        sizes = [s for s in (getattr(self.proposer, "ngram", None), lookup.ngram if lookup else None) if s]
        if not sizes:
            return None
        return NgramIndex(min(lo for lo, _ in sizes), max(hi for _, hi in sizes))

    def _draft(
        self, ctx: RequestContext, depth: int, room: int, lookup: ContextLookup | None
    ) -> tuple[DeviceChain | HostTree, int | None]:
        """Propose this step's drafts: (what the target verifies, the drafted tree's depth)."""
        plan = self.planner.plan()
        if not plan.on_host:  # the argmax chain, left on the device
            drafts = torch.empty(0, dtype=torch.long, device=ctx.device)
            if depth > 0:
                assert self.proposer is not None
                drafts = self.proposer.chain(ctx, depth)
                ctx.pending = ctx.pending[:, :0] if ctx.pending is not None else None
            return DeviceChain(drafts), None
        tree, cands = DraftTree((ctx.anchor,), (-1,), (0,), (-1,)), None
        if depth > 0:
            assert self.proposer is not None
            width = max(plan.nodes, RANKS) if plan.tree else RANKS
            cands = self.proposer.candidates(ctx, depth, width)
            if plan.tree:
                tree = tree_from_candidates(cands.vals, cands.toks, ctx.anchor, plan.nodes)
            else:
                tree = chain_tree(ctx.anchor, [row[0] for row in cands.toks[: plan.nodes]], cands.toks)
            tree = truncate_tree(tree, self.planner.keep(cands, tree))
            ctx.pending = ctx.pending[:, :0] if ctx.pending is not None else None
        drafted_depth = tree.max_depth
        drafted = len(tree) - 1
        if lookup is not None:
            tree = lookup.graft(ctx, tree, room)
        return HostTree(tree, cands, drafted), drafted_depth

    @torch.inference_mode()
    def _stream(self, prompt: list[int], params: SamplingParams, cancel: CancelToken | None) -> Iterator[DecodeEvent]:
        request = self._begin(prompt, params)
        cache, key = self.prompt_cache, self.proposer.state_key if self.proposer is not None else None
        reuse = cache.take(prompt, key, self.target.crop, self.slot) if cache is not None else None
        ctx: RequestContext | None = None
        kept = False
        try:
            ctx, rec, reason = yield from self._prefill(prompt, params, request, reuse)
            yield from self._decode(ctx, rec, reason, params, request, cancel)
            kept = True
        except GeneratorExit:  # the consumer stopped at a yield, where the caches are consistent
            kept = True
            raise
        finally:
            if cache is not None and reuse is not None:
                state = None
                if kept and ctx is not None:
                    state = CachedState(ctx.committed[:-1], ctx.t_cache, ctx.d_cache, ctx.pending, key)
                cache.put(reuse.slot, state)

    def _prefill(
        self, prompt: list[int], params: SamplingParams, request: _Request, reuse: Reuse | None
    ) -> Generator[DecodeEvent, None, tuple[RequestContext, StatsRecorder, FinishReason | None]]:
        """The target on the prompt (what the cache does not hold) and the first token; yields
        ``PrefillDone``, returns the request's context, its stats and whether it already ended."""
        target, device = self.target, self.target.device
        n_prompt = len(prompt)
        gen, _, max_new, _, commit = request
        rec = StatsRecorder(n_prompt, self.block_size, self.name, tree_budget=self.tree_budget, lookup=self.lookup)
        capture = self.proposer is not None
        room = n_prompt + max_new + max(self.block_size, self.planner.max_nodes) + self.lookup + 2
        state = reuse.state if reuse is not None else None
        cached = reuse.cached if reuse is not None and state is not None else 0
        if state is not None:
            ctx = RequestContext(list(prompt), device, state.t_cache, state.d_cache, state.pending)
        else:
            ctx = RequestContext(list(prompt), device, target.new_cache(capacity=room))
        if self.proposer is not None:  # per request: decoders of several drafters may share one target
            target.set_taps(self.proposer.taps)
        ids = upload([prompt[cached:]], torch.long, device)  # [1, P - cached]
        logits, feats = target.forward(ids, ctx.t_cache, logits_to_keep=1, capture=capture)
        ensure_finite_logits(logits[-1:], target)  # garbage weights: exit 4 naming the folder, not `0 0 0 ...`
        first_t = sample(logits[-1:], params, gen)
        first = int(first_t.item())
        _sync(device)
        ttft = time.perf_counter() - rec.t0
        events, reason = commit([first], [TokenStatus.TARGET], last=max_new <= 1)
        rec.prefill(ttft, len(events))
        rec.cached = cached
        ctx.committed.append(first)
        ctx.anchor_on_device = first_t
        if self.proposer is not None:
            self.proposer.begin(ctx, room, feats)
        yield PrefillDone(prompt_tokens=n_prompt, seconds=ttft, tokens=tuple(events), tokens_cached=cached)
        return ctx, rec, reason

    def _decode(
        self,
        ctx: RequestContext,
        rec: StatsRecorder,
        reason: FinishReason | None,
        params: SamplingParams,
        request: _Request,
        cancel: CancelToken | None,
    ) -> Iterator[DecodeEvent]:
        """The decode steps after the prefill, then ``Finished``."""
        target = self.target
        gen, asm, max_new, limit, commit = request
        capture = self.proposer is not None
        lookup = ContextLookup(self.lookup, self.lookup_ngram) if self.lookup else None
        ctx.index = self._index(lookup)
        while reason is None:
            if cancel is not None and cancel.cancelled:
                reason = "cancelled"
                break
            t_step = time.perf_counter()
            start = ctx.start
            room_left = max_new - rec.generated - 1  # tokens the request may still add after the bonus
            if limit is not None:
                room_left = min(room_left, limit - start - 1)

            # 2. Plan and propose.
            plan = self.planner.plan()
            draft, drafted_depth = self._draft(ctx, max(min(plan.depth, room_left), 0), room_left, lookup)

            # 3. Verify: one target forward over the anchor and the drafts.
            ids, positions, mask = draft.inputs(ctx)
            logits, feats = target.forward(ids, ctx.t_cache, capture=capture, positions=positions, tree_mask=mask)
            path, choices = draft.resolve(ctx, sample(logits, params, gen))
            tree = draft.tree

            # 4. Commit the accepted path and the target's next token.
            a = len(path) - 1
            new_ids = [tree.tokens[i] for i in path[1:]] + [choices[path[-1]]]
            statuses = [TokenStatus.ACCEPTED] * a + [TokenStatus.TARGET]
            events, reason = commit(new_ids, statuses, last=rec.generated + a + 1 >= max_new)

            # 5. Compact the target cache to the path; its features are the drafter's next context.
            prefix = path[-1] == a
            if prefix:
                target.crop(ctx.t_cache, start + a + 1)
            else:
                target.keep(ctx.t_cache, start, path)
            if feats is not None and ctx.pending is not None:
                ctx.pending = torch.cat([ctx.pending, feats[:, : a + 1] if prefix else feats[:, path]], dim=1)
            ctx.committed.extend(new_ids)

            # 6. Observe: the planner and the lookup learn; the stats and the event.
            ranks = choice_ranks(tree, path, choices)
            outcome = StepOutcome(
                tree, path, choices, ranks, draft.candidates, draft.drafted, time.perf_counter() - t_step
            )
            self.planner.observe(outcome)
            if lookup is not None:
                lookup.observe(outcome)
            planned = plan.planned if plan.planned is not None else (drafted_depth or 0)
            rec.tree_budget = plan.budget
            rec.step(drafted=len(tree) - 1, accepted=a, committed=len(events), planned=planned, depth=tree.max_depth)
            block = draft.event(path, events, time.perf_counter() - t_step, asm, self.tokenizer)
            rec.copied += len(block.copied_path)
            yield block
        yield Finished(reason=reason, stats=rec.finish())
