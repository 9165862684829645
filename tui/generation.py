"""Loading the backend and streaming answers: worker threads that post one message per runtime event
(``messages``), handled on the UI thread into the transcript, the live statistics and the store."""

from __future__ import annotations

from typing import Any

from textual import work

from runtime.engine import CancelToken
from runtime.engine.events import BlockVerified, Finished

from .layout import ChatLayout
from .messages import GenerationEvent, GenerationFailed, Loaded, LoadFailed, LoadProgress, error_text
from .stats import GenerationTracker
from .store import session_title
from .widgets import AssistantTurn, Legend, PromptInput, UserTurn


class ChatGeneration(ChatLayout):
    """Loading, sending a prompt, streaming its answer, finishing or failing it."""

    @work(thread=True, exclusive=True, group="load", exit_on_error=False)
    def load_backend(self) -> None:
        """Build the backend in a worker thread; progress and the outcome come back as messages."""
        try:

            def progress(text: str) -> None:
                self.post_message(LoadProgress(text))

            backend = self.backend_factory(progress)
        except Exception as e:
            self.post_message(LoadFailed(e))
        else:
            self.post_message(Loaded(backend))

    def on_chat_app_load_progress(self, message: LoadProgress) -> None:
        self._status(f"loading: {message.text}")

    def on_chat_app_loaded(self, message: Loaded) -> None:
        self.backend = message.backend
        self.load_error = None
        try:
            self.model_info = dict(message.backend.describe())
        except Exception:
            self.model_info = {}
        try:
            self.per_token_status = message.backend.capabilities.per_token_origin
        except Exception:
            self.per_token_status = False
        self.query_one(Legend).refresh()
        label = self.model_label()
        self.sub_title = label
        self._status(f"ready: {label}")

    def on_chat_app_load_failed(self, message: LoadFailed) -> None:
        self.backend = None
        self.load_error = error_text(message.error)
        self._status(f"model not loaded: {self.load_error}  (/reload retries)", error=True)
        self.sub_title = "no model"
        self.notify(self.load_error, title="loading failed", severity="error", timeout=10)

    def model_label(self) -> str:
        """Target (+ drafter), device, dtype, block size: what the header shows."""
        info = self.model_info
        if not info:
            return self.config.model_label
        name = str(info.get("target") or "?")
        if info.get("drafter"):
            name += f" + {info['drafter']}"
        extras = [str(info[k]) for k in ("device", "dtype") if info.get(k)]
        if info.get("block_size"):
            extras.append(f"block {info['block_size']}")
        if self.config.decode.decoder == "ar":
            extras.append("plain decoding")
        label = name + (f" · {' '.join(extras)}" if extras else "")
        if info.get("server"):  # a remote backend
            engine = "dflash serve" if info.get("engine") == "dflash" else info.get("engine") or "server"
            label += f" · {engine} at {info['server']}"
        return label

    # -- sending -----------------------------------------------------------------------------
    def on_prompt_input_submitted(self, message: PromptInput.Submitted) -> None:
        self.submit(message.text)

    def submit(self, text: str) -> None:
        """Send a prompt or run a /command (the text stays in the prompt when it cannot be sent)."""
        if not text.strip():
            return
        if text.startswith("/") and not text.startswith("//"):
            self.run_command(text)
            return
        if text.startswith("//"):
            text = text[1:]
        if self.generating:
            self.notify("an answer is still streaming; Esc stops it", severity="warning")
            return
        if self.backend is None:
            if self.load_error:
                self.notify(f"no model: {self.load_error} (/reload retries)", severity="error")
            else:
                self.notify("the model is still loading", severity="warning")
            return
        self.store.add_prompt(text)
        self.prompt.clear()
        self.prompt.reset_history()
        self.pending_prompt = text
        self.messages.append({"role": "user", "content": text})
        conversation = ([{"role": "system", "content": self.system}] if self.system else []) + list(self.messages)
        self.transcript.mount(UserTurn(text))
        turn = AssistantTurn(view=self.view, origin=self.per_token_status)
        self.transcript.mount(turn)
        turn.set_header("waiting for the first token…")
        self.transcript.anchor()
        self.turn = turn
        block = int(self.model_info.get("block_size") or 1)
        self.tracker = GenerationTracker(slots=max(block - 1, 0), origin=self.per_token_status)
        self.cancel = CancelToken()
        self.gen_id += 1
        self.stats_bar.show(self.tracker, self.totals, running=True)
        self.generate(conversation, self.cancel, self.gen_id)

    @work(thread=True, exclusive=True, group="generation", exit_on_error=False)
    def generate(self, conversation: list[dict[str, str]], cancel: CancelToken, gen_id: int) -> None:
        """Stream one answer in a worker thread, one message per event."""
        backend = self.backend
        assert backend is not None
        finished = False
        try:
            for event in backend.stream_messages(conversation, self.config.params, self.config.decode, cancel):
                self.post_message(GenerationEvent(gen_id, event))
                finished = finished or isinstance(event, Finished)
        except Exception as e:
            self.post_message(GenerationFailed(gen_id, e))
            return
        if not finished:
            self.post_message(GenerationFailed(gen_id, RuntimeError("the backend ended without finishing")))

    def on_chat_app_generation_event(self, message: GenerationEvent) -> None:
        if message.gen_id != self.gen_id or self.turn is None or self.tracker is None:
            return
        event, turn, tracker = message.event, self.turn, self.tracker
        tracker.update(event)
        if isinstance(event, Finished):
            self.finish(event)
            return
        if event.tokens or (isinstance(event, BlockVerified) and event.draft):
            turn.add_event(event)
        if event.type == "prefill":
            turn.set_header("streaming… (Esc stops)")
        self.stats_bar.show(tracker, self.totals, running=True)

    def finish(self, event: Finished) -> None:
        """Close the answer: summary, Markdown, statistics, storage."""
        turn, tracker = self.turn, self.tracker
        assert turn is not None and tracker is not None
        self.cancel = None
        self.totals.add(tracker)
        self.answers += 1
        turn.number = self.answers
        turn.finish(event.reason, self.summary(tracker))
        answer = turn.text
        if event.reason != "cancelled" or answer:
            self.messages.append({"role": "assistant", "content": answer})
        else:  # stopped before any text: forget the question, as if it was never sent
            self.messages.pop()
        self.save_turn(self.pending_prompt, answer, event.reason, tracker.to_json())
        self.stats_bar.show(tracker, self.totals, running=False)
        if event.reason == "cancelled":
            self.notify("stopped; the partial answer is kept", timeout=3)

    def summary(self, tracker: GenerationTracker) -> str:
        """The header line of a finished answer."""
        line = (
            f"{tracker.generated_tokens} tok · {tracker.tokens_per_second:.1f} tok/s"
            f" · TTFT {tracker.ttft_seconds * 1000:.0f} ms"
        )
        if tracker.tokens_cached:  # the prompt cache held the conversation so far
            line += f" ({tracker.tokens_cached}/{tracker.prompt_tokens} prompt tokens cached)"
        if tracker.drafted:
            line += f" · τ {tracker.tau:.2f} · accept {tracker.acceptance_rate * 100:.0f}%"
        if tracker.copied:
            line += f" · {tracker.copied} copied"
        return line + f" · {tracker.reason}"

    def on_chat_app_generation_failed(self, message: GenerationFailed) -> None:
        if message.gen_id != self.gen_id:
            return
        text = error_text(message.error)
        self.cancel = None
        if self.turn is not None:
            self.turn.fail(text)
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()
        if not self.prompt.text.strip():
            self.prompt.set_prompt(self.pending_prompt)  # nothing is lost: the prompt comes back
        self.stats_bar.show(self.tracker, self.totals, running=False)
        self.notify(text, title="generation failed", severity="error", timeout=10)
        self.prompt.focus()

    def save_turn(self, prompt: str, answer: str, reason: str, stats: dict[str, Any]) -> None:
        """Persist a finished turn (the session is created with its first turn)."""
        if self.session_id is None:
            self.session_id = self.store.new_session(
                session_title(prompt), self.model_info.get("target"), self.model_info.get("drafter"), self.system
            )
        self.store.add_message(self.session_id, "user", prompt)
        self.store.add_message(self.session_id, "assistant", answer, reason=reason, stats=stats)
