"""The endpoints editor plugins speak, replayed as the plugins send them: llama.vim/llama.vscode
(``/infill``), Tabby/twinny (``/completion``), Continue (Ollama ``/api/show`` + ``/api/generate``
with ``suffix``), minuet/Tabby (``/v1/completions`` with ``suffix``).

A scripted backend (no model) records the prompt ids and sampling it is given, so the tests check
the FIM prompt and the stop ids the engine receives and the wire format clients read; one test
runs a tiny real pair end to end."""

from __future__ import annotations

import json
import urllib.request

import pytest

from dflash_cli.server.app import create_app
from dflash_cli.server.config import ServeConfig
from runtime import fim
from runtime.backend import Capabilities
from tests.fakes import ScriptedDecoder, make_tokenizer
from tests.http_helpers import ThreadServer, get, post, sse

PREFIX = "def add(a, b):\n"
SUFFIX = "\n\nprint(add(1, 2))\n"
EXTRA = [{"filename": "utils.py", "text": "def sub(a, b):\n    return a - b\n"}]
# "    return a + b" then a blank line and an unindented line: what n_indent cuts
BLOCKS = [([" a", " +"], " b", []), (["\n"], "\n", []), (["def"], " g", [])]
TEXT = "    return a + b\n\ndef g"


class RecordingBackend:
    """A ``Backend`` with a tokenizer (FIM prompts are built from it) that replays a
    ``ScriptedDecoder`` and records what it was asked to generate."""

    capabilities = Capabilities()

    def __init__(self, decoder: ScriptedDecoder, tokenizer) -> None:
        self.decoder, self.tokenizer = decoder, tokenizer
        self.calls: list[dict] = []
        self.stop_token_ids = (tokenizer.eos_token_id,)

    def describe(self):
        return {"target": "tiny-coder", "drafter": "tiny-drafter", "block_size": 4}

    def stream(self, prompt, params, opts=None, cancel=None, *, chat=None, system=None):
        self.calls.append({"text": prompt, "chat": chat, "system": system, "params": params})
        return self.decoder.stream([1, 2, 3], params, cancel)

    def stream_ids(self, prompt_ids, params, opts=None, cancel=None):
        self.calls.append({"ids": list(prompt_ids), "params": params})
        return self.decoder.stream(list(prompt_ids), params, cancel)

    def stream_messages(self, messages, params, opts=None, cancel=None):
        raise AssertionError("editor endpoints never send a conversation")


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(fim="qwen")


def serve(tokenizer, blocks=BLOCKS, delay=0.0):
    backend = RecordingBackend(ScriptedDecoder(blocks, first="    return", delay=delay), tokenizer)
    return backend, ThreadServer(create_app(backend, ServeConfig(model_names=("tiny-coder",))))


def fim_ids(tok, prefix, suffix, extra=()):
    return fim.build(tok, prefix, suffix, [(e["filename"], e["text"]) for e in extra]).ids


LLAMA_VIM_FIELDS = [
    "content",
    "timings/prompt_n",
    "timings/prompt_ms",
    "timings/prompt_per_token_ms",
    "timings/prompt_per_second",
    "timings/predicted_n",
    "timings/predicted_ms",
    "timings/predicted_per_token_ms",
    "timings/predicted_per_second",
    "truncated",
    "tokens_cached",
]


