"""Typed events that every decoder yields, in order: one ``PrefillDone``, any number of
``BlockVerified``, then one ``Finished``.

Every committed token appears exactly once across the ``tokens`` of ``PrefillDone`` and the
``BlockVerified`` events, in output order. Rejected drafts ride along in ``BlockVerified`` for
display only and never enter the output text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

from runtime.engine.acceptance import AcceptanceCounts

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

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TokenEvent:
        """Inverse of ``to_json`` (a missing status reads as TARGET)."""
        return cls(int(d.get("id", -1)), str(d.get("text", "")), TokenStatus(d.get("status", "target")))


@dataclass(frozen=True)
class PrefillDone:
    """The prompt went through the target; the first generated token is known.

    Attributes:
        prompt_tokens: number of prompt tokens.
        seconds: time to first token (prefill + first sample), device-synchronised.
        tokens: the first generated token (status TARGET); empty if it was a stop token only
            visible as the end of the generation.
        tokens_cached: leading prompt tokens taken from the prompt cache (not read again).
    """

    prompt_tokens: int
    seconds: float
    tokens: tuple[TokenEvent, ...]
    tokens_cached: int = 0

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
        copied: for a tree, how many nodes at the end of ``draft`` the context lookup added
            (copied from the prompt or answer; the drafter did not propose them).
    """

    draft: tuple[int, ...]
    draft_text: tuple[str, ...]
    accepted: int
    tokens: tuple[TokenEvent, ...]
    seconds: float
    parents: tuple[int, ...] = ()
    path: tuple[int, ...] = ()
    copied: int = 0

    type: Literal["block"] = field(default="block", init=False)

    @property
    def copied_path(self) -> tuple[int, ...]:
        """Positions in ``path`` (so among the accepted tokens) whose node the context lookup copied."""
        first = len(self.draft) - self.copied
        return tuple(i for i, node in enumerate(self.path) if self.copied and node >= first)

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
    """Totals of one generation: timings and the raw acceptance counts (every acceptance
    statistic is derived from ``acceptance``, see ``runtime.engine.acceptance``).

    Attributes:
        prompt_tokens: prompt length in tokens.
        generated_tokens: committed tokens (stop token included when one ended the run).
        ttft_seconds: time to first token.
        total_seconds: wall time from start to finish.
        tokens_per_second: generated tokens / total time (end to end, prefill included).
        decode_tokens_per_second: tokens after the first / time after the first token.
        acceptance: raw counts of the verify steps after prefill.
        block_size: drafter block size (1 for plain decoding).
        verify_length: drafts verified per step (the last value used).
        decoder: "dflash" or "ar".
        tree_budget: drafted nodes per verify with tree verification (0: chain). With a tree,
            ``drafted_tokens`` counts tree nodes and the per-position statistics and histogram
            count accepted depth.
        lookup: most context tokens copied per step into the tree (0: lookup off).
        copied_tokens: accepted tokens that only the context lookup proposed (the drafter's tree
            did not hold them); included in ``accepted_tokens``.
        tokens_cached: leading prompt tokens taken from the prompt cache (the prefill read the rest).
    """

    prompt_tokens: int
    generated_tokens: int
    ttft_seconds: float
    total_seconds: float
    tokens_per_second: float
    decode_tokens_per_second: float
    acceptance: AcceptanceCounts
    block_size: int
    verify_length: int
    decoder: str
    tree_budget: int = 0
    lookup: int = 0
    copied_tokens: int = 0
    tokens_cached: int = 0

    @property
    def verify_steps(self) -> int:
        """Target verify forwards after prefill."""
        return self.acceptance.steps

    @property
    def drafted_tokens(self) -> int:
        """Drafts proposed to the target."""
        return self.acceptance.drafted

    @property
    def accepted_tokens(self) -> int:
        """Drafts the target accepted."""
        return self.acceptance.accepted

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify step, bonus included (1.0 for plain decoding)."""
        return self.acceptance.tau

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted (0.0 when nothing was drafted)."""
        return self.acceptance.acceptance_rate

    @property
    def per_position_acceptance(self) -> tuple[float, ...]:
        """For draft slot k (index k-1), the share of steps that verified slot k in which
        drafts 1..k were all accepted."""
        return self.acceptance.per_position

    @property
    def acceptance_histogram(self) -> tuple[int, ...]:
        """Entry i counts verify steps that accepted exactly i drafts."""
        return self.acceptance.histogram

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form: the fields, the raw counts under ``acceptance`` and the derived
        statistics (``tau``, ``acceptance_rate``, ...) for readers that do not derive them."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "ttft_seconds": self.ttft_seconds,
            "total_seconds": self.total_seconds,
            "tokens_per_second": self.tokens_per_second,
            "decode_tokens_per_second": self.decode_tokens_per_second,
            "verify_steps": self.verify_steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance": list(self.per_position_acceptance),
            "acceptance_histogram": list(self.acceptance_histogram),
            "block_size": self.block_size,
            "verify_length": self.verify_length,
            "tree_budget": self.tree_budget,
            "lookup": self.lookup,
            "copied_tokens": self.copied_tokens,
            "tokens_cached": self.tokens_cached,
            "decoder": self.decoder,
            "acceptance": self.acceptance.to_json(),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> GenerationStats:
        """Inverse of ``to_json``. Without ``acceptance`` (an older server), the counts are
        rebuilt from the totals and the histogram."""
        if isinstance(d.get("acceptance"), Mapping):
            counts = AcceptanceCounts.from_json(d["acceptance"])
        else:
            counts = AcceptanceCounts.from_totals(
                int(d.get("verify_steps") or 0),
                int(d.get("drafted_tokens") or 0),
                int(d.get("accepted_tokens") or 0),
                d.get("acceptance_histogram") or (),
            )
        return cls(
            prompt_tokens=int(d.get("prompt_tokens") or 0),
            generated_tokens=int(d.get("generated_tokens") or 0),
            ttft_seconds=float(d.get("ttft_seconds") or 0.0),
            total_seconds=float(d.get("total_seconds") or 0.0),
            tokens_per_second=float(d.get("tokens_per_second") or 0.0),
            decode_tokens_per_second=float(d.get("decode_tokens_per_second") or 0.0),
            acceptance=counts,
            block_size=int(d.get("block_size") or 1),
            verify_length=int(d.get("verify_length") or 0),
            decoder=str(d.get("decoder") or "dflash"),
            tree_budget=int(d.get("tree_budget") or 0),
            lookup=int(d.get("lookup") or 0),
            copied_tokens=int(d.get("copied_tokens") or 0),
            tokens_cached=int(d.get("tokens_cached") or 0),
        )


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
    """Serialise an event: the one JSON form of ``dflash run --json``, of the ``dflash`` field of
    the server's chunks and of what the remote client reads back (``event_from_json``).

    Lines have ``"type"`` in {"prefill", "block", "done"}; prefill and block carry ``"tokens"``
    as ``{"id", "text", "status"}``; block also carries ``"draft"``, ``"draft_text"``,
    ``"accepted"`` and ``"rejected_text"`` (and, for a draft tree, ``"parents"``, ``"path"`` and,
    when the context lookup added nodes, ``"copied"``: how many at the end of ``"draft"``); done
    carries ``"reason"`` and ``"stats"``.
    """
    if isinstance(event, PrefillDone):
        return {
            "type": "prefill",
            "prompt_tokens": event.prompt_tokens,
            "tokens_cached": event.tokens_cached,
            "ttft": event.seconds,
            "tokens": [t.to_json() for t in event.tokens],
        }
    if isinstance(event, BlockVerified):
        out: dict[str, Any] = {
            "type": "block",
            "draft": list(event.draft),
            "draft_text": list(event.draft_text),
            "accepted": event.accepted,
            "tokens": [t.to_json() for t in event.tokens],
            "rejected_text": list(event.rejected_text),
            "seconds": event.seconds,
        }
        if event.parents:  # a draft tree: node i of "draft" hangs under "parents"[i] (-1: the anchor)
            out["parents"] = list(event.parents)
            out["path"] = list(event.path)
            out["draft_text"] = list(event.draft_text)
            if event.copied:
                out["copied"] = event.copied
        return out
    return {"type": "done", "reason": event.reason, "stats": event.stats.to_json()}


