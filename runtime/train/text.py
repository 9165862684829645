"""Teacher-forced text datasets: real source files scored by the target in one forward pass.

Generating answers costs one target step per token; scoring text that already exists costs one
batched forward for a whole sequence, several times cheaper per token on a CPU. The text is real
source code (the standard library, the installed packages and the system's JavaScript, C, shell
and SQL sources, or any folder given), balanced across languages, half of it wrapped in a chat
turn ("Show me `path`" -> the assistant's fenced code) and the rest raw.

The target's own choice at every position is stored with the features: ``topk_ids[:, 0]`` is its
argmax given the real text before it, ``topk_logp`` its top-k log-probabilities. A drafter block
anchored at position ``a`` gets exact labels for as far as the text follows the target: slot 1's
label is always the target's argmax after ``a``; slot k's only while the text's tokens ``a+1 ..
a+k-1`` are the target's own choices (``runtime.train.batching.build_batch`` drops the rest), so
nothing is learnt that the target would not verify.

Shards have the layout of ``runtime.train.data`` with ``labels: teacher-forced`` in their
metadata; the prompt list (one entry per text chunk) is ``prompts.jsonl`` as for generated data.
"""

from __future__ import annotations

import json
import random
import sysconfig
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from runtime.engine.models.target import TargetModel
from runtime.train.data import Progress, encode_prompt, write_shard
from runtime.train.prompt_list import TrainPrompt

LABELS_KEY = "labels"
T = TypeVar("T")
TEACHER_FORCED = "teacher-forced"

SUFFIXES = {
    ".py": "python",
    ".js": "javascript",
    ".mjs": "javascript",
    ".ts": "typescript",
    ".c": "c",
    ".h": "c",
    ".cpp": "cpp",
    ".cc": "cpp",
    ".hpp": "cpp",
    ".go": "go",
    ".rs": "rust",
    ".java": "java",
    ".sh": "bash",
    ".sql": "sql",
}
FENCE = {"python": "python", "javascript": "js", "typescript": "ts", "c": "c", "cpp": "cpp", "go": "go"}
FENCE |= {"rust": "rust", "java": "java", "bash": "bash", "sql": "sql"}
# share of chunks per language while its files last (the rest is spread over what there is)
LANG_MIX = {"python": 0.35, "javascript": 0.15, "c": 0.12, "cpp": 0.1, "bash": 0.08, "sql": 0.06}
LANG_MIX |= {"typescript": 0.04, "java": 0.04, "go": 0.03, "rust": 0.03}
CHAT_SHARE = 0.5
CHAT_REQUESTS = (
    "Show me the source of `{name}`.",
    "Write `{name}`.",
    "Print the {lang} file `{name}`.",
    "Here is the code of `{name}`, please show it.",
    "What does `{name}` look like? Show the code.",
    "Give me the {lang} code in `{name}`.",
)
LANG_NAMES = {"python": "Python", "javascript": "JavaScript", "typescript": "TypeScript", "c": "C", "cpp": "C++"}
LANG_NAMES |= {"go": "Go", "rust": "Rust", "java": "Java", "bash": "Bash", "sql": "SQL"}
SYSTEM_ROOTS = ("/usr/lib/node_modules", "/usr/include", "/usr/share/postgresql", "/usr/share/doc")


def default_roots() -> list[Path]:
    """Source folders of ``--text-from auto``: this interpreter's standard library and site-packages,
    and the system's JavaScript, C headers and SQL/shell files where present."""
    paths = sysconfig.get_paths()
    roots = [Path(paths["stdlib"]), Path(paths["purelib"])]
    roots += [Path(p) for p in SYSTEM_ROOTS if Path(p).is_dir()]
    out: list[Path] = []
    for r in roots:
        if r not in out:
            out.append(r)
    return out


def files_by_language(roots: Iterable[Path]) -> dict[str, list[Path]]:
    from runtime.train.generator import source_files

    by_lang: dict[str, list[Path]] = {}
    for p in source_files(roots, SUFFIXES):
        by_lang.setdefault(SUFFIXES[p.suffix], []).append(p)
    return by_lang


