"""First-class test fakes: tiny models and tokenizers built in-process, oracle/adversarial
drafters, and a scripted decoder for CLI/TUI tests (no model at all).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from runtime.config import SamplingParams
from runtime.engine import CancelToken, chain_decoder, tree_decoder
from runtime.engine.acceptance import AcceptanceCounter
from runtime.engine.events import (
    BlockVerified,
    DecodeEvent,
    Finished,
    GenerationStats,
    PrefillDone,
    TokenEvent,
    TokenStatus,
)
from runtime.engine.models.drafter import DFlashDraftModel
from runtime.engine.models.drafter_config import DraftModelConfig
from runtime.engine.models.drafter_io import save_draft_model
from runtime.engine.propose import DrafterProposer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for i in range(10):\n    print(i)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "héllo wörld — ünïcode ✓ 日本語 テキスト",
    "import os\nimport sys\nprint(os.getcwd(), sys.argv)\n",
] * 20


FIM_TOKENS = {  # as the families' tokenizers declare them (added after training: the BPE stays the same)
    "qwen": ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"],
    "starcoder": ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<repo_name>", "<file_sep>"],
    "codellama": ["▁<PRE>", "▁<MID>", "▁<SUF>", "▁<EOT>"],
}


def make_tokenizer(folder: Path | None = None, vocab_size: int = 320, fim: str | None = None) -> Any:
    """A small byte-level BPE tokenizer with ChatML special tokens and a chat template; ``fim``
    ("qwen", "starcoder", "codellama") adds that family's fill-in-the-middle tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = CHATML
    if fim is not None:
        fast.add_special_tokens({"additional_special_tokens": FIM_TOKENS[fim]})
    if folder is not None:
        fast.save_pretrained(str(folder))
    return fast


def tiny_target_config(arch: str = "qwen3", vocab_size: int = 320, layers: int = 4, **kw: Any) -> Any:
    """Config of a tiny random target: qwen3, qwen2 or llama (GQA: 4 heads, 2 KV heads)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=kw.pop("max_position_embeddings", 512),
        tie_word_embeddings=False,
        initializer_range=kw.pop("initializer_range", 0.2),
        eos_token_id=kw.pop("eos_token_id", None),
    )
    if arch == "qwen3":
        return Qwen3Config(head_dim=16, **common, **kw)
    if arch == "qwen2":
        return Qwen2Config(**common, **kw)
    if arch == "llama":
        return LlamaConfig(head_dim=16, **common, **kw)
    raise ValueError(arch)


def make_target(arch: str = "qwen3", vocab_size: int = 320, seed: int = 0, **kw: Any) -> Any:
    """A tiny random causal LM (float32, eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_target_config(arch, vocab_size, **kw)
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg).eval()


def drafter_config_dict(
    target_config: Any,
    block_size: int = 4,
    layers: int = 1,
    taps: Sequence[int] | None = None,
    mask_token_id: int | None = None,
    nested: bool = True,
    hidden_size: int | None = None,
    vocab_size: int | None = None,
    layer_types: Sequence[str] | None = None,
    sliding_window: int | None = None,
) -> dict[str, Any]:
    """A published-layout drafter config for a tiny target."""
    n_target = target_config.num_hidden_layers
    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": block_size,
        "hidden_size": hidden_size or target_config.hidden_size,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "vocab_size": vocab_size or target_config.vocab_size,
        "num_target_layers": n_target,
        "layer_types": list(layer_types or ["full_attention"] * layers),
        "sliding_window": sliding_window,
    }
    dflash: dict[str, Any] = {
        "mask_token_id": mask_token_id if mask_token_id is not None else target_config.vocab_size - 1
    }
    if taps is not None:
        dflash["target_layer_ids"] = list(taps)
    if nested:
        cfg["dflash_config"] = dflash
    else:
        cfg.update(dflash)
    return cfg


