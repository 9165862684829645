"""Fill-in-the-middle prompts built from the target's own FIM tokens.

A FIM model completes the text between a prefix and a suffix when the prompt is laid out with
the control tokens it was trained with. Qwen2.5-Coder documents (README "fill in the middle" and
"repository level code completion")::

    <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>

and, with other files of the repository as context::

    <|repo_name|>{repo}
    <|file_sep|>{path}
    {text}<|file_sep|>{path}
    {text}<|file_sep|>{current path}
    <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>

The family is read from the tokenizer's vocabulary (added tokens included), never from the
model's name: Qwen2.5-Coder, CodeGemma, StarCoder/StarCoder2, DeepSeek-Coder and CodeLlama lay
their tokens out the same way (prefix, suffix, middle). The text between control tokens is
tokenised as plain text (``split_special_tokens``): a file that contains ``<|endoftext|>`` does
not end the prompt. Generation stops at the family's end-of-middle tokens (its end-of-text, pad
and file/repository separators) on top of the model's EOS.

Nothing here imports a UI; the CLI (``dflash run --suffix``) and the server (``/infill``,
``/api/generate`` and ``/v1/completions`` with ``suffix``) build their prompts here.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from runtime.errors import InputError
from runtime.textio import check_text

DEFAULT_REPO = "myproject"  # llama.cpp's /infill uses the same placeholders, so both servers read the same prompt
DEFAULT_PATH = "filename"
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"  # extra files of a family without a file separator token


@dataclass(frozen=True)
class _Family:
    name: str
    prefix: tuple[str, ...]  # spellings of each token, first found wins
    suffix: tuple[str, ...]
    middle: tuple[str, ...]
    repo: tuple[str, ...] = ()
    file_sep: tuple[str, ...] = ()
    stops: tuple[str, ...] = ()  # further end-of-middle tokens
    requires: tuple[str, ...] = ()  # tokens that tell this family from another with the same FIM names


# Order matters: CodeGemma shares Qwen's three FIM names and is told apart by its file separator.
FAMILIES: tuple[_Family, ...] = (
    _Family(
        "codegemma",
        ("<|fim_prefix|>",),
        ("<|fim_suffix|>",),
        ("<|fim_middle|>",),
        file_sep=("<|file_separator|>",),
        stops=("<eos>", "<end_of_turn>"),
        requires=("<|file_separator|>",),
    ),
    _Family(
        "qwen",
        ("<|fim_prefix|>",),
        ("<|fim_suffix|>",),
        ("<|fim_middle|>",),
        repo=("<|repo_name|>",),
        file_sep=("<|file_sep|>",),
        stops=("<|fim_pad|>", "<|endoftext|>", "<|im_end|>"),
    ),
    _Family(
        "starcoder",
        ("<fim_prefix>",),
        ("<fim_suffix>",),
        ("<fim_middle>",),
        repo=("<repo_name>",),
        file_sep=("<file_sep>",),
        stops=("<fim_pad>", "<|endoftext|>"),
    ),
    _Family(
        "deepseek",
        ("<｜fim▁begin｜>",),
        ("<｜fim▁hole｜>",),
        ("<｜fim▁end｜>",),
        stops=("<｜end▁of▁sentence｜>", "<|EOT|>"),
    ),
    _Family("codellama", ("▁<PRE>", "<PRE>"), ("▁<SUF>", "<SUF>"), ("▁<MID>", "<MID>"), stops=("▁<EOT>", "<EOT>")),
)


@dataclass(frozen=True)
class FimFormat:
    """A tokenizer's FIM tokens.

    Attributes:
        family: "qwen", "codegemma", "starcoder", "deepseek" or "codellama".
        prefix, suffix, middle: ids of the three control tokens, and their texts in ``names``.
        repo, file_sep: ids of the repository-name and file-separator tokens (None: the family
            has none; extra files are then joined before the prefix as plain text).
        stop_ids: ids that end a middle: the family's control and end tokens found in the vocabulary.
        bos: id prepended to the prompt (the tokenizer adds a BOS token), else None.
        names: the token texts, keyed "prefix", "suffix", "middle", "repo", "file_sep".
    """

    family: str
    prefix: int
    suffix: int
    middle: int
    repo: int | None
    file_sep: int | None
    stop_ids: tuple[int, ...]
    bos: int | None
    names: Mapping[str, str]

    def template(self) -> str:
        """The layout with ``{prefix}`` and ``{suffix}`` holes (for display and editor templates)."""
        n = self.names
        return f"{n['prefix']}{{prefix}}{n['suffix']}{{suffix}}{n['middle']}"


_CACHE: weakref.WeakKeyDictionary[Any, FimFormat | None] = weakref.WeakKeyDictionary()


def _vocab(tokenizer: Any) -> Mapping[str, int]:
    vocab = dict(tokenizer.get_vocab())
    for token, tid in (getattr(tokenizer, "added_tokens_encoder", None) or {}).items():
        vocab.setdefault(token, int(tid))
    return vocab


def detect(tokenizer: Any) -> FimFormat | None:
    """The tokenizer's FIM tokens, or None when it declares none (cached per tokenizer)."""
    if tokenizer is None:
        return None
    try:
        return _CACHE[tokenizer]
    except (KeyError, TypeError):
        pass
    found = _detect(tokenizer)
    try:
        _CACHE[tokenizer] = found
    except TypeError:  # not weak-referenceable: not cached
        pass
    return found