def test_llama_vim_sequence(tok):
    backend, srv = serve(tok)
    with srv:
        # 1. warm-up as llama.vim sends it on opening a file: n_predict 0, nothing wanted back
        warm = {
            "input_prefix": PREFIX,
            "input_suffix": SUFFIX,
            "input_extra": EXTRA,
            "prompt": "",
            "n_predict": 0,
            "samplers": [],
            "cache_prompt": True,
            "t_max_prompt_ms": 1,
            "t_max_predict_ms": 1,
            "response_fields": [""],
        }
        status, body = post(srv.url + "/infill", warm)
        assert (status, body) == (200, {})
        assert backend.calls[-1]["ids"] == fim_ids(tok, PREFIX, SUFFIX, EXTRA)  # the prompt was read
        # 2. a completion at the cursor: the current line so far is "prompt", appended to the prefix
        req = {
            "input_prefix": PREFIX,
            "input_suffix": SUFFIX,
            "input_extra": EXTRA,
            "prompt": "    ",
            "n_predict": 128,
            "stop": [],
            "n_indent": 4,
            "top_k": 40,
            "top_p": 0.90,
            "samplers": ["top_k", "top_p", "infill"],
            "stream": False,
            "cache_prompt": True,
            "id_slot": -1,
            "t_max_prompt_ms": 500,
            "t_max_predict_ms": 1000,
            "response_fields": LLAMA_VIM_FIELDS,
        }
        status, body = post(srv.url + "/infill", req)
    assert status == 200, body
    assert set(body) == set(LLAMA_VIM_FIELDS)  # flattened keys, nothing else
    ids = fim_ids(tok, PREFIX + "    ", SUFFIX, EXTRA)
    assert backend.calls[-1]["ids"] == ids
    assert body["content"] == "    return a + b\n"  # n_indent 4: the blank line and what follows are cut
    assert body["timings/prompt_n"] == len(ids) and body["tokens_cached"] == 0 and body["truncated"] is False
    assert body["timings/predicted_n"] >= 1 and body["timings/prompt_ms"] > 0
    params = backend.calls[-1]["params"]
    assert (params.top_k, params.top_p, params.temperature) == (40, 0.9, 1.0)  # no temperature sampler listed
    ends = tok.convert_tokens_to_ids(["<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>"])
    assert set(ends) <= set(params.stop_token_ids)  # the middle ends at Qwen's end-of-middle tokens


def test_infill_full_result_and_t_max_predict_ms(tok):
    blocks = [(["x"], "\n", [])] + [(["y"], "z", [])] * 30  # a newline first, then a long line
    _, srv = serve(tok, blocks, delay=0.03)
    with srv:
        status, full = post(srv.url + "/infill", {"input_prefix": "a", "input_suffix": "b", "temperature": 0})
        assert status == 200
        assert full["content"] == "    returnx\n" + "yz" * 30 and full["stop_type"] == "limit"
        assert full["tokens_predicted"] == 63 and full["tokens_evaluated"] == len(fim_ids(tok, "a", "b"))
        assert set(full["timings"]) >= {
            "prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second", "draft_n", "draft_n_accepted"
        }
        assert full["timings"]["draft_n_accepted"] == 31 and full["tokens_cached"] == 0
        status, cut = post(srv.url + "/infill", {"input_prefix": "a", "input_suffix": "b", "t_max_predict_ms": 150})
    assert status == 200
    # stopped once 150 ms had passed since the first token and a newline had come
    assert cut["stop_type"] == "limit" and 3 <= cut["tokens_predicted"] < 40, cut
    assert cut["content"].startswith("    returnx\n") and len(cut["content"]) < len(full["content"])