def balanced_files(roots: Iterable[Path], rng: random.Random, taken: dict[str, int]) -> Iterator[tuple[str, Path]]:
    """(language, file) of the source files under ``roots`` (``SUFFIXES``) in ``balanced`` order."""
    return balanced(files_by_language(roots), rng, taken)


def furthest_below_share(langs: Iterable[str], taken: dict[str, int], mix: dict[str, float]) -> str:
    """The language of ``langs`` whose share of ``taken`` (language -> count) is furthest below its
    ``mix`` share (0.02 for a language not in it); ties go to the first name."""
    total = max(sum(taken.values()), 1)
    return min(langs, key=lambda x: (taken[x] / total - mix.get(x, 0.02), x))


def balanced(by_lang: dict[str, list[T]], rng: random.Random, taken: dict[str, int]) -> Iterator[tuple[str, T]]:
    """(language, item) of ``by_lang``, each language's items shuffled by ``rng`` (now), the next
    always from the language furthest below its ``LANG_MIX`` share (languages not in it get a small
    one) while its items last. The caller counts the items it used in ``taken`` (language -> count,
    reset here), which sets the shares."""
    for items in by_lang.values():
        rng.shuffle(items)
    taken.clear()
    taken.update(dict.fromkeys(by_lang, 0))

    def walk() -> Iterator[tuple[str, T]]:
        cursor = dict.fromkeys(by_lang, 0)
        while True:
            open_langs = [lang for lang in by_lang if cursor[lang] < len(by_lang[lang])]
            if not open_langs:
                return
            lang = furthest_below_share(open_langs, taken, LANG_MIX)
            cursor[lang] += 1
            yield lang, by_lang[lang][cursor[lang] - 1]

    return walk()


def build_text_prompts(
    roots: Sequence[Path], seed: int = 0, max_prompts: int | None = None, max_chars: int = 2400, dedupe: bool = True
) -> list[TrainPrompt]:
    """Text chunks of the source files under ``roots``, languages mixed by ``LANG_MIX``.

    Each entry's ``text`` is the chunk; ``chat`` entries carry the user turn in ``messages`` (the
    assistant turn is the chunk in a code fence). ``source`` is ``text-chat:LANG:FILE`` or
    ``text-raw:LANG:FILE``. Chunks that duplicate an evaluation prompt are dropped.
    """
    from runtime.train.generator import drop_evaluation_duplicates, file_chunk

    rng = random.Random(seed)
    taken: dict[str, int] = {}
    out: list[TrainPrompt] = []
    for lang, path in balanced_files(roots, rng, taken):
        if max_prompts is not None and len(out) >= max_prompts:
            break
        chunk = file_chunk(path, rng, max_chars=max_chars, lang=lang)
        if not chunk:
            continue
        taken[lang] += 1
        name = "/".join(path.parts[-2:])
        if rng.random() < CHAT_SHARE:
            request = rng.choice(CHAT_REQUESTS).format(name=name, lang=LANG_NAMES.get(lang, lang))
            msgs = ({"role": "user", "content": request},)
            out.append(TrainPrompt(chunk, True, f"text-chat:{lang}:{path.name}", msgs))
        else:
            out.append(TrainPrompt(chunk, False, f"text-raw:{lang}:{path.name}"))
    if dedupe:
        out = drop_evaluation_duplicates({"text": out})["text"]
    return out


