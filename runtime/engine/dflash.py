"""The DFlash decode loop (batch 1); with block size 1 it is plain autoregressive decoding.

Per step: the drafter proposes a block in one forward, the target verifies the first K drafts in
one forward, the longest agreeing prefix plus the target's own next token are committed, and both
KV caches are cropped (docs/method.md, "The decode loop").
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F

from runtime.config import SamplingParams
from runtime.engine.acceptance import accept_prefix
from runtime.engine.decoder import CancelToken, StatsRecorder
from runtime.engine.detok import TextAssembler, TokenizerLike
from runtime.engine.drafter import DFlashDraftModel, DraftLayer, draft_columns_to_ids
from runtime.engine.events import (
    BlockVerified,
    DecodeEvent,
    Finished,
    FinishReason,
    PrefillDone,
    TokenEvent,
    TokenStatus,
)
from runtime.engine.guards import ensure_finite_logits
from runtime.engine.kv_cache import DraftKVCache
from runtime.engine.linear import FusedLinear, Int8Head
from runtime.engine.lookup import NgramIndex, block_copies
from runtime.engine.sampling import sample
from runtime.engine.target import TargetModel
from runtime.engine.verify_length import FixedVerifyLength, VerifyLengthPolicy
from runtime.errors import ConfigError, InputError, OutOfMemoryError


class DraftHead:
    """The target's lm_head, optionally restricted to the drafter's reduced vocabulary."""

    def __init__(self, target: TargetModel, drafter: DFlashDraftModel) -> None:
        weight = target.lm_head.weight
        bias = getattr(target.lm_head, "bias", None)
        ids = drafter.draft_vocab_ids
        if ids is not None:
            ids = ids.to(weight.device)
            weight = weight[ids]
            bias = bias[ids] if bias is not None else None
        self.weight, self.bias, self.ids = weight, bias, ids
        self.full_weight, self.full_bias = target.lm_head.weight, getattr(target.lm_head, "bias", None)
        self._columns: torch.Tensor | None = None  # full id -> column of the reduced head (-1: outside)
        # a reduced head is a copy: pack it once for oneDNN where that runs (runtime.engine.linear)
        # (the full head is packed too where the target computes in another dtype than its weights)
        pack = (ids is not None or weight.dtype != target.dtype) and type(weight.data) is torch.Tensor
        pack = pack and FusedLinear.can_pack(weight.device, weight.dtype)
        self._packed = FusedLinear([_Plain(weight, bias)], pack=True) if pack else None
        if target.int8 and type(weight) is torch.Tensor:
            # beside an int8 target (its own head in int8), the draft head is read in int8 as well
            self._packed = FusedLinear([Int8Head(_Plain(weight, bias))], pack=False)

    @classmethod
    def for_pair(cls, target: TargetModel, drafter: DFlashDraftModel) -> DraftHead:
        """The head of this pair, built once and kept on the drafter (a reduced head is a gathered,
        packed copy of the target's: not something to redo per request)."""
        cached = drafter.__dict__.get("_dflash_head")
        if cached is not None and cached[0] is target.lm_head.weight:
            head: DraftHead = cached[1]
            return head
        head = cls(target, drafter)
        drafter.__dict__["_dflash_head"] = (target.lm_head.weight, head)
        return head

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits for hidden states [K, D] -> [K, V_d] over the draft vocabulary (column j is full
        id ``ids[j]``, or j without a reduced vocabulary)."""
        if self._packed is not None:
            return self._packed(hidden)[0]
        return F.linear(hidden, self.weight, self.bias)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy draft ids for hidden states [K, D] -> [K] (ids in the full vocabulary)."""
        best = torch.argmax(self.logits(hidden).float(), dim=-1)  # float: see sampling.sample
        return self.ids[best] if self.ids is not None else best

    def with_copies(
        self, logits: torch.Tensor, hidden: torch.Tensor, copy_ids: torch.Tensor, bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft logits with the copy inputs' pointer (``DFlashDraftModel.copy_logit_bias``).

        Args:
            logits: [K, V_d] float32 draft logits of ``hidden`` [K, D].
            copy_ids: [K] full id of each slot's proposed token (any id where there is none).
            bias: [K] what to add to its logit (0 where there is none).

        Returns:
            (logits with ``bias`` added at each proposal's column, [K] the full id of one more
            column or None): a proposal outside a reduced draft vocabulary is scored from the
            target's full head in column V_d (-inf in slots without such a proposal).
        """
        has = bias != 0
        if self.ids is None:
            return logits.index_put_((torch.arange(logits.shape[0], device=logits.device), copy_ids), bias, True), None
        if self._columns is None:
            cols = torch.full((self.full_weight.shape[0],), -1, dtype=torch.long, device=self.ids.device)
            cols[self.ids] = torch.arange(self.ids.numel(), device=self.ids.device)
            self._columns = cols
        col = self._columns[copy_ids]
        inside = has & (col >= 0)
        logits = logits.index_put_(
            (torch.arange(logits.shape[0], device=logits.device), col.clamp(min=0)), bias * inside, True
        )
        outside = has & (col < 0)
        extra = torch.full((logits.shape[0], 1), float("-inf"), dtype=logits.dtype, device=logits.device)
        if bool(outside.any()):
            rows = self.full_weight[copy_ids].to(hidden.dtype)  # [K, D]
            score = (hidden * rows).sum(-1).float() + bias
            if self.full_bias is not None:
                score = score + self.full_bias[copy_ids].float()
            extra[:, 0] = torch.where(outside, score, extra[:, 0])
        return torch.cat([logits, extra], 1), copy_ids

    def to_ids(self, columns: torch.Tensor, extra_ids: torch.Tensor | None) -> torch.Tensor:
        """Columns [K, ...] of ``logits`` (or ``with_copies``' logits) -> full ids."""
        return draft_columns_to_ids(columns, self.ids, extra_ids)


class _Plain:
    """A weight/bias pair shaped like an ``nn.Linear`` for ``FusedLinear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class Committer:
    """Turns committed ids into token events for one generation: stops at a stop id, a stop string
    or the length limit, and appends the detokenizer's tail to the last event (shared by the chain
    and tree loops).

    Args:
        stop_ids: ids that end the generation.
        asm: the generation's text assembler.
    """

    def __init__(self, stop_ids: frozenset[int], asm: TextAssembler) -> None:
        self.stop_ids, self.asm = stop_ids, asm

    def __call__(
        self, ids: Sequence[int], statuses: Sequence[TokenStatus], last: bool
    ) -> tuple[list[TokenEvent], FinishReason | None]:
        """Events for ``ids`` (committed in order) and the finish reason if the generation ends here."""
        events: list[TokenEvent] = []
        reason: FinishReason | None = None
        for tok, status in zip(ids, statuses, strict=True):
            if tok in self.stop_ids:
                events.append(TokenEvent(tok, "", status))
                reason = "stop"
                break
            text, hit = self.asm.push(tok)
            events.append(TokenEvent(tok, text, status))
            if hit:
                reason = "stop"
                break
        if reason is None and last:
            reason = "length"
        if reason is not None and events:
            tail = self.asm.finish()
            if tail:
                e = events[-1]
                events[-1] = TokenEvent(e.token_id, e.text + tail, e.status)
        return events, reason


class _Request(NamedTuple):
    """What one generation needs before its prefill (``DFlashDecoder._begin``)."""

    gen: torch.Generator | None
    asm: TextAssembler
    max_new: int
    limit: int | None
    commit: Committer


class DFlashDecoder:
    """Speculative decoder: DFlash drafter + target verification.

    Args:
        target: the wrapped target model.
        drafter: the drafter, or None for plain decoding (block size 1).
        tokenizer: used for text deltas and stop strings (None: text is "").
        block_size: drafter block length (default: the drafter's own; 1 = plain decoding).
        verify: how many drafts to verify per step (default: the whole block).
        stop_token_ids: ids that end the generation (EOS ids, added by the pipeline).
    """

    name = "dflash"

    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDraftModel | None,
        tokenizer: TokenizerLike | None = None,
        *,
        block_size: int | None = None,
        verify: VerifyLengthPolicy | None = None,
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        if block_size is None:
            block_size = drafter.dflash.block_size if drafter is not None else 1
        if block_size < 1:
            raise ConfigError(f"block size must be >= 1, got {block_size}")
        if block_size > 1 and drafter is None:
            raise ConfigError(f"block size {block_size} needs a drafter; use --decoder ar or name a drafter")
        self.target = target
        self.drafter = drafter if block_size > 1 else None
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.verify = verify or FixedVerifyLength(block_size - 1)
        self.stop_token_ids = frozenset(int(i) for i in stop_token_ids)
        self.head: DraftHead | None = None
        if self.drafter is not None:
            target.set_taps(self.drafter.dflash.target_layer_ids)
            self.head = DraftHead.for_pair(target, self.drafter)
            self.mask_id = self.drafter.dflash.mask_token_id
            self._sliding = any(cast(DraftLayer, layer).self_attn.sliding_window for layer in self.drafter.layers)
        self._copy_index: NgramIndex | None = None  # the copy inputs' index of the current request

    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, cancel: CancelToken | None = None
    ) -> Iterator[DecodeEvent]:
        """Generate from ``prompt_ids`` and yield typed events.

        Args:
            prompt_ids: prompt token ids (at least one).
            params: sampling and stopping.
            cancel: optional token; checked between verify steps.

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

    def propose(
        self,
        anchor: torch.Tensor,
        start: int,
        k: int,
        pending: torch.Tensor | None,
        d_cache: DraftKVCache | None,
        committed: Sequence[int],
    ) -> torch.Tensor:
        """Draft ``k`` tokens after ``anchor`` (at position ``start``) in one drafter forward.

        Args:
            anchor: [1] the last committed token (on the device), not yet seen by the target.
            start: its absolute position.
            k: drafts wanted (<= block_size - 1).
            pending: [1, C, n*D] target features not yet in the drafter cache.
            d_cache: drafter KV cache (holds context entries < start - C).
            committed: prompt + committed ids so far, ending with the anchor (the copy inputs' context).

        Returns:
            [k] draft ids on the target's device.
        """
        logits, extra_ids = self.draft_logits(anchor, start, k, pending, d_cache, committed)
        assert self.head is not None
        return self.head.to_ids(torch.argmax(logits, dim=-1), extra_ids)

    def draft_logits(
        self,
        anchor: torch.Tensor | int,
        start: int,
        k: int,
        pending: torch.Tensor | None,
        d_cache: DraftKVCache | None,
        committed: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Float32 draft logits of slots 1..k from one drafter forward (arguments as ``propose``).

        Returns:
            ([k, V] logits over the draft vocabulary, with the copy inputs' pointer where the drafter
            has one, [k] full id of their extra column or None: ``DraftHead.with_copies``).
        """
        assert self.head is not None and self.drafter is not None
        hidden, copies = self.draft_hidden(anchor, start, pending, d_cache, committed)
        hidden = hidden[1 : 1 + k]
        logits = self.head.logits(hidden).float()  # float: see sampling.sample
        if copies is None:
            return logits, None
        ids, matched = copies[0][1 : 1 + k], copies[1][1 : 1 + k]
        return self.head.with_copies(logits, hidden, ids, self.drafter.copy_logit_bias(matched))

    def draft_hidden(
        self,
        anchor: torch.Tensor | int,
        start: int,
        pending: torch.Tensor | None,
        d_cache: DraftKVCache | None,
        committed: Sequence[int] = (),
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The drafter's final hidden states for the block [anchor, M, ..., M] at ``start``.

        Args:
            anchor: [1] the last committed token (on the device), or its id.
            committed: prompt + committed ids, ending with the anchor: the context a drafter with
                copy inputs (``dflash.copy_ngram``) matches its last tokens in.

        Returns:
            ([b, D]: row k (k >= 1) scores the token at position start + k (``DraftHead``); the copy
            inputs shown to the block, ([b] proposed ids, [b] matched n-gram sizes) on the device,
            or None when the drafter has none or nothing matched).
        """
        assert self.drafter is not None and d_cache is not None and pending is not None
        b = self.block_size
        block_ids = self._block  # [1, b]: [anchor, M, ..., M], reused across steps
        block_ids[0, :1] = anchor
        ctx = self.drafter.fuse_context(pending)  # [1, C, D]
        positions = self._positions[d_cache.seq_len : start + b].unsqueeze(0)  # [1, C + b]
        key_pos = self._positions[: start + b] if self._sliding else None
        embeds = self.target.embed(block_ids)
        ngram = self.drafter.dflash.copy_ngram
        shown: tuple[torch.Tensor, torch.Tensor] | None = None
        if ngram is not None and committed:
            index = self._copy_index
            if index is None or len(index.tokens) > len(committed):
                index = self._copy_index = NgramIndex(*ngram)
            index.extend(committed[len(index.tokens) :])
            corpus = self.drafter.corpus
            if corpus is not None:
                ids, matched = block_copies(index, b, self.mask_id, corpus.query, corpus.ngram)
            else:
                ids, matched = block_copies(index, b, self.mask_id)
            if any(matched):
                dev = embeds.device
                shown = (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(matched, device=dev))
                copies = self.target.embed(shown[0][None])
                embeds = embeds + self.drafter.copy_inputs(copies, shown[1][None])
        hidden = self.drafter(embeds, ctx, positions, cache=d_cache, key_positions=key_pos)
        d_cache.crop(start)  # keep context entries only; the block never stays cached
        return hidden[0], shown

    def _begin(self, prompt: list[int], params: SamplingParams) -> _Request:
        """Check the prompt and set up one request (shared by the chain and tree loops).

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

    def _prefill(
        self, prompt: list[int], params: SamplingParams, gen: torch.Generator | None, room: int
    ) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
        """Target forward on the prompt with a cache for ``room`` positions (and the drafter's reused
        buffers); returns the cache, the first token [1] (on the device) and the prompt's features."""
        target, device = self.target, self.target.device
        t_cache = target.new_cache(capacity=room)
        if self.drafter is not None:
            self._copy_index = None
            self._block = torch.full((1, self.block_size), self.mask_id, dtype=torch.long, device=device)
            self._positions = torch.arange(room + self.block_size, device=device)
        ids = torch.tensor([prompt], dtype=torch.long, device=device)  # [1, P]
        logits, feats = target.forward(ids, t_cache, logits_to_keep=1, capture=self.drafter is not None)
        ensure_finite_logits(logits[-1:], target)  # garbage weights: exit 4 naming the folder, not `0 0 0 ...`
        return t_cache, sample(logits[-1:], params, gen), feats

    @torch.inference_mode()
    def _stream(self, prompt: list[int], params: SamplingParams, cancel: CancelToken | None) -> Iterator[DecodeEvent]:
        target, device = self.target, self.target.device
        n_prompt = len(prompt)
        gen, asm, max_new, limit, commit = self._begin(prompt, params)
        rec = StatsRecorder(n_prompt, self.block_size, "dflash" if self.drafter is not None else "ar")

        # 1. Prefill: target on the prompt, capture features of every position, first token.
        room = n_prompt + max_new + self.block_size + 1  # positions this request can reach
        t_cache, anchor, feats = self._prefill(prompt, params, gen, room)
        first = int(anchor.item())
        _sync(device)
        ttft = time.perf_counter() - rec.t0
        events, reason = commit([first], [TokenStatus.TARGET], last=max_new <= 1)
        rec.prefill(ttft, len(events))
        yield PrefillDone(prompt_tokens=n_prompt, seconds=ttft, tokens=tuple(events))

        d_cache = DraftKVCache(len(self.drafter.layers), capacity=room) if self.drafter is not None else None
        committed = list(prompt) + [first]
        pending = feats  # [1, C, n*D] target features not yet in the drafter cache
        start = n_prompt
        while reason is None:
            if cancel is not None and cancel.cancelled:
                reason = "cancelled"
                break
            t_step = time.perf_counter()
            remaining = max_new - rec.generated
            planned = min(self.verify.length(), self.block_size - 1)
            k = min(planned, remaining - 1)
            if limit is not None:
                k = min(k, limit - start - 1)
            k = max(k, 0)

            # 2. Draft: one drafter forward over [anchor, M, ..., M] at positions start..start+b-1.
            draft = torch.empty(0, dtype=torch.long, device=device)
            if k > 0:
                draft = self.propose(anchor, start, k, pending, d_cache, committed)  # [k]
                pending = pending[:, :0] if pending is not None else None

            # 3. Verify: one target forward over [anchor, d_1..d_k] at positions start..start+k.
            verify_ids = torch.cat([anchor, draft]).unsqueeze(0) if k > 0 else anchor.view(1, 1)  # [1, k+1]
            logits, feats = target.forward(verify_ids, t_cache, capture=self.drafter is not None)
            posterior = sample(logits, params, gen)  # [k+1]
            host = torch.cat([draft, posterior]).tolist()  # the one host sync of the step
            draft_list, post_list = host[:k], host[k:]

            # 4. Accept the longest matching prefix, plus the target's own next token.
            a = accept_prefix(draft_list, post_list)
            new_ids = draft_list[:a] + [post_list[a]]
            statuses = [TokenStatus.ACCEPTED] * a + [TokenStatus.TARGET]
            events, reason = commit(new_ids, statuses, last=rec.generated + a + 1 >= max_new)

            # 5. Roll back: the target cache keeps anchor + accepted drafts; the bonus is the next anchor.
            start += a + 1
            target.crop(t_cache, start)
            if feats is not None:
                pending = torch.cat([pending, feats[:, : a + 1]], dim=1) if pending is not None else feats[:, : a + 1]
            anchor = posterior[a : a + 1]  # the bonus token, already on the device
            committed.extend(new_ids)
            rec.step(drafted=k, accepted=a, committed=len(events), planned=planned)
            self.verify.observe(k, a, time.perf_counter() - t_step)  # the step's time: costs learnt as it runs
            # accepted drafts are shown as the committed tokens' text; decode only the rejected ones
            rejected_text = tuple(asm.decode_one(t) for t in draft_list[a:]) if self.tokenizer is not None else ()
            shown = tuple(events[i].text if i < len(events) else "" for i in range(a))
            draft_text = shown + (rejected_text or ("",) * (k - a))
            yield BlockVerified(
                draft=tuple(draft_list),
                draft_text=draft_text,
                accepted=a,
                tokens=tuple(events),
                seconds=time.perf_counter() - t_step,
            )
        yield Finished(reason=reason, stats=rec.finish())


class AutoregressiveDecoder(DFlashDecoder):
    """Plain decoding: the same loop with a block of one token and no drafter."""

    name = "ar"

    def __init__(
        self, target: TargetModel, tokenizer: TokenizerLike | None = None, *, stop_token_ids: Sequence[int] = ()
    ) -> None:
        super().__init__(target, None, tokenizer, block_size=1, stop_token_ids=stop_token_ids)
