"""What the chat app's worker threads post to it (``post_message`` is thread-safe): loading progress
and outcome, one message per runtime event of a generation, a generation's failure; and the one
line a failure is shown as. Handlers keep the ``on_chat_app_...`` names (namespace ``chat_app``)."""

from __future__ import annotations

from textual.message import Message

from runtime.backend import Backend
from runtime.engine.events import DecodeEvent


def error_text(error: BaseException) -> str:
    """One line for a failure (DFlashError messages already name the value and the fix)."""
    from runtime.errors import DFlashError

    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if isinstance(error, DFlashError):
        return text or type(error).__name__
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


# -- messages from worker threads (post_message is thread-safe) ---------------------------
class LoadProgress(Message, namespace="chat_app"):
    """A line of loading progress."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class Loaded(Message, namespace="chat_app"):
    """The backend is ready."""

    def __init__(self, backend: Backend) -> None:
        super().__init__()
        self.backend = backend


class LoadFailed(Message, namespace="chat_app"):
    """The backend could not be built."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error


class GenerationEvent(Message, namespace="chat_app"):
    """One runtime event of generation ``gen_id``."""

    def __init__(self, gen_id: int, event: DecodeEvent) -> None:
        super().__init__()
        self.gen_id = gen_id
        self.event = event


class GenerationFailed(Message, namespace="chat_app"):
    """Generation ``gen_id`` raised."""

    def __init__(self, gen_id: int, error: BaseException) -> None:
        super().__init__()
        self.gen_id = gen_id
        self.error = error