def encode_text(tokenizer: Any, p: TrainPrompt, max_tokens: int) -> tuple[list[int], int]:
    """(token ids, context length) of one text entry: a chat entry is the chat header with the user
    turn and the opening code fence (context), then the chunk; a raw entry is the chunk, its first
    token the only context. The chunk is cut to ``max_tokens`` tokens."""
    lang = p.source.split(":")[1] if p.source.count(":") >= 2 else ""
    if p.chat and p.messages:
        head = encode_prompt(tokenizer, "", True, p.messages)
        head += list(tokenizer.encode(f"```{FENCE.get(lang, lang)}\n", add_special_tokens=False))
        body = list(tokenizer.encode(p.text, add_special_tokens=False))[:max_tokens]
        return head + body, len(head)
    ids = list(tokenizer.encode(p.text, add_special_tokens=True))[: max_tokens + 1]
    return ids, 1


@torch.inference_mode()
def score_batch(
    target: TargetModel, seqs: Sequence[tuple[list[int], int]], pad_id: int, topk: int
) -> list[tuple[list[int], torch.Tensor, int, tuple[torch.Tensor, torch.Tensor]]]:
    """One teacher-forced forward over a right-padded batch.

    Returns:
        Per sequence: (ids, features [T, n*D] bf16, context length, (top-k ids [A, k] int32,
        log-probs [A, k] float16)) with A = T - context length, row r being the target's
        distribution for token ``context + r`` (from the logits one position earlier).
    """
    device = target.device
    b, t_max = len(seqs), max(len(ids) for ids, _ in seqs)
    ids = torch.full((b, t_max), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((b, t_max), dtype=torch.long, device=device)
    for i, (s, _) in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, device=device)
        mask[i, : len(s)] = 1
    target._captured.clear()
    out = target.model(input_ids=ids, attention_mask=mask, use_cache=False)
    feats = torch.cat([target._captured[i] for i in target._taps], dim=-1)
    k = max(1, min(int(topk), int(out.logits.shape[-1])))
    results = []
    for i, (s, plen) in enumerate(seqs):
        t = len(s)
        lp, ix = out.logits[i, plen - 1 : t - 1].float().log_softmax(-1).topk(k, dim=-1)
        results.append(
            (
                list(s),
                feats[i, :t].to("cpu", torch.bfloat16).clone(),
                plen,
                (ix.to("cpu", torch.int32), lp.to("cpu", torch.float16)),
            )
        )
    return results


def build_text_dataset(
    target: TargetModel,
    tokenizer: Any,
    prompts: Sequence[TrainPrompt],
    out_dir: Path,
    taps: Sequence[int],
    *,
    batch_size: int = 8,
    max_tokens: int = 512,
    topk: int = 8,
    progress: Progress | None = None,
    extra_meta: dict[str, Any] | None = None,
) -> list[Path]:
    """Score (or resume scoring) the text ``prompts`` into shards of ``batch_size`` sequences."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if type(target) is not TargetModel:
        target = TargetModel(target.model)  # transformers' forward, with hooks on the taps
    target.set_taps(taps)
    topk = max(int(topk), 1)  # the labels are the top-1
    encoded = [(encode_text(tokenizer, p, max_tokens), p) for p in prompts]
    encoded = [(e, p) for e, p in encoded if len(e[0]) - e[1] >= 2]
    meta: dict[str, Any] = {
        "taps": list(taps),
        "hidden_size": target.hidden_size,
        "max_new_tokens": max_tokens,
        "topk": topk,
        LABELS_KEY: TEACHER_FORCED,
    }
    (out_dir / "dataset.json").write_text(
        json.dumps({**meta, **(extra_meta or {}), "num_prompts": len(encoded)}, indent=2)
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    paths, total, t0 = [], 0, time.perf_counter()
    shards = -(-len(encoded) // batch_size)
    for bi, start in enumerate(range(0, len(encoded), batch_size)):
        path = out_dir / f"shard-{bi:05d}.safetensors"
        paths.append(path)
        if path.exists():
            continue
        chunk = encoded[start : start + batch_size]
        results = score_batch(target, [e for e, _ in chunk], pad, topk)
        total += write_shard(path, results, {**meta, "sources": [p.source for _, p in chunk]})
        if progress:
            progress({"shard": bi, "shards": shards, "tokens": total, "seconds": time.perf_counter() - t0})
    return paths
