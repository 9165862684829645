"""Where a dataset's prompts come from: the built-in generators (v1, v2), an earlier dataset's
answers, the target's own requests or source files, fixed in the dataset's ``prompts.jsonl`` the
first time and ordered so that each generation batch holds prompts of similar length."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runtime.errors import ConfigError
from runtime.train.answers import build_prompts_from_answers, read_answers
from runtime.train.data import Progress
from runtime.train.file_requests import build_file_requests
from runtime.train.fim_prompts import build_fim_prompts
from runtime.train.generator import build_prompts_v2
from runtime.train.prompt_list import PROMPTS_FILE, TrainPrompt, read_prompts, write_prompts
from runtime.train.prompts import build_prompts_v1
from runtime.train.selfinstruct import build_self_prompts
from runtime.train.specs import DataSpec
from runtime.train.text import build_text_prompts, default_roots

SELF_JOURNAL = "self-requests.jsonl"


def build_prompts(
    seed: int = 0,
    stdlib_root: Path | None = None,
    max_prompts: int | None = None,
    generator: str = "v2",
    dedupe: bool = True,
) -> list[TrainPrompt]:
    """The built-in training prompts, shuffled deterministically.

    Args:
        seed: shuffle and template seed.
        stdlib_root: stdlib folder (default: this interpreter's).
        max_prompts: cap on the number returned.
        generator: "v2" (the broad mix of ``runtime.train.generator``, the default for new
            datasets) or "v1" (stdlib docstrings, raw headers and the task list,
            ``runtime.train.prompts``: datasets made before v2 record no generator and are
            extended with v1).
        dedupe: (v2) drop prompts that duplicate an evaluation prompt.
    """
    if generator == "v2":
        return build_prompts_v2(seed=seed, stdlib_root=stdlib_root, max_prompts=max_prompts, dedupe=dedupe)
    if generator != "v1":
        raise ValueError(f"unknown prompt generator {generator!r} (v1 or v2)")
    return build_prompts_v1(seed=seed, stdlib_root=stdlib_root, max_prompts=max_prompts)


def stored_prompts(
    data_dir: Path, spec: DataSpec, tokenizer: Any = None, target: Any = None, progress: Progress | None = None
) -> list[TrainPrompt]:
    """The dataset's prompt list, fixed in ``data_dir/prompts.jsonl`` the first time.

    Shard i answers prompts i*B..(i+1)*B-1, so a dataset must extend with the very prompts it
    started with even if the generator's inputs (installed packages) changed: stored prompts come
    first, and a larger ``num_prompts`` appends new ones from the generator. ``target`` (the
    transformers model) writes the requests of the "self" generator (``progress`` gets
    ``requests_sampled``/``requests_kept``/``of`` after each batch).
    """
    path = data_dir / PROMPTS_FILE
    stored = read_prompts(data_dir) if path.exists() else []
    want = spec.num_prompts
    if stored and want is not None and len(stored) >= want:
        return stored[:want]
    cap = None if want is None else want + len(stored)
    if spec.generator == "answers":
        fresh = answer_prompts(spec, tokenizer, cap)
    elif spec.generator == "self":
        data_dir.mkdir(parents=True, exist_ok=True)
        fresh = self_prompts(spec, tokenizer, target, cap, progress, journal=data_dir / SELF_JOURNAL)
    elif spec.generator == "files":
        fresh = build_file_requests(seed=spec.seed, max_prompts=cap)
    elif spec.generator == "text":
        fresh = build_text_prompts(list(spec.text_roots) or default_roots(), seed=spec.seed, max_prompts=cap)
        if not fresh and not stored:
            raise ConfigError("no source files to build a text dataset from (give --text-from DIR)")
    elif spec.generator == "fim":
        roots = list(spec.text_roots) or default_roots()
        fresh = build_fim_prompts(roots, tokenizer, seed=spec.seed, max_prompts=cap)
        if not fresh and not stored:
            raise ConfigError("no source files to cut fill-in-the-middle holes from (give --fim-from DIR)")
    else:
        fresh = build_prompts(seed=spec.seed, max_prompts=cap, generator=spec.generator)
    have = {_prompt_key(p) for p in stored}
    new = [p for p in fresh if _prompt_key(p) not in have]
    if want is not None:
        new = new[: max(0, want - len(stored))]
    prompts = stored + bucket_by_length(new, spec.batch_size, seed=spec.seed)
    write_prompts(data_dir, prompts)
    return prompts


def answer_prompts(spec: DataSpec, tokenizer: Any, max_prompts: int | None) -> list[TrainPrompt]:
    """The "answers" generator's prompts for ``spec`` (built on ``spec.source``'s answers).

    Raises:
        ConfigError: no source dataset, or one without answers to build on.
    """
    src = spec.source
    if src is None or not (src / "dataset.json").exists() or not (src / PROMPTS_FILE).exists():
        raise ConfigError(f"the answers generator needs an earlier dataset folder, got {src}")
    if tokenizer is None:
        raise ConfigError("the answers generator needs the target's tokenizer to read the answers")
    prompts = build_prompts_from_answers(read_answers(src, tokenizer), seed=spec.seed, max_prompts=max_prompts)
    if not prompts:
        raise ConfigError(f"{src} holds no chat answers with code blocks to build prompts on")
    return prompts


SELF_JOURNAL = "self-requests.jsonl"


def self_prompts(
    spec: DataSpec,
    tokenizer: Any,
    target: Any,
    max_prompts: int | None,
    progress: Progress | None = None,
    journal: Path | None = None,
) -> list[TrainPrompt]:
    """The "self" generator's prompts: requests the target writes (``runtime.train.selfinstruct``);
    ``journal`` keeps the sampled batches so an interrupted run resumes where it stopped.

    Raises:
        ConfigError: no target or tokenizer to write them with, or no usable request came back.
    """
    if target is None or tokenizer is None:
        raise ConfigError("the self generator needs the target and its tokenizer to write requests")
    prompts = build_self_prompts(
        target,
        tokenizer,
        seed=spec.seed,
        max_prompts=max_prompts,
        batch_size=spec.batch_size,
        progress=progress,
        journal=journal,
    )
    if not prompts:
        raise ConfigError("the target wrote no usable request (is it an instruction-tuned coding model?)")
    return prompts


BUCKET_BATCHES = 8


def bucket_by_length(prompts: Sequence[TrainPrompt], batch_size: int, seed: int = 0) -> list[TrainPrompt]:
    """Order prompts so that each generation batch holds prompts of similar length.

    A batch is left-padded to its longest prompt, and the padding is computed like real tokens:
    with the generator's mix (median prompt ~100 tokens, edits and source files up to 512) an
    arbitrary batch of 32 is about two thirds padding during prefill. Within each window of
    ``BUCKET_BATCHES`` batches the prompts are sorted by length (characters: the order is fixed
    before any tokenizer runs), cut into batches, and the batches of the window shuffled with
    ``seed``, so every stretch of shards (and the held-out last one) still spans all lengths and
    kinds. Only prompts new to a dataset are ordered; stored ones keep their place.
    """
    rng = random.Random(seed)
    window = max(1, batch_size) * BUCKET_BATCHES
    out: list[TrainPrompt] = []
    for start in range(0, len(prompts), window):
        chunk = sorted(prompts[start : start + window], key=_prompt_chars)
        batches = [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
        rng.shuffle(batches)
        out.extend(p for b in batches for p in b)
    return out


def _prompt_chars(p: TrainPrompt) -> int:
    return len(p.text) + sum(len(m.get("content", "")) for m in p.messages or ())


def _prompt_key(p: TrainPrompt) -> str:
    return json.dumps([p.text, list(p.messages or ())])
