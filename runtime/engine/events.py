"""Typed events that every decoder yields, in order: one ``PrefillDone``, any number of
``BlockVerified``, then one ``Finished``.

Every committed token appears exactly once across the ``tokens`` of ``PrefillDone`` and the
``BlockVerified`` events, in output order. Rejected drafts ride along in ``BlockVerified`` for
display only and never enter the output text.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Literal

FinishReason = Literal["stop", "length", "cancelled"]


class TokenStatus(str, Enum):
    """Origin of a committed token."""

    ACCEPTED = "accepted"  # drafted by the drafter and verified by the target
    TARGET = "target"  # chosen by the target itself (first token, bonus/correction, plain decoding)


@dataclass(frozen=True)
class TokenEvent:
    """One committed token and the text it adds to the output (may be "" mid-character)."""

    token_id: int
    text: str
    status: TokenStatus

    def to_json(self) -> dict[str, Any]:
        """JSON form used by ``dflash run --json`` and the server."""
        return {"id": self.token_id, "text": self.text, "status": self.status.value}


@dataclass(frozen=True)
class PrefillDone:
    """The prompt went through the target; the first generated token is known.

    Attributes:
        prompt_tokens: number of prompt tokens.
        seconds: time to first token (prefill + first sample), device-synchronised.
        tokens: the first generated token (status TARGET); empty if it was a stop token only
            visible as the end of the generation.
    """

    prompt_tokens: int
    seconds: float
    tokens: tuple[TokenEvent, ...]

    type: Literal["prefill"] = field(default="prefill", init=False)

    @property
    def text(self) -> str:
        """Text added to the output by this event."""
        return "".join(t.text for t in self.tokens)


@dataclass(frozen=True)
class BlockVerified:
    """One verify step of the target.

    Attributes:
        draft: the drafted ids the target verified, in order (empty for plain decoding).
        draft_text: display text of each drafted id, decoded on its own.
        accepted: how many leading drafts the target accepted.
        tokens: newly committed tokens: the accepted drafts (ACCEPTED) then the target's own
            token (TARGET), possibly cut short by a stop token, a stop string or the length limit.
        seconds: wall time of this step (draft + verify), device-synchronised.
        parents: empty for a chain; for a draft tree (``--tree-budget``), the parent of each
            drafted node as an index into ``draft`` (-1: a child of the anchor, the last
            committed token). ``draft`` then lists the tree's nodes best-first, parents first.
        path: for a tree, the accepted nodes (indices into ``draft``) from the anchor down;
            ``accepted == len(path)``. Empty for a chain (the accepted drafts lead ``draft``).
    """

    draft: tuple[int, ...]
    draft_text: tuple[str, ...]
    accepted: int
    tokens: tuple[TokenEvent, ...]
    seconds: float
    parents: tuple[int, ...] = ()
    path: tuple[int, ...] = ()

    type: Literal["block"] = field(default="block", init=False)

    @property
    def is_tree(self) -> bool:
        """True when the step verified a draft tree."""
        return bool(self.parents)

    @property
    def depth(self) -> int:
        """Draft slots the step tested: the chain's length, or the tree's deepest level."""
        if not self.parents:
            return len(self.draft)
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return max(depths)

    def _branches(self) -> list[list[int]]:
        if not self.parents:
            return [list(range(self.accepted, len(self.draft)))] if self.accepted < len(self.draft) else []
        from runtime.engine.tree import losing_branches

        return losing_branches(self.parents, self.path)

    @property
    def rejected(self) -> tuple[int, ...]:
        """Drafted ids the target rejected along the drafter's best continuation (display only):
        the chain's tail, or a tree's best-ranked branch below the last accepted node."""
        branches = self._branches()
        return tuple(self.draft[i] for i in branches[0]) if branches else ()

    @property
    def rejected_text(self) -> tuple[str, ...]:
        """Display text of the rejected drafts (see ``rejected``)."""
        branches = self._branches()
        return tuple(self.draft_text[i] for i in branches[0]) if branches else ()

    @property
    def losing_branches_text(self) -> tuple[str, ...]:
        """Display text of every branch that lost where the walk stopped, best-ranked first
        (one entry, the rejected tail, for a chain)."""
        return tuple("".join(self.draft_text[i] for i in b) for b in self._branches())

    @property
    def text(self) -> str:
        """Text added to the output by this event."""
        return "".join(t.text for t in self.tokens)


@dataclass(frozen=True)
class GenerationStats:
    """Totals of one generation.

    Attributes:
        prompt_tokens: prompt length in tokens.
        generated_tokens: committed tokens (stop token included when one ended the run).
        ttft_seconds: time to first token.
        total_seconds: wall time from start to finish.
        tokens_per_second: generated tokens / total time (end to end, prefill included).
        decode_tokens_per_second: tokens after the first / time after the first token.
        verify_steps: target verify forwards after prefill.
        drafted_tokens: drafts proposed to the target.
        accepted_tokens: drafts the target accepted.
        tau: mean tokens committed per verify step, bonus included (1.0 for plain decoding).
        acceptance_rate: accepted / drafted (0.0 when nothing was drafted).
        per_position_acceptance: for draft slot k (index k-1), the share of steps that verified
            slot k in which drafts 1..k were all accepted.
        acceptance_histogram: entry i counts verify steps that accepted exactly i drafts.
        block_size: drafter block size (1 for plain decoding).
        verify_length: drafts verified per step (the last value used).
        decoder: "dflash" or "ar".
        tree_budget: drafted nodes per verify with tree verification (0: chain). With a tree,
            ``drafted_tokens`` counts tree nodes and the per-position statistics and histogram
            count accepted depth.
    """

    prompt_tokens: int
    generated_tokens: int
    ttft_seconds: float
    total_seconds: float
    tokens_per_second: float
    decode_tokens_per_second: float
    verify_steps: int
    drafted_tokens: int
    accepted_tokens: int
    tau: float
    acceptance_rate: float
    per_position_acceptance: tuple[float, ...]
    acceptance_histogram: tuple[int, ...]
    block_size: int
    verify_length: int
    decoder: str
    tree_budget: int = 0

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form (lists instead of tuples)."""
        d = asdict(self)
        d["per_position_acceptance"] = list(self.per_position_acceptance)
        d["acceptance_histogram"] = list(self.acceptance_histogram)
        return d


