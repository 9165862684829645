"""Text from outside (stdin, files, arguments) must be valid UTF-8: the runtime never guesses.

Invalid input is an ``InputError`` (exit 2) that names the byte offset of the first bad byte, never
silently replaced: a prompt that changes on the way in gives a completion for another prompt.
"""

from __future__ import annotations

from runtime.errors import InputError

HINT = "convert it to UTF-8 first (e.g. iconv -f latin1 -t utf-8)"


def decode_utf8(data: bytes, source: str) -> str:
    """Decode ``data`` as UTF-8.

    Args:
        data: raw bytes.
        source: what they are, for the message ("stdin", "prompts.txt").

    Raises:
        InputError: not valid UTF-8; the message names the first bad byte and its offset.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"{source} is not valid UTF-8: byte 0x{data[e.start]:02x} at byte offset {e.start} ({e.reason}); {HINT}"
        ) from None


def check_text(text: str, source: str) -> str:
    """Return ``text`` if it encodes as UTF-8.

    Text from ``sys.argv`` or a leniently decoded stream carries undecodable bytes as surrogates
    (U+DC80..U+DCFF, Python's ``surrogateescape``); JSON can carry lone surrogates (``"\\ud800"``).

    Raises:
        InputError: a smuggled byte (named with its byte offset) or a lone surrogate.
    """
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError as e:
        ch = ord(text[e.start])
        if 0xDC80 <= ch <= 0xDCFF:
            offset = len(text[: e.start].encode("utf-8", "surrogateescape"))
            raise InputError(
                f"{source} is not valid UTF-8: byte 0x{ch - 0xDC00:02x} at byte offset {offset}; {HINT}"
            ) from None
        raise InputError(
            f"{source} holds a lone surrogate (U+{ch:04X}) at character {e.start}, which is not valid Unicode text"
        ) from None
