"""Training data for a drafter: the target's own answers, with its hidden-state features.

``generate_dataset`` runs the frozen target over prompts in batches (greedy, KV cache, left
padding) and captures the configured layer outputs with forward hooks at the same time, so that
generating the answers and extracting the features is one pass. Each batch becomes one shard:

    tokens     int32 [N]        prompt + answer tokens of every sequence, concatenated
    features   bf16  [N, n*D]   outputs of the tapped target layers at every position
    offsets    int64 [S + 1]    sequence boundaries in ``tokens``
    prompt_len int32 [S]        prompt length of each sequence (anchors come from the answer)
    topk_ids   int32 [A, k]     (optional) the target's k most likely tokens at every answer position
    topk_logp  fp16  [A, k]     (optional) their log-probabilities (full-vocabulary log-softmax)

A = answer tokens of the shard, in sequence order (row r of sequence j is answer token r, i.e.
token ``prompt_len[j] + r`` of that sequence). The top-k rows come from the very logits whose argmax
chose the answer token, so distilling from them costs nothing extra at generation time.

Because answers are the target's greedy choices, the next token IS the target's prediction: the
drafter learns exactly what the target will verify. Shards are written atomically; an interrupted
run resumes at the first missing shard.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.engine.models.target import TargetModel

Progress = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Shard:
    """A loaded shard (features memory-mapped)."""

    path: Path
    tokens: torch.Tensor
    offsets: torch.Tensor
    prompt_len: torch.Tensor
    features: Any  # safetensors slice handle: features[a:b] -> tensor
    topk_ids: torch.Tensor | None = None  # [A, k] int32
    topk_logp: torch.Tensor | None = None  # [A, k] float16
    sources: tuple[str, ...] = ()
    teacher_forced: bool = False  # real text scored by the target: labels are topk_ids[:, 0]

    @property
    def num_sequences(self) -> int:
        """Sequences in the shard."""
        return int(self.prompt_len.numel())

    def answer_labels(self, j: int) -> torch.Tensor:
        """The target's choice for each answer token of sequence ``j`` [A]: the tokens themselves for
        generated answers, the stored argmax for teacher-forced text."""
        a, b = int(self.offsets[j]), int(self.offsets[j + 1])
        plen = int(self.prompt_len[j])
        if self.teacher_forced and self.topk_ids is not None:
            r0 = self.answer_start(j)
            return self.topk_ids[r0 : r0 + (b - a - plen), 0].long()
        return self.tokens[a + plen : b]

    def answer_start(self, j: int) -> int:
        """Row of sequence ``j``'s first answer token in ``topk_ids`` / ``topk_logp``."""
        lengths = (self.offsets[1:] - self.offsets[:-1]) - self.prompt_len
        return int(lengths[:j].sum())