@dataclass(frozen=True)
class Finished:
    """The generation ended.

    Attributes:
        reason: "stop" (EOS, stop id or stop string), "length" (max tokens or context full),
            or "cancelled" (the caller asked to stop).
        stats: totals of the generation.
    """

    reason: FinishReason
    stats: GenerationStats

    type: Literal["done"] = field(default="done", init=False)


DecodeEvent = PrefillDone | BlockVerified | Finished


def event_to_json(event: DecodeEvent) -> dict[str, Any]:
    """Serialise an event to the NDJSON contract of ``dflash run --json``.

    Lines have ``"type"`` in {"prefill", "block", "done"}; prefill and block carry ``"tokens"``
    as ``{"id", "text", "status"}``; block also carries ``"draft"`` and ``"accepted"`` (and, for a
    draft tree, ``"parents"``, ``"path"`` and ``"draft_text"``); done
    carries ``"reason"`` and ``"stats"``.
    """
    if isinstance(event, PrefillDone):
        return {
            "type": "prefill",
            "prompt_tokens": event.prompt_tokens,
            "ttft": event.seconds,
            "tokens": [t.to_json() for t in event.tokens],
        }
    if isinstance(event, BlockVerified):
        out: dict[str, Any] = {
            "type": "block",
            "draft": list(event.draft),
            "accepted": event.accepted,
            "tokens": [t.to_json() for t in event.tokens],
            "rejected_text": list(event.rejected_text),
            "seconds": event.seconds,
        }
        if event.parents:  # a draft tree: node i of "draft" hangs under "parents"[i] (-1: the anchor)
            out["parents"] = list(event.parents)
            out["path"] = list(event.path)
            out["draft_text"] = list(event.draft_text)
        return out
    return {"type": "done", "reason": event.reason, "stats": event.stats.to_json()}
