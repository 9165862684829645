"""A training prompt (``TrainPrompt``) and a dataset's prompt list on disk (``prompts.jsonl``).

The leaf every prompt builder (``prompts``, ``generator``, ``answers``, ``selfinstruct``,
``text``, ``heldout``) and the dataset code share: it imports nothing of ``runtime.train``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PROMPTS_FILE = "prompts.jsonl"


@dataclass(frozen=True)
class TrainPrompt:
    """One prompt: ``chat`` prompts go through the chat template, raw ones are plain completions.

    Attributes:
        text: the (last) user turn, or the raw text to complete.
        chat: apply the chat template.
        source: ``kind:detail`` (the kind before the colon feeds the dataset's mix report).
        messages: a whole conversation (multi-turn prompts); None: one user turn with ``text``.
    """

    text: str
    chat: bool
    source: str
    messages: tuple[dict[str, str], ...] | None = None

    @property
    def kind(self) -> str:
        """The prompt's kind (``source`` up to the first colon)."""
        return self.source.split(":", 1)[0]


def read_prompts(data_dir: Path) -> list[TrainPrompt]:
    """A dataset's prompt list (``data_dir/prompts.jsonl``), in order."""
    out = []
    for line in (data_dir / PROMPTS_FILE).read_text(encoding="utf-8").splitlines():
        if line.strip():
            r = json.loads(line)
            msgs = tuple(r["messages"]) if r.get("messages") else None
            out.append(TrainPrompt(r["text"], bool(r["chat"]), r["source"], msgs))
    return out


def write_prompts(data_dir: Path, prompts: Sequence[TrainPrompt]) -> None:
    """Write ``data_dir/prompts.jsonl`` atomically (a temporary file renamed over it)."""
    path = data_dir / PROMPTS_FILE
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for p in prompts:
            row = {"text": p.text, "chat": p.chat, "source": p.source}
            if p.messages:
                row["messages"] = list(p.messages)
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)