def _detect(tokenizer: Any) -> FimFormat | None:
    vocab = _vocab(tokenizer)

    def first(names: Sequence[str]) -> tuple[str, int] | None:
        for name in names:
            if name in vocab:
                return name, int(vocab[name])
        return None

    for fam in FAMILIES:
        if any(r not in vocab for r in fam.requires):
            continue
        core = [first(fam.prefix), first(fam.suffix), first(fam.middle)]
        if any(c is None for c in core):
            continue
        (pn, pid), (sn, sid), (mn, mid) = core  # type: ignore[misc]
        repo, sep = first(fam.repo), first(fam.file_sep)
        names = {"prefix": pn, "suffix": sn, "middle": mn}
        stops: set[int] = {pid, sid, mid}
        if repo is not None:
            names["repo"] = repo[0]
            stops.add(repo[1])
        if sep is not None:
            names["file_sep"] = sep[0]
            stops.add(sep[1])
        for name in fam.stops:
            if name in vocab:
                stops.add(int(vocab[name]))
        eos = getattr(tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            stops.add(eos)
        bos = getattr(tokenizer, "bos_token_id", None)
        add_bos = bool(getattr(tokenizer, "add_bos_token", False)) and isinstance(bos, int)
        return FimFormat(
            family=fam.name,
            prefix=pid,
            suffix=sid,
            middle=mid,
            repo=repo[1] if repo else None,
            file_sep=sep[1] if sep else None,
            stop_ids=tuple(sorted(stops)),
            bos=bos if add_bos else None,
            names=names,
        )
    return None


def require(tokenizer: Any, target_name: str = "this target") -> FimFormat:
    """``detect``, or a clear error.

    Raises:
        InputError: no tokenizer, or a tokenizer without FIM tokens.
    """
    if tokenizer is None:
        raise InputError(f"{target_name} has no tokenizer: fill-in-the-middle needs its FIM tokens")
    fmt = detect(tokenizer)
    if fmt is None:
        raise InputError(
            f"{target_name}'s tokenizer declares no fill-in-the-middle tokens (such as <|fim_prefix|>, "
            "<fim_prefix> or <PRE>); use a FIM-trained code model, e.g. Qwen2.5-Coder"
        )
    return fmt


def _text(tokenizer: Any, text: str) -> list[int]:
    """Plain text: control-token spellings inside it stay text."""
    if not text:
        return []
    return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


@dataclass(frozen=True)
class FimPrompt:
    """A built prompt: its ids and the ids that end the middle."""

    ids: list[int]
    stop_ids: tuple[int, ...]
    family: str


def build(
    tokenizer: Any,
    prefix: str,
    suffix: str,
    extra: Sequence[tuple[str, str]] = (),
    *,
    repo: str = DEFAULT_REPO,
    path: str = DEFAULT_PATH,
    target_name: str = "this target",
) -> FimPrompt:
    """The FIM prompt of ``prefix`` + hole + ``suffix``, with ``extra`` files ((path, text) pairs)
    in the repository form when the family has one.

    Raises:
        InputError: no FIM tokens, or text that is not valid Unicode.
    """
    fmt = require(tokenizer, target_name)
    for label, value in (("the prefix", prefix), ("the suffix", suffix)):
        check_text(value, label)
    ids: list[int] = [] if fmt.bos is None else [fmt.bos]
    if extra:
        for i, (name, text) in enumerate(extra):
            check_text(name, f"input_extra[{i}].filename")
            check_text(text, f"input_extra[{i}].text")
        if fmt.repo is not None and fmt.file_sep is not None:
            ids += [fmt.repo, *_text(tokenizer, repo + "\n")]
            for name, text in extra:
                ids += [fmt.file_sep, *_text(tokenizer, f"{name}\n{text}")]
            ids += [fmt.file_sep, *_text(tokenizer, path + "\n")]
        elif fmt.file_sep is not None:  # a file separator without a repository token (CodeGemma)
            for name, text in extra:
                ids += [fmt.file_sep, *_text(tokenizer, f"{name}\n{text}")]
            ids += [fmt.file_sep, *_text(tokenizer, path + "\n")]
        else:
            ids += _text(tokenizer, "".join(SNIPPET_SEPARATOR + text for _, text in extra))
    ids += [fmt.prefix, *_text(tokenizer, prefix), fmt.suffix, *_text(tokenizer, suffix), fmt.middle]
    return FimPrompt(ids=ids, stop_ids=fmt.stop_ids, family=fmt.family)


def ollama_template(fmt: FimFormat | None) -> str:
    """An Ollama-style template for ``/api/show``: it names ``.Suffix`` when the model can fill a
    middle (Continue enables fill-in-the-middle on that)."""
    if fmt is None:
        return "{{ .Prompt }}"
    n = fmt.names
    return (
        f"{{{{- if .Suffix }}}}{n['prefix']}{{{{ .Prompt }}}}{n['suffix']}{{{{ .Suffix }}}}{n['middle']}"
        "{{- else }}{{ .Prompt }}{{- end }}"
    )
