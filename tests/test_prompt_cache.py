"""The prompt cache: a request that shares a prefix with an earlier one reads only the rest of its
prompt, and its output equals an uncached run's (float32 greedy), for plain, chain and tree decoding."""

from __future__ import annotations

from dataclasses import replace

import pytest

from runtime import DecodeOptions, LoadOptions, ModelRef, RuntimeConfig, SamplingParams, load_pipeline
from runtime.engine import CancelToken
from runtime.engine.events import BlockVerified, Finished, PrefillDone
from runtime.engine.prompt_cache import PromptCache
from tests.fakes import collect_ids

MODES = {
    "plain": DecodeOptions(decoder="ar"),
    "chain": DecodeOptions(verify_length=3),
    "tree": DecodeOptions(tree_budget=6),
    "auto": DecodeOptions(),
}


@pytest.fixture(scope="module")
def pipe(tiny_pair):
    t, d = tiny_pair
    return load_pipeline(
        ModelRef(target=str(t), drafter=str(d)), RuntimeConfig(device="cpu", dtype="float32"), LoadOptions()
    )


def run(pipe, ids, opts, n=24):
    events = list(pipe.stream_ids(ids, SamplingParams(max_new_tokens=n, ignore_eos=True), opts))
    prefill = next(e for e in events if isinstance(e, PrefillDone))
    stats = events[-1].stats
    assert prefill.tokens_cached == stats.tokens_cached
    drafts = [e.draft for e in events if isinstance(e, BlockVerified)]
    return (collect_ids(events), drafts), stats.tokens_cached


def uncached(pipe, ids, opts, n=24):
    return run(pipe, ids, replace(opts, cache_prompt=False), n)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_second_turn_reads_only_the_new_message_and_decodes_the_same(pipe, mode):
    opts = MODES[mode]
    pipe.prompt_cache = PromptCache(2)
    first = pipe.encode("def add(a, b):\n    return", chat=False)
    (answer, _), cached = run(pipe, first, opts)
    assert cached == 0  # an empty cache
    second = first + answer + pipe.encode("\n\ndef sub(a, b):", chat=False)
    out, cached = run(pipe, second, opts)
    # the cache held the prompt and the answer but its last token (never seen by the target)
    assert cached == len(first) + len(answer) - 1
    assert out == uncached(pipe, second, opts)[0]  # the same text, and the drafter saw the same context


@pytest.mark.parametrize("mode", ["plain", "auto"])
def test_an_edited_file_reuses_the_lines_before_the_edit(pipe, mode):
    opts = MODES[mode]
    pipe.prompt_cache = PromptCache(1)
    text = "import os\nimport sys\n\ndef main():\n    path = os.getcwd()\n    print(path)\n"
    ids = pipe.encode(text, chat=False)
    run(pipe, ids, opts, n=8)
    edited = pipe.encode(text.replace("print(path)", "print(path, sys.argv)"), chat=False)
    shared = next(i for i, (a, b) in enumerate(zip(ids, edited, strict=False)) if a != b)
    out, cached = run(pipe, edited, opts, n=8)
    assert cached == shared > 0
    assert out == uncached(pipe, edited, opts, n=8)[0]
    again, cached = run(pipe, edited, opts, n=8)  # the same request again: all but one token cached
    assert cached == len(edited) - 1 and again == out


def test_slots_keep_two_contexts_and_evict_the_least_recent(pipe):
    pipe.prompt_cache = PromptCache(2)
    a = pipe.encode("class Stack:\n    def push(self, x):", chat=False)
    b = pipe.encode("SELECT name FROM users WHERE", chat=False)
    c = pipe.encode("fn main() { let v = vec![1, 2, 3];", chat=False)
    opts = MODES["auto"]
    for ids in (a, b):
        run(pipe, ids, opts, n=4)
    assert run(pipe, a, opts, n=4)[1] == len(a) - 1 and run(pipe, b, opts, n=4)[1] == len(b) - 1
    run(pipe, c, opts, n=4)  # evicts a (least recently used)
    assert run(pipe, a, opts, n=4)[1] == 0
    assert run(pipe, c, opts, n=4)[1] == len(c) - 1


def test_a_named_slot_is_used_and_a_cancelled_request_leaves_it_consistent(pipe):
    pipe.prompt_cache = PromptCache(3)
    opts = DecodeOptions(slot=2)
    ids = pipe.encode("def fib(n):\n    if n < 2:", chat=False)
    cancel = CancelToken()
    events = []
    for e in pipe.stream_ids(ids, SamplingParams(max_new_tokens=40, ignore_eos=True), opts, cancel):
        events.append(e)
        if isinstance(e, BlockVerified):
            cancel.cancel()
    assert isinstance(events[-1], Finished) and events[-1].reason == "cancelled"
    assert pipe.prompt_cache.cached_tokens()[2] > len(ids) - 1  # the prompt and what was committed
    longer = ids + collect_ids(events)
    out, cached = run(pipe, longer, opts)
    assert cached == len(longer) - 1 and out == uncached(pipe, longer, opts)[0]


def test_a_consumer_that_stops_reading_leaves_a_usable_slot(pipe):
    pipe.prompt_cache = PromptCache(1)
    ids = pipe.encode("for i in range(10):", chat=False)
    stream = pipe.stream_ids(ids, SamplingParams(max_new_tokens=40, ignore_eos=True), MODES["auto"])
    seen = [next(stream), next(stream)]
    stream.close()  # e.g. an HTTP client that went away
    committed = collect_ids(seen)
    out, cached = run(pipe, ids + committed, MODES["auto"])
    assert cached == len(ids) + len(committed) - 1
    assert out == uncached(pipe, ids + committed, MODES["auto"])[0]


def test_no_cache_reads_the_whole_prompt(pipe):
    pipe.prompt_cache = PromptCache(1)
    ids = pipe.encode("while True:", chat=False)
    run(pipe, ids, MODES["auto"], n=4)
    assert uncached(pipe, ids, MODES["auto"], n=4)[1] == 0
    pipe.prompt_cache = None
    assert run(pipe, ids, MODES["auto"], n=4)[1] == 0


def test_a_two_turn_chat_reads_only_the_new_message(pipe):
    """The chat template's second turn repeats the first turn and its answer: the cache holds them,
    and the prefill reads the new message (and the template's few tokens around it)."""
    pipe.prompt_cache = PromptCache(2)
    u1 = {"role": "user", "content": "Write a function that adds two numbers."}
    a1 = {"role": "assistant", "content": "def add(a, b):\n    return a + b"}
    u2 = {"role": "user", "content": "Now one that subtracts them, with a docstring."}
    text = pipe.tokenizer.apply_chat_template([u1, a1], tokenize=False)
    first = list(pipe.tokenizer.encode(text, add_special_tokens=False))  # what turn 1 left in the cache
    run(pipe, first, MODES["auto"], n=4)
    second = pipe.encode_messages([u1, a1, u2])
    (out, _), cached = run(pipe, second, MODES["auto"])
    assert cached >= len(first) - 2  # the whole first turn (the template may end it differently)
    assert len(second) - cached <= len(pipe.encode(u2["content"], chat=False)) + 20  # + the template around it
    assert out == uncached(pipe, second, MODES["auto"])[0][0]
