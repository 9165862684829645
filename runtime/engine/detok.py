"""Incremental detokenisation and stop strings.

Text is produced token by token without ever splitting a multi-byte character: a token whose
bytes end mid-character yields "" and the character appears with the token that completes it.
Text that could be the start of a stop string is held back until it is known not to be.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class TokenizerLike(Protocol):
    """The part of a Hugging Face tokenizer the runtime uses."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...  # noqa: D102

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...  # noqa: D102


REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas.

    Args:
        tokenizer: a tokenizer, or None (every delta is "").
        context_ids: a few preceding ids (the prompt tail) so that the first token keeps its
            leading space with SentencePiece-style tokenizers; their text is never emitted.
    """

    def __init__(self, tokenizer: TokenizerLike | None, context_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(context_ids)[-6:]
        self.prefix = 0
        self.read = len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Add one token; return the new complete text (may be "")."""
        if self.tokenizer is None:
            return ""
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end)."""
        if self.tokenizer is None or self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]


class TextAssembler:
    """Detokenise committed tokens and watch for stop strings.

    ``push`` returns the text to emit for a token and whether a stop string was completed; after a
    stop string, the output ends right before it.
    """

    def __init__(
        self, tokenizer: TokenizerLike | None, stop_strings: Sequence[str] = (), context_ids: Sequence[int] = ()
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, context_ids)
        self.stop_strings = tuple(stop_strings)
        self.held = ""  # emitted-pending text that may begin a stop string

    def _hold_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop_strings:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    best = max(best, n)
                    break
        return best

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add one committed token.

        Returns:
            (text to emit now, True if a stop string ended the output).
        """
        new = self.detok.push(token_id)
        if not self.stop_strings:
            return new, False
        text = self.held + new
        cut = min((i for i in (text.find(s) for s in self.stop_strings) if i >= 0), default=-1)
        if cut >= 0:
            self.held = ""
            return text[:cut], True
        hold = self._hold_len(text)
        self.held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def finish(self) -> str:
        """Everything still held back, to append to the last emitted token."""
        text = self.held + self.detok.flush()
        self.held = ""
        if self.stop_strings:
            cut = min((i for i in (text.find(s) for s in self.stop_strings) if i >= 0), default=-1)
            if cut >= 0:
                return text[:cut]
        return text

    def decode_one(self, token_id: int) -> str:
        """Display text of a single id (rejected drafts), decoded on its own."""
        if self.detok.tokenizer is None:
            return ""
        return self.detok.tokenizer.decode([int(token_id)], skip_special_tokens=False)


def describe_tokenizer(tokenizer: Any) -> str:
    """Short name of a tokenizer class for diagnostics."""
    return type(tokenizer).__name__ if tokenizer is not None else "none"
