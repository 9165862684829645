"""Training data for a drafter: the target's own answers, with its hidden-state features.

``generate_dataset`` runs the frozen target over prompts in batches (greedy, KV cache, left
padding) and captures the configured layer outputs with forward hooks at the same time, so that
generating the answers and extracting the features is one pass. Each batch becomes one shard:

    tokens     int32 [N]        prompt + answer tokens of every sequence, concatenated
    features   bf16  [N, n*D]   outputs of the tapped target layers at every position
    offsets    int64 [S + 1]    sequence boundaries in ``tokens``
    prompt_len int32 [S]        prompt length of each sequence (anchors come from the answer)

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

from runtime.engine.target import TargetModel

Progress = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Shard:
    """A loaded shard (features memory-mapped)."""

    path: Path
    tokens: torch.Tensor
    offsets: torch.Tensor
    prompt_len: torch.Tensor
    features: Any  # safetensors slice handle: features[a:b] -> tensor

    @property
    def num_sequences(self) -> int:
        """Sequences in the shard."""
        return int(self.prompt_len.numel())


def encode_prompt(tokenizer: Any, text: str, chat: bool) -> list[int]:
    """Token ids for a training prompt (chat template with thinking off, or raw text)."""
    if chat:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True, enable_thinking=False
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
) -> list[tuple[list[int], torch.Tensor, int]]:
    """Greedy-generate answers for a batch and capture tapped features at every position.

    Args:
        target: wrapped target with taps set (``set_taps``).
        prompts: token ids per prompt.
        max_new_tokens: answer length cap.
        stop_ids: EOS ids (kept as the last answer token).
        pad_id: id used for left padding.

    Returns:
        Per sequence: (prompt + answer ids, features [T, n*D] bf16 on CPU, prompt length).
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
    lengths = torch.full((b,), max_new_tokens, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    last_pos = pos[:, -1]
    for step in range(max_new_tokens):
        nxt = logits.argmax(-1)
        answers[:, step] = nxt
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
        out.append((seq, f, len(p)))
    return out


def write_shard(path: Path, sequences: Sequence[tuple[list[int], torch.Tensor, int]], meta: dict[str, Any]) -> int:
    """Write one shard atomically; return its token count."""
    from safetensors.torch import save_file

    tokens = torch.tensor([t for seq, _, _ in sequences for t in seq], dtype=torch.int32)
    feats = torch.cat([f for _, f, _ in sequences], dim=0).contiguous()
    offsets = torch.tensor([0] + list(_cumsum([len(s) for s, _, _ in sequences])), dtype=torch.int64)
    plen = torch.tensor([p for _, _, p in sequences], dtype=torch.int32)
    tmp = path.with_suffix(".tmp")
    save_file(
        {"tokens": tokens, "features": feats, "offsets": offsets, "prompt_len": plen},
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

    Returns:
        All shard paths, in order.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    target.set_taps(taps)
    encoded = [(encode_prompt(tokenizer, p.text, p.chat), p) for p in prompts]
    encoded = [(ids, p) for ids, p in encoded if 0 < len(ids) <= max_prompt_tokens]
    meta = {"taps": list(taps), "hidden_size": target.hidden_size, "max_new_tokens": max_new_tokens}
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
        results = generate_batch(target, [ids for ids, _ in chunk], max_new_tokens, stop_ids, pad)
        n = write_shard(path, results, {**meta, "sources": [p.source for _, p in chunk]})
        total_tokens += n
        if progress:
            elapsed = time.perf_counter() - t0
            progress(
                {
                    "shard": bi,
                    "shards": -(-len(encoded) // batch_size),
                    "tokens": total_tokens,
                    "answer_tokens": sum(len(s) - pl for s, _, pl in results),
                    "seconds": elapsed,
                }
            )
    return paths


def load_shard(path: Path) -> Shard:
    """Open a shard; features stay on disk (memory-mapped slices)."""
    from safetensors import safe_open

    handle = safe_open(str(path), framework="pt")
    return Shard(
        path=path,
        tokens=handle.get_tensor("tokens").long(),
        offsets=handle.get_tensor("offsets"),
        prompt_len=handle.get_tensor("prompt_len").long(),
        features=handle.get_slice("features"),
    )


def dataset_summary(data_dir: Path) -> dict[str, int]:
    """Shards, sequences, prompt and answer tokens of a dataset folder (read from the shards'
    small tensors; the features stay on disk)."""
    summary = {"shards": 0, "sequences": 0, "prompt_tokens": 0, "answer_tokens": 0}
    for path in sorted(Path(data_dir).glob("shard-*.safetensors")):
        shard = load_shard(path)
        prompt = int(shard.prompt_len.sum())
        summary["shards"] += 1
        summary["sequences"] += shard.num_sequences
        summary["prompt_tokens"] += prompt
        summary["answer_tokens"] += int(shard.tokens.numel()) - prompt
    return summary