def event_from_json(d: Mapping[str, Any]) -> DecodeEvent:
    """Inverse of ``event_to_json``.

    Raises:
        KeyError, ValueError, TypeError: not an event (unknown ``type``, bad token status).
    """
    kind = d["type"]
    if kind == "prefill":
        return PrefillDone(
            prompt_tokens=int(d.get("prompt_tokens", 0)),
            seconds=float(d.get("ttft", 0.0)),
            tokens=tuple(TokenEvent.from_json(t) for t in d.get("tokens", [])),
            tokens_cached=int(d.get("tokens_cached") or 0),
        )
    if kind == "block":
        tokens = tuple(TokenEvent.from_json(t) for t in d.get("tokens", []))
        accepted = int(d.get("accepted", 0))
        draft_text = d.get("draft_text")
        if draft_text is None:  # an older server: accepted drafts are the first tokens
            draft_text = [t.text for t in tokens[:accepted]] + list(d.get("rejected_text", []))
        return BlockVerified(
            draft=tuple(int(i) for i in d.get("draft", [])),
            draft_text=tuple(str(s) for s in draft_text),
            accepted=accepted,
            tokens=tokens,
            seconds=float(d.get("seconds", 0.0)),
            parents=tuple(int(i) for i in d.get("parents", [])),  # a draft tree (empty for a chain)
            copied=int(d.get("copied") or 0),
            path=tuple(int(i) for i in d.get("path", [])),
        )
    if kind == "done":
        reason = d.get("reason", "stop")
        if reason not in ("stop", "length", "cancelled"):
            raise ValueError(f"unknown finish reason {reason!r}")
        return Finished(reason=reason, stats=GenerationStats.from_json(d.get("stats") or {}))
    raise ValueError(f"unknown event type {kind!r}")
