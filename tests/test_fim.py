"""Fill-in-the-middle prompts from the tokenizer's own FIM tokens (runtime.fim): the layouts the
families document, the stop tokens of a middle, and a clear error without FIM tokens."""

from __future__ import annotations

import pytest

from runtime import fim
from runtime.errors import InputError
from tests.fakes import make_tokenizer

PREFIX = "def fib(n):\n    if n < 2:\n        return n\n    "
SUFFIX = "\n\nprint(fib(10))\n"


@pytest.fixture(scope="module")
def qwen_tok():
    return make_tokenizer(fim="qwen")


def encode(tok, text):
    """The layout string tokenised with its control tokens parsed: what the model was trained on."""
    return list(tok.encode(text, add_special_tokens=False))


def test_qwen_prompt_is_the_documented_layout(qwen_tok):
    p = fim.build(qwen_tok, PREFIX, SUFFIX)
    assert p.family == "qwen"
    assert p.ids == encode(qwen_tok, f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>")
    ids = qwen_tok.convert_tokens_to_ids
    assert p.ids[0] == ids("<|fim_prefix|>") and p.ids[-1] == ids("<|fim_middle|>")


def test_qwen_repository_form_for_extra_files(qwen_tok):
    extra = [("utils.py", "def add(a, b):\n    return a + b\n"), ("main.py", "import os\n")]
    p = fim.build(qwen_tok, PREFIX, SUFFIX, extra)
    layout = (
        "<|repo_name|>myproject\n"
        "<|file_sep|>utils.py\ndef add(a, b):\n    return a + b\n"
        "<|file_sep|>main.py\nimport os\n"
        "<|file_sep|>filename\n"
        f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
    )
    assert p.ids == encode(qwen_tok, layout)
    named = fim.build(qwen_tok, "a", "b", extra[:1], repo="lib", path="src/x.py")
    assert named.ids == encode(
        qwen_tok, "<|repo_name|>lib\n<|file_sep|>utils.py\ndef add(a, b):\n    return a + b\n"
        "<|file_sep|>src/x.py\n<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>"
    )


def test_control_token_spellings_in_the_code_stay_text(qwen_tok):
    p = fim.build(qwen_tok, "x = '<|fim_middle|>'\n", "<|endoftext|>")
    mid, eot = qwen_tok.convert_tokens_to_ids(["<|fim_middle|>", "<|endoftext|>"])
    assert p.ids.count(mid) == 1 and p.ids[-1] == mid  # only the real hole marker
    assert eot not in p.ids


def test_qwen_middle_ends_at_its_end_tokens(qwen_tok):
    p = fim.build(qwen_tok, "a", "b")
    names = ["<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|fim_prefix|>", "<|im_end|>"]
    assert set(qwen_tok.convert_tokens_to_ids(names)) <= set(p.stop_ids)


@pytest.mark.parametrize(
    "family,layout",
    [
        ("starcoder", "<fim_prefix>{p}<fim_suffix>{s}<fim_middle>"),
        ("codellama", "▁<PRE>{p}▁<SUF>{s}▁<MID>"),
    ],
)
def test_other_families_are_read_from_the_vocabulary(family, layout):
    tok = make_tokenizer(fim=family)
    p = fim.build(tok, "a = 1\n", "b = 2\n")
    assert p.family == family
    assert p.ids == encode(tok, layout.format(p="a = 1\n", s="b = 2\n"))
    end = {"starcoder": "<|endoftext|>", "codellama": "▁<EOT>"}[family]
    assert tok.convert_tokens_to_ids(end) in p.stop_ids


def test_a_tokenizer_without_fim_tokens_is_a_clear_error():
    tok = make_tokenizer()
    assert fim.detect(tok) is None
    with pytest.raises(InputError, match="declares no fill-in-the-middle tokens"):
        fim.build(tok, "a", "b", target_name="tiny")
    with pytest.raises(InputError, match="has no tokenizer"):
        fim.build(None, "a", "b")


def test_ollama_template_names_the_suffix(qwen_tok):
    t = fim.ollama_template(fim.detect(qwen_tok))
    assert ".Suffix" in t and "<|fim_prefix|>" in t
    assert ".Suffix" not in fim.ollama_template(None)
