"""What a training run is asked to build: the drafter's architecture (``DrafterSpec``) and its
dataset (``DataSpec``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.errors import ConfigError

COPY_NGRAM = (1, 4)  # context n-gram sizes of ``dflash train --copy-inputs``


@dataclass(frozen=True)
class DrafterSpec:
    """Architecture of a new drafter.

    Attributes:
        num_layers: decoder layers.
        block_size: slots per block.
        taps: target layers feeding the drafter (None: the formula of docs/method.md).
        intermediate_size: MLP width (None: half the target's).
        draft_vocab: reduced draft vocabulary size (0: the full vocabulary; "auto": the smallest
            size whose held-out OOV share is at most ``max_oov``, see ``runtime.train.vocab``).
        mask_token_id: id of M (None: first unused embedding row).
        max_oov: the OOV share ``draft_vocab="auto"`` aims for.
        init: "random" (docs/experiments/2026-11-30-cpu-training-feasibility.md) or "target" (copy the target's last layer(s)
            where shapes allow, ``init_from_target``).
        from_drafter: start from this existing drafter folder instead (fine-tune / warm start): its
            architecture (layers, taps, block size, widths, mask token) and weights are kept, the
            draft vocabulary is chosen anew from the data (the source's ids ranked first); the other
            architecture fields are ignored.
        grow_to: with ``from_drafter``, append identity-initialised layers up to this many
            (``warm_start``; None keeps the source's layer count).
        copy_ngram: give the drafter copy inputs for these (shortest, longest) context n-gram
            matches (``runtime.engine.models.drafter_surgery.add_copy_inputs``; they start at zero, so a warm-started
            drafter drafts as before until trained); None: none added (a source drafter keeps its own).
        copy_corpus: give the drafter (which must have copy inputs) a corpus table of these
            (shortest, longest) n-grams, counted over the run's training answers
            (``runtime.engine.models.corpus``); None: none added (a source drafter's is recounted).
    """

    num_layers: int = 1
    block_size: int = 8
    taps: tuple[int, ...] | None = None
    intermediate_size: int | None = None
    draft_vocab: int | str = 16384
    mask_token_id: int | None = None
    max_oov: float = 0.01
    init: str = "random"
    from_drafter: Path | None = None
    grow_to: int | None = None
    copy_ngram: tuple[int, int] | None = None
    copy_corpus: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.block_size < 2:
            raise ConfigError("a drafter needs >= 1 layer and a block size >= 2")
        if self.draft_vocab != "auto" and (not isinstance(self.draft_vocab, int) or self.draft_vocab < 0):
            raise ConfigError(f"draft vocab must be 'auto', 'full' (0) or a size >= 1, got {self.draft_vocab!r}")
        if self.init not in ("random", "target"):
            raise ConfigError(f"init must be 'random' or 'target', got {self.init!r}")


@dataclass(frozen=True)
class DataSpec:
    """How to build the training data.

    Attributes:
        num_prompts: prompts to answer (None: all built-in prompts).
        max_new_tokens: answer length cap.
        batch_size: sequences generated together.
        seed: prompt shuffle seed.
        taps: layers to store (None: the drafter's taps).
        topk: keep the target's top-k log-probabilities per answer position (soft labels; 0: none).
        generator: prompt generator ("v2": the broad mix of ``runtime.train.generator``;
            "answers": requests on the code of an earlier dataset's answers, ``runtime.train.answers``;
            "text": real source files scored by the target, no generation, ``runtime.train.text``;
            "fim": holes cut from real source files, answered by the target in its FIM layout,
            ``runtime.train.fim_prompts``;
            "self": requests written by the target itself, ``runtime.train.selfinstruct``;
            "files": requests for whole application source files in every language,
            ``runtime.train.file_requests``).
        source: the earlier dataset folder of the "answers" generator.
        text_roots: source folders of the "text" and "fim" generators (empty: ``text.default_roots()``).
    """

    num_prompts: int | None = None
    max_new_tokens: int = 320
    batch_size: int = 32
    seed: int = 0
    taps: tuple[int, ...] | None = None
    topk: int = 8
    generator: str = "v2"
    source: Path | None = None
    text_roots: tuple[Path, ...] = ()
