"""Committing a step's tokens: events, stop ids, stop strings and the length limit."""

from __future__ import annotations

from collections.abc import Sequence

from runtime.engine.detok import TextAssembler
from runtime.engine.events import FinishReason, TokenEvent, TokenStatus


class Committer:
    """Turns committed ids into token events for one generation: stops at a stop id, a stop string
    or the length limit, and appends the detokenizer's tail to the last event.

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