def test_infill_stream_n_cmpl_and_errors(tok):
    _, srv = serve(tok)
    with srv:
        status, chunks = sse(srv.url + "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "stream": True})
        assert status == 200
        assert all(c["stop"] is False for c in chunks[:-1]) and chunks[-1]["stop"] is True
        assert "".join(c["content"] for c in chunks) == TEXT
        assert chunks[-1]["stop_type"] == "limit" and "timings" in chunks[-1]
        status, many = post(srv.url + "/infill", {"input_prefix": "a", "input_suffix": "b", "n_cmpl": 2})
        assert status == 200 and [r["index"] for r in many] == [0, 1] and many[0]["content"] == TEXT
        status, body = post(srv.url + "/infill", {"input_prefix": 3})
        assert status == 400 and body["error"]["code"] == 400 and "input_prefix" in body["error"]["message"]
    _, plain = serve(make_tokenizer())  # a tokenizer without FIM tokens
    with plain:
        status, body = post(plain.url + "/infill", {"input_prefix": "a", "input_suffix": "b"})
    assert status == 400 and "fill-in-the-middle" in body["error"]["message"], body


def test_completion_raw_prompt_streams_content_and_stop(tok):
    backend, srv = serve(tok)
    prompt = "<|fim_prefix|>def f():\n<|fim_suffix|>\n<|fim_middle|>"  # Tabby/twinny lay FIM out themselves
    with srv:
        status, chunks = sse(srv.url + "/completion", {"prompt": prompt, "stream": True, "n_predict": 16})
        assert status == 200
        assert backend.calls[-1]["text"] == prompt and backend.calls[-1]["chat"] is False  # raw: no template
        assert all(set(c) >= {"content", "stop"} for c in chunks)
        assert "".join(c["content"] for c in chunks) == TEXT and chunks[-1]["stop"] is True
        status, body = post(srv.url + "/completion", {"prompt": [5, 6, 7], "n_predict": 4, "stop": ["+"]})
    assert status == 200 and backend.calls[-1]["ids"] == [5, 6, 7]
    assert backend.calls[-1]["params"].stop_strings == ("+",) and backend.calls[-1]["params"].max_new_tokens == 4


def test_continue_ollama_show_then_generate_with_suffix(tok):
    backend, srv = serve(tok)
    with srv:
        status, show = post(srv.url + "/api/show", {"name": "tiny-coder"})
        assert status == 200 and ".Suffix" in show["template"]  # Continue enables FIM on this
        assert {"completion", "insert"} <= set(show["capabilities"])
        assert get(srv.url + "/api/tags")[1]["models"][0]["name"] == "tiny-coder"
        assert get(srv.url + "/api/version")[1]["version"]
        body = {
            "model": "tiny-coder:latest",
            "prompt": PREFIX,
            "suffix": SUFFIX,
            "stream": False,
            "options": {"num_predict": 32, "temperature": 0.01, "stop": ["\n\n\n"], "num_ctx": 4096},
            "keep_alive": 1800,
        }
        status, out = post(srv.url + "/api/generate", body)
        assert status == 200, out
        assert backend.calls[-1]["ids"] == fim_ids(tok, PREFIX, SUFFIX)
        assert out["response"] == TEXT and out["done"] is True and out["done_reason"] == "length"
        assert out["prompt_eval_count"] == len(fim_ids(tok, PREFIX, SUFFIX)) and out["eval_count"] == 8
        assert out["total_duration"] > 0 and out["model"] == "tiny-coder"
        # Ollama streams NDJSON by default
        req = urllib.request.Request(
            srv.url + "/api/generate",
            data=json.dumps({"model": "tiny-coder", "prompt": PREFIX, "suffix": SUFFIX}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.headers["Content-Type"].startswith("application/x-ndjson")
            lines = [json.loads(x) for x in resp.read().decode().splitlines()]
        assert [x["done"] for x in lines] == [False] * (len(lines) - 1) + [True]
        assert "".join(x["response"] for x in lines) == TEXT and lines[-1]["eval_count"] == 8
        # raw: the prompt as it is; system ignored
        status, _ = post(srv.url + "/api/generate", {"model": "tiny-coder", "prompt": "x", "raw": True,
                                                     "system": "ignored", "stream": False})
        assert status == 200 and backend.calls[-1]["chat"] is False and backend.calls[-1]["system"] is None
        status, err = post(srv.url + "/api/generate", {"model": "other", "prompt": "x"})
        assert status == 404 and "tiny-coder" in err["error"]


def test_v1_completions_with_suffix_is_fill_in_the_middle(tok):
    backend, srv = serve(tok)
    with srv:
        status, body = post(srv.url + "/v1/completions", {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 16})
        assert status == 200, body
        assert backend.calls[-1]["ids"] == fim_ids(tok, PREFIX, SUFFIX)
        assert body["choices"][0]["text"] == TEXT
        assert tok.convert_tokens_to_ids("<|file_sep|>") in backend.calls[-1]["params"].stop_token_ids
        status, body = post(srv.url + "/v1/completions", {"prompt": "", "suffix": SUFFIX})  # top of a file
        assert status == 200 and backend.calls[-1]["ids"] == fim_ids(tok, "", SUFFIX)
        status, body = post(srv.url + "/v1/completions", {"prompt": [1, 2], "suffix": SUFFIX})
        assert status == 400 and body["error"]["param"] == "suffix"
        status, body = post(srv.url + "/v1/completions", {"prompt": " "})
        assert status == 400 and body["error"]["code"] == "empty_prompt"
    _, plain = serve(make_tokenizer())
    with plain:
        status, body = post(plain.url + "/v1/completions", {"prompt": PREFIX, "suffix": SUFFIX})
    assert status == 400 and body["error"]["param"] == "suffix" and "fill-in-the-middle" in body["error"]["message"]


def test_real_pair_infill_and_completion(fim_pair):
    from runtime import ModelRef, RuntimeConfig, load_pipeline

    t, d = fim_pair
    pipe = load_pipeline(ModelRef(target=str(t), drafter=str(d)), RuntimeConfig(device="cpu", dtype="float32"))
    with ThreadServer(create_app(pipe, ServeConfig(model_names=("tiny",)))) as srv:
        status, body = post(srv.url + "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 6,
                                                 "temperature": 0})
        assert status == 200, body
        assert body["tokens_evaluated"] == len(fim_ids(pipe.tokenizer, PREFIX, SUFFIX))
        assert 1 <= body["tokens_predicted"] <= 6 and body["timings"]["predicted_n"] == body["tokens_predicted"]
        prompt = f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
        status, chunks = sse(srv.url + "/completion", {"prompt": prompt, "n_predict": 6, "temperature": 0,
                                                       "stream": True})
        assert status == 200
        # special tokens in a raw /completion prompt are parsed: the same prompt, the same greedy text
        assert chunks[-1]["tokens_evaluated"] == body["tokens_evaluated"]
        assert "".join(c["content"] for c in chunks) == body["content"]


def test_real_pair_llama_vim_sequence_reads_only_the_edited_tail(fim_pair):
    """llama.vim: warm the cache with ``n_predict: 0`` when a file opens, then one completion per
    keystroke on the same file: each request after the first reads only what changed, and a cached
    request answers what an uncached one does."""
    from runtime import ModelRef, RuntimeConfig, load_pipeline

    t, d = fim_pair
    pipe = load_pipeline(ModelRef(target=str(t), drafter=str(d)), RuntimeConfig(device="cpu", dtype="float32"))
    before = "import os\nimport sys\n\n\ndef main(argv):\n    path = os.getcwd()\n"
    after = "\n\nif __name__ == '__main__':\n    main(sys.argv)\n"
    fields = ["content", "tokens_cached", "timings/prompt_n", "timings/cache_n", "tokens_evaluated"]
    with ThreadServer(create_app(pipe, ServeConfig(model_names=("tiny",)))) as srv:
        warm = {"input_prefix": before, "input_suffix": after, "prompt": "", "n_predict": 0, "cache_prompt": True,
                "input_extra": EXTRA, "response_fields": fields}
        status, body = post(srv.url + "/infill", warm)
        assert status == 200 and body["content"] == ""
        typed = {**warm, "prompt": "    print(", "n_predict": 8, "temperature": 0, "t_max_predict_ms": 500}
        status, first = post(srv.url + "/infill", typed)
        assert status == 200 and set(first) == set(fields)  # flattened response_fields honoured
        # the warm-up held the extra file and the text before the cursor line: only the tail is read
        assert first["tokens_cached"] > 0 and first["timings/cache_n"] == first["tokens_cached"]
        assert first["timings/prompt_n"] == first["tokens_evaluated"] - first["tokens_cached"]
        assert first["timings/prompt_n"] < first["tokens_evaluated"] // 2
        # the next keystroke: one more character on the cursor line (llama.cpp's layout puts it before
        # the suffix, so the suffix is read again; the extra files and the lines above are not)
        status, second = post(srv.url + "/infill", {**typed, "prompt": "    print(p"})
        assert status == 200 and second["tokens_cached"] >= first["tokens_cached"]
        assert second["timings/prompt_n"] == second["tokens_evaluated"] - second["tokens_cached"]
        status, fresh = post(srv.url + "/infill", {**typed, "prompt": "    print(p", "cache_prompt": False})
        assert status == 200 and fresh["tokens_cached"] == 0 and fresh["content"] == second["content"]


def test_a_newer_request_for_the_same_slot_supersedes_the_running_one(tok):
    """Editors send one request per keystroke: the newer ``/infill`` cancels the one still running."""
    import threading

    backend, srv = serve(tok, blocks=BLOCKS * 20, delay=0.05)
    with srv:
        out: dict[str, object] = {}

        def old() -> None:
            out["old"] = post(srv.url + "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 60})

        th = threading.Thread(target=old)
        th.start()
        for _ in range(200):  # wait until the old one runs
            if backend.calls:
                break
            threading.Event().wait(0.01)
        status, new = post(srv.url + "/infill", {"input_prefix": PREFIX + "x", "input_suffix": SUFFIX, "n_predict": 3})
        th.join(10)
        assert status == 200 and new["stop_type"] == "limit"
        old_status, old_body = out["old"]
        assert old_status == 200 and old_body["stop_type"] == "none"  # cancelled after its current step
        assert old_body["tokens_predicted"] < 60
        # a different id_slot is another editor: it does not cancel
        status, a = post(srv.url + "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 3,
                                               "id_slot": 1})
        assert status == 200 and a["stop_type"] == "limit"