def make_drafter(target_config: Any, seed: int = 0, std: float = 0.2, **kw: Any) -> DFlashDraftModel:
    """A random drafter wired to a tiny target (float32, eval mode)."""
    torch.manual_seed(seed)
    model = DFlashDraftModel(DraftModelConfig.from_dict(drafter_config_dict(target_config, **kw)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, std)
    return model.eval()


def save_pair(
    folder: Path,
    arch: str = "qwen3",
    block_size: int = 4,
    with_tokenizer: bool = True,
    seed: int = 0,
    fim: str | None = None,
    **drafter_kw: Any,
) -> tuple[Path, Path]:
    """Save a tiny target (+ tokenizer) and a matching drafter; return (target_dir, drafter_dir)."""
    target_dir, drafter_dir = folder / "target", folder / "drafter"
    target_dir.mkdir(parents=True, exist_ok=True)
    vocab = 320
    eos = None
    if with_tokenizer:
        tok = make_tokenizer(target_dir, fim=fim)
        vocab = max(len(tok), 64) + 8
        eos = tok.eos_token_id
    target = make_target(arch, vocab_size=vocab, seed=seed, eos_token_id=eos)
    target.save_pretrained(str(target_dir))
    drafter = make_drafter(target.config, seed=seed + 1, block_size=block_size, taps=[1, 2], **drafter_kw)
    save_draft_model(drafter, drafter_dir)
    return target_dir, drafter_dir


def pair_with_data(root: Path, num_prompts: int = 12, max_new_tokens: int = 32) -> tuple[Path, Path, Path]:
    """A tiny saved pair (``save_pair``, block 4) and a training dataset of its target's answers
    (taps 1, 2); returns (target_dir, drafter_dir, data_dir)."""
    from runtime import ModelRef, RuntimeConfig, load_pipeline
    from runtime.train.api import DataSpec, prepare_data

    target_dir, drafter_dir = save_pair(root / "pair", block_size=4)
    pipe = load_pipeline(ModelRef(target=str(target_dir), drafter="none"), RuntimeConfig(dtype="float32"))
    spec = DataSpec(num_prompts=num_prompts, max_new_tokens=max_new_tokens, batch_size=4)
    prepare_data(pipe.target, pipe.tokenizer, root / "data", [1, 2], spec, pipe.stop_token_ids)
    return target_dir, drafter_dir, root / "data"


def greedy_reference(model: Any, prompt: Sequence[int], n: int) -> list[int]:
    """Plain greedy continuation without any cache (the slowest, simplest reference)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def lean_greedy_reference(lean: Any, prompt: Sequence[int], n: int) -> list[int]:
    """Plain greedy continuation through a ``LeanTarget``'s forward, re-reading the whole sequence
    into a fresh cache at every token (no incremental cache, no verify blocks): the reference for
    targets whose numbers only the lean forward defines (int8 GEMM, int8 head)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits, _ = lean.forward(torch.tensor([ids]), lean.new_cache(), logits_to_keep=1, capture=False)
            ids.append(int(logits[-1].float().argmax()))
    return ids[len(prompt) :]


class OracleProposer(DrafterProposer):
    """Proposes the target's own greedy continuation: every draft is accepted.

    ``corrupt`` (0..1) replaces each draft with a wrong token with that probability, to exercise
    every acceptance length; ``adversarial`` proposes only wrong tokens (tau == 1). For trees
    (``candidates``), ``corrupt`` demotes the true token to rank ``demote`` at a slot with that
    probability (a tree with enough budget still finds it; a chain would not), and ``adversarial``
    gives it probability 0 at every slot.
    """

    def __init__(
        self,
        target: Any,
        drafter: Any,
        block_size: int,
        corrupt: float = 0.0,
        demote: int = 1,
        adversarial: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__(target, drafter, block_size)
        self.corrupt, self.demote, self.adversarial = corrupt, demote, adversarial
        self.gen = torch.Generator().manual_seed(seed)

    def chain(self, ctx, depth):  # type: ignore[no-untyped-def]
        truth = greedy_reference(self.target.model, list(ctx.committed), depth)
        out = []
        vocab = self.target.vocab_size
        for t in truth:
            wrong = self.adversarial or float(torch.rand((), generator=self.gen)) < self.corrupt
            out.append((t + 1) % vocab if wrong else t)
        return torch.tensor(out, dtype=torch.long, device=self.target.device)

    def logprobs(self, ctx, depth):  # type: ignore[no-untyped-def]
        truth = greedy_reference(self.target.model, list(ctx.committed), depth)
        vocab = self.target.vocab_size
        scores = torch.full((depth, vocab), -20.0)
        for d, t in enumerate(truth):
            others = [(t + j) % vocab for j in range(1, vocab)]
            order = list(others)
            if not self.adversarial:
                rank = self.demote if float(torch.rand((), generator=self.gen)) < self.corrupt else 0
                order.insert(rank, t)
            for r, tok in enumerate(order):
                scores[d, tok] = -5.0 * r  # rank 0 near-certain, strictly decreasing by rank
            if self.adversarial:
                scores[d, t] = float("-inf")
        return torch.log_softmax(scores, dim=-1).to(self.target.device), None, None


def _oracle(target: Any, drafter: Any, block_size: int | None, kw: dict[str, Any]) -> OracleProposer:
    block = block_size or drafter.dflash.block_size
    keys = ("corrupt", "demote", "adversarial", "seed")
    return OracleProposer(target, drafter, block, **{k: kw.pop(k) for k in keys if k in kw})


def OracleDecoder(  # noqa: N802
    target: Any, drafter: Any, tokenizer: Any = None, *, block_size: int | None = None, **kw: Any
) -> Any:
    """A chain decoder whose drafts come from ``OracleProposer`` (arguments: ``chain_decoder``'s and
    the oracle's)."""
    proposer = _oracle(target, drafter, block_size, kw)
    return chain_decoder(target, drafter, tokenizer, block_size=block_size, proposer=proposer, **kw)


def TreeOracleDecoder(  # noqa: N802
    target: Any, drafter: Any, tokenizer: Any = None, *, block_size: int | None = None, **kw: Any
) -> Any:
    """A tree decoder whose per-slot distributions come from ``OracleProposer``."""
    proposer = _oracle(target, drafter, block_size, kw)
    return tree_decoder(target, drafter, tokenizer, block_size=block_size, proposer=proposer, **kw)


def best_first_tree(
    logprobs: torch.Tensor, anchor: int, budget: int, vocab_ids: torch.Tensor | None = None, width: int = 0
) -> Any:
    """The decoder's best-first tree of ``budget`` nodes from [D, V] per-slot log-probabilities."""
    from runtime.engine.tree import slot_candidates, tree_from_candidates

    vals, toks = slot_candidates(logprobs, max(budget, width), vocab_ids)
    return tree_from_candidates(vals, toks, anchor, budget)


def collect_ids(events: Sequence[DecodeEvent]) -> list[int]:
    """Committed ids of an event list, in order."""
    return [t.token_id for e in events if not isinstance(e, Finished) for t in e.tokens]


def greedy_pair(
    target: Any, drafter: Any, prompt: Sequence[int], n: int, **dflash_kw: Any
) -> tuple[list[int], list[int]]:
    """Greedy ids of plain decoding and of DFlash (``dflash_kw``: e.g. ``block_size``) on ``target``,
    for tests that hold both to one reference."""
    from runtime.engine import plain_decoder

    params = SamplingParams(max_new_tokens=n)
    plain = collect_ids(list(plain_decoder(target).stream(prompt, params)))
    return plain, collect_ids(list(chain_decoder(target, drafter, **dflash_kw).stream(prompt, params)))


def make_stats(**kw: Any) -> GenerationStats:
    """GenerationStats with defaults for fakes."""
    base: dict[str, Any] = dict(
        prompt_tokens=5,
        generated_tokens=0,
        ttft_seconds=0.01,
        total_seconds=0.1,
        tokens_per_second=10.0,
        decode_tokens_per_second=10.0,
        acceptance=AcceptanceCounter(slots=3).counts(),
        block_size=4,
        verify_length=3,
        decoder="dflash",
    )
    base.update(kw)
    return GenerationStats(**base)


class ScriptedDecoder:
    """A ``Decoder`` that replays scripted blocks (no model).

    Args:
        blocks: per verify step, a tuple (accepted texts, target text, rejected texts); the first
            entry of ``first`` is the prefill token text.
        first: text of the first (prefill) token.
        delay: seconds to sleep before each block (to test cancellation and streaming).
        fail_after: raise ``RuntimeError`` after this many blocks (to test error paths).
    """

    name = "scripted"

    def __init__(
        self,
        blocks: Sequence[tuple[Sequence[str], str, Sequence[str]]],
        first: str = "",
        delay: float = 0.0,
        fail_after: int | None = None,
        error: Exception | None = None,
    ) -> None:
        self.blocks = list(blocks)
        self.first = first
        self.delay = delay
        self.fail_after = fail_after
        self.error = error
        self.calls: list[tuple[list[int], SamplingParams]] = []

    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, cancel: CancelToken | None = None
    ) -> Iterator[DecodeEvent]:
        self.calls.append((list(prompt_ids), params))
        t0 = time.perf_counter()
        next_id = 1000
        first = TokenEvent(next_id, self.first, TokenStatus.TARGET)
        generated, counter = 1, AcceptanceCounter(slots=3)
        yield PrefillDone(prompt_tokens=len(prompt_ids), seconds=0.01, tokens=(first,))
        reason = "length"
        for i, (acc, tgt, rej) in enumerate(self.blocks):
            if cancel is not None and cancel.cancelled:
                reason = "cancelled"
                break
            if self.fail_after is not None and i >= self.fail_after:
                raise self.error or RuntimeError("scripted failure")
            if self.delay:
                time.sleep(self.delay)
            toks = []
            for text in acc:
                next_id += 1
                toks.append(TokenEvent(next_id, text, TokenStatus.ACCEPTED))
            next_id += 1
            toks.append(TokenEvent(next_id, tgt, TokenStatus.TARGET))
            draft = tuple(range(next_id + 100, next_id + 100 + len(acc) + len(rej)))
            counter.record(len(draft), len(acc))
            generated += len(toks)
            yield BlockVerified(
                draft=draft,
                draft_text=tuple(acc) + tuple(rej),
                accepted=len(acc),
                tokens=tuple(toks),
                seconds=0.01,
            )
        stats = make_stats(
            prompt_tokens=len(prompt_ids),
            generated_tokens=generated,
            total_seconds=time.perf_counter() - t0,
            acceptance=counter.counts(),
        )
        yield Finished(reason=reason, stats=stats)  # type: ignore[arg-type]


def write_json(path: Path, data: Any) -> None:
    """Write JSON (test helper)."""
    path.write_text(json.dumps(data))


def one_line(output: str) -> str:
    """A CLI's output as one line: rich's error-box borders and the wrapping of its message removed,
    so a test can look for a whole sentence whatever the terminal width and the paths in it."""
    return " ".join(re.sub("[│╭╮╰╯─]", " ", output).split())


def one_line_error(r: Any, code: int, *needles: str) -> None:
    """The CLI failed with exit code `code` and one `dflash: error: ...` line naming every needle."""
    assert r.exit_code == code, r.output
    assert r.stderr.startswith("dflash: error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.output
    for n in needles:
        assert n in r.stderr, (n, r.stderr)


def answered_dataset(
    folder: Path, tok: Any, replies: Sequence[str], per_shard: int = 2, hidden: int = 4, taps: Sequence[int] = (1,)
) -> Path:
    """A dataset folder laid out as generate_dataset writes it, whose answers are ``replies``."""
    from runtime.train.data import encode_prompt, write_shard

    folder.mkdir(parents=True)
    prompts = [
        {"text": f"Write function number {i}.", "chat": True, "source": f"task:Lang{i}"} for i in range(len(replies))
    ]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    meta = {"taps": list(taps), "hidden_size": hidden, "max_new_tokens": 256, "max_prompt_tokens": 512}
    (folder / "dataset.json").write_text(json.dumps({**meta, "num_prompts": len(prompts)}))
    for si, start in enumerate(range(0, len(prompts), per_shard)):
        seqs, sources = [], []
        for p, reply in zip(prompts[start : start + per_shard], replies[start : start + per_shard], strict=True):
            ids = encode_prompt(tok, p["text"], True)
            ans = tok.encode(reply, add_special_tokens=False)
            seqs.append((ids + ans, torch.zeros(len(ids) + len(ans), hidden * len(taps)), len(ids)))
            sources.append(p["source"])
        write_shard(folder / f"shard-{si:05d}.safetensors", seqs, {**meta, "sources": sources})
    return folder