def encode_prompt(tokenizer: Any, text: str, chat: bool, messages: Sequence[dict[str, str]] | None = None) -> list[int]:
    """Token ids for a training prompt (chat template with thinking off, or raw text); ``messages``
    is a whole conversation (multi-turn prompts), else one user turn with ``text``."""
    if chat or messages:
        turns = list(messages) if messages else [{"role": "user", "content": text}]
        rendered = tokenizer.apply_chat_template(
            turns, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    return list(tokenizer.encode(text, add_special_tokens=True))


@torch.inference_mode()
def generate_batch(
    target: TargetModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_ids: Sequence[int],
    pad_id: int,
    topk: int = 0,
) -> list[tuple[list[int], torch.Tensor, int, tuple[torch.Tensor, torch.Tensor] | None]]:
    """Greedy-generate answers for a batch and capture tapped features at every position.

    Args:
        target: wrapped target with taps set (``set_taps``).
        prompts: token ids per prompt.
        max_new_tokens: answer length cap.
        stop_ids: EOS ids (kept as the last answer token).
        pad_id: id used for left padding.
        topk: also keep the k most likely tokens and their log-probabilities at every answer
            position (0: none).

    Returns:
        Per sequence: (prompt + answer ids, features [T, n*D] bf16 on CPU, prompt length,
        (top-k ids [A, k] int32, log-probs [A, k] float16) or None).
    """
    device = target.device
    b = len(prompts)
    p_max = max(len(p) for p in prompts)
    ids = torch.full((b, p_max), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((b, p_max), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, p_max - len(p) :] = torch.tensor(p, device=device)
        mask[i, p_max - len(p) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = target.new_cache()
    n_feat = len(target._taps) * target.hidden_size
    feats = torch.zeros((b, p_max + max_new_tokens, n_feat), dtype=torch.bfloat16)
    kw = {target._cache_kw: cache, "use_cache": True}

    def run(
        step_ids: torch.Tensor, step_mask: torch.Tensor, step_pos: torch.Tensor, at: int, keep: int
    ) -> torch.Tensor:
        target._captured.clear()
        out = target.model(
            input_ids=step_ids, attention_mask=step_mask, position_ids=step_pos, logits_to_keep=keep, **kw
        )
        f = torch.cat([target._captured[i] for i in target._taps], dim=-1)
        feats[:, at : at + step_ids.shape[1]] = f.to("cpu", torch.bfloat16)
        return out.logits[:, -1]

    logits = run(ids, mask, pos, 0, 1)
    stop = torch.tensor(list(stop_ids), device=device)
    answers = torch.zeros((b, max_new_tokens), dtype=torch.long, device=device)
    k = min(int(topk), int(logits.shape[-1]))
    top_ids = torch.zeros((b, max_new_tokens, max(k, 1)), dtype=torch.int32)
    top_logp = torch.zeros((b, max_new_tokens, max(k, 1)), dtype=torch.float16)
    lengths = torch.full((b,), max_new_tokens, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    last_pos = pos[:, -1]
    for step in range(max_new_tokens):
        nxt = logits.argmax(-1)
        answers[:, step] = nxt
        if k:  # the distribution that chose answer token `step` (float32 log-softmax over the full vocab)
            lp, ix = logits.float().log_softmax(-1).topk(k, dim=-1)
            top_ids[:, step], top_logp[:, step] = ix.to("cpu", torch.int32), lp.to("cpu", torch.float16)
        hit = torch.isin(nxt, stop) & ~done
        lengths[hit] = step + 1
        done |= hit
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones((b, 1), dtype=torch.long, device=device)], dim=1)
        last_pos = last_pos + 1
        logits = run(nxt[:, None], mask, last_pos[:, None], p_max + step, 0)
    out = []
    for i, p in enumerate(prompts):
        n = int(lengths[i])
        seq = list(p) + answers[i, :n].tolist()
        f = torch.cat([feats[i, p_max - len(p) : p_max], feats[i, p_max : p_max + n]], dim=0)
        out.append((seq, f, len(p), (top_ids[i, :n].clone(), top_logp[i, :n].clone()) if k else None))
    return out


def write_shard(path: Path, sequences: Sequence[tuple[Any, ...]], meta: dict[str, Any]) -> int:
    """Write one shard atomically; return its token count.

    Args:
        path: the shard file.
        sequences: (ids, features, prompt length[, (top-k ids, top-k log-probs) or None]) tuples
            as ``generate_batch`` returns them.
        meta: safetensors metadata (JSON-encoded per key).
    """
    from safetensors.torch import save_file

    tokens = torch.tensor([t for s in sequences for t in s[0]], dtype=torch.int32)
    feats = torch.cat([s[1] for s in sequences], dim=0).contiguous()
    offsets = torch.tensor([0] + list(_cumsum([len(s[0]) for s in sequences])), dtype=torch.int64)
    plen = torch.tensor([s[2] for s in sequences], dtype=torch.int32)
    tensors = {"tokens": tokens, "features": feats, "offsets": offsets, "prompt_len": plen}
    tops = [s[3] if len(s) > 3 else None for s in sequences]
    if tops and all(t is not None for t in tops):
        tensors["topk_ids"] = torch.cat([t[0] for t in tops if t is not None]).to(torch.int32).contiguous()
        tensors["topk_logp"] = torch.cat([t[1] for t in tops if t is not None]).to(torch.float16).contiguous()
    tmp = path.with_suffix(".tmp")
    save_file(
        tensors,
        str(tmp),
        metadata={k: json.dumps(v) for k, v in meta.items()},
    )
    tmp.replace(path)
    return int(tokens.numel())


def _cumsum(xs: Sequence[int]) -> list[int]:
    out, s = [], 0
    for x in xs:
        s += x
        out.append(s)
    return out


def generate_dataset(
    target: TargetModel,
    tokenizer: Any,
    prompts: Sequence[Any],
    out_dir: Path,
    taps: Sequence[int],
    *,
    batch_size: int = 64,
    max_new_tokens: int = 320,
    max_prompt_tokens: int = 512,
    stop_ids: Sequence[int] = (),
    progress: Progress | None = None,
    extra_meta: dict[str, Any] | None = None,
    topk: int = 0,
) -> list[Path]:
    """Generate (or resume generating) the dataset shards for ``prompts``.

    Args:
        target: the frozen target (any device).
        tokenizer: its tokenizer.
        prompts: ``TrainPrompt``-like objects with ``text`` and ``chat``.
        out_dir: shard folder (``shard-00000.safetensors`` ...), with ``dataset.json``.
        taps: target layers to capture (a superset of what the drafter will use is fine).
        batch_size: sequences per batch (one shard per batch).
        max_new_tokens: answer length cap.
        max_prompt_tokens: longer prompts are skipped.
        stop_ids: EOS ids.
        progress: callback with a dict of counters after each shard.
        extra_meta: more keys for ``dataset.json``.
        topk: keep the target's k most likely tokens per answer position (0: none).

    Returns:
        All shard paths, in order.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    if type(target) is not TargetModel:
        # batched, padded generation runs transformers' own forward (hooks on the taps), whatever
        # forward the pipeline decodes with (the lean one has a batch-1 static cache)
        target = TargetModel(target.model)
    target.set_taps(taps)
    encoded = [(encode_prompt(tokenizer, p.text, p.chat, getattr(p, "messages", None)), p) for p in prompts]
    encoded = [(ids, p) for ids, p in encoded if 0 < len(ids) <= max_prompt_tokens]
    meta: dict[str, Any] = {
        "taps": list(taps),
        "hidden_size": target.hidden_size,
        "max_new_tokens": max_new_tokens,
        "max_prompt_tokens": max_prompt_tokens,
    }
    if topk:
        meta["topk"] = int(topk)
    (out_dir / "dataset.json").write_text(
        json.dumps({**meta, **(extra_meta or {}), "num_prompts": len(encoded)}, indent=2)
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop_ids[0] if stop_ids else 0)
    paths = []
    total_tokens = 0
    t0 = time.perf_counter()
    for bi, start in enumerate(range(0, len(encoded), batch_size)):
        path = out_dir / f"shard-{bi:05d}.safetensors"
        paths.append(path)
        if path.exists():
            continue
        chunk = encoded[start : start + batch_size]
        results = generate_batch(target, [ids for ids, _ in chunk], max_new_tokens, stop_ids, pad, topk=topk)
        n = write_shard(path, results, {**meta, "sources": [p.source for _, p in chunk]})
        total_tokens += n
        if progress:
            elapsed = time.perf_counter() - t0
            progress(
                {
                    "shard": bi,
                    "shards": -(-len(encoded) // batch_size),
                    "tokens": total_tokens,
                    "answer_tokens": sum(len(r[0]) - r[2] for r in results),
                    "seconds": elapsed,
                }
            )
    return paths


def load_shard(path: Path) -> Shard:
    """Open a shard; features stay on disk (memory-mapped slices)."""
    from safetensors import safe_open

    handle = safe_open(str(path), framework="pt")
    keys = set(handle.keys())
    meta = handle.metadata() or {}
    sources = json.loads(meta.get("sources", "[]"))
    return Shard(
        path=path,
        tokens=handle.get_tensor("tokens").long(),
        offsets=handle.get_tensor("offsets"),
        prompt_len=handle.get_tensor("prompt_len").long(),
        features=handle.get_slice("features"),
        topk_ids=handle.get_tensor("topk_ids") if "topk_ids" in keys else None,
        topk_logp=handle.get_tensor("topk_logp") if "topk_logp" in keys else None,
        sources=tuple(str(x) for x in sources),
        teacher_forced=json.loads(meta.get("labels", "null")) == "teacher-forced",
    )


def dataset_summary(data_dir: Path) -> dict[str, Any]:
    """Shards, sequences, prompt and answer tokens of a dataset folder, and its mix: sequences and
    answer tokens per prompt kind (read from the shards' small tensors and metadata; the features
    stay on disk). ``topk`` is the k of the stored soft labels (0: hard labels only); for
    teacher-forced text, ``target_agreement`` is the share of its tokens that are the target's
    own choice (how far blocks on it carry labels past slot 1)."""
    summary: dict[str, Any] = {"shards": 0, "sequences": 0, "prompt_tokens": 0, "answer_tokens": 0, "topk": None}
    mix: dict[str, dict[str, int]] = {}
    agree = [0, 0]  # teacher-forced text: tokens where the text is the target's own choice, of all
    for path in sorted(Path(data_dir).glob("shard-*.safetensors")):
        shard = load_shard(path)
        prompt = int(shard.prompt_len.sum())
        summary["shards"] += 1
        summary["sequences"] += shard.num_sequences
        summary["prompt_tokens"] += prompt
        summary["answer_tokens"] += int(shard.tokens.numel()) - prompt
        k = int(shard.topk_ids.shape[1]) if shard.topk_ids is not None else 0
        summary["topk"] = k if summary["topk"] in (None, k) else min(summary["topk"], k)
        if shard.teacher_forced:
            for j in range(shard.num_sequences):
                a, b = int(shard.offsets[j]), int(shard.offsets[j + 1])
                text = shard.tokens[a + int(shard.prompt_len[j]) : b]
                agree[0] += int((text == shard.answer_labels(j)).sum())
                agree[1] += int(text.numel())
        lengths = ((shard.offsets[1:] - shard.offsets[:-1]) - shard.prompt_len).tolist()
        for j, n in enumerate(lengths):
            kind = shard.sources[j].split(":", 1)[0] if j < len(shard.sources) else "unknown"
            row = mix.setdefault(kind, {"sequences": 0, "answer_tokens": 0})
            row["sequences"] += 1
            row["answer_tokens"] += int(n)
    summary["topk"] = summary["topk"] or 0
    if agree[1]:
        summary["target_agreement"] = round(agree[0] / agree[1], 4)
    summary["mix"] = dict(sorted(mix.items(), key=lambda kv: -kv[1]["sequences"]))
    return summary
