"""runtime.bench (runner, summary, config) / runtime.bench.datasets / runtime.bench.store without the CLI: acceptance statistics with
oracle and adversarial drafters, the measuring protocol, divergence reports, pitfalls, prompt sets."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from runtime import DecodeOptions, LoadOptions, ModelRef, RuntimeConfig, load_pipeline
from runtime.bench import runner as bench_mod
from runtime.bench.config import BenchConfig, MethodSpec
from runtime.bench.datasets import DATASETS, Prompt, PromptSet, load_dataset, load_prompt_file
from runtime.bench.methods import PromptRun
from runtime.bench.pitfalls import drafter_dtype, drafter_training_length, find_pitfalls
from runtime.bench.results import MethodResult
from runtime.bench.runner import encode_prompt, run_bench
from runtime.bench.store import BenchStore, compare_runs
from runtime.bench.summary import first_divergence, summarise
from runtime.engine.acceptance import AcceptanceCounts
from runtime.errors import ConfigError, InputError
from tests.fakes import OracleDecoder

PROMPTS = PromptSet("t", "code", "test", "none", (Prompt("a", "def add(a, b):", "raw"), Prompt("b", "x = 1", "raw")))


@pytest.fixture(scope="module")
def pipe(tiny_pair):
    t, d = tiny_pair
    return load_pipeline(
        ModelRef(target=str(t), drafter=str(d)), RuntimeConfig(device="cpu", dtype="float32"), LoadOptions()
    )


def with_oracle(pipe, monkeypatch, **kw):
    real = pipe.make_decoder

    def make(opts: DecodeOptions | None = None):
        if opts is not None and opts.decoder == "dflash":
            return OracleDecoder(pipe.target, pipe.drafter, pipe.tokenizer, block_size=4, **kw)
        return real(opts)

    monkeypatch.setattr(pipe, "make_decoder", make)


def test_oracle_drafter_gives_full_acceptance(pipe, monkeypatch):
    with_oracle(pipe, monkeypatch)
    res = run_bench(pipe, PROMPTS, BenchConfig(methods=("dflash",), block_sizes=(4,), max_new_tokens=9, warmup=0))
    ar, d = res.methods
    assert d.name == "dflash-b4" and d.block_size == 4
    assert d.tau == pytest.approx(4.0)  # 1 prefill token + 2 steps of 3 accepted drafts + 1 target token
    assert d.acceptance_rate == 1.0
    assert d.per_position_acceptance == (1.0, 1.0, 1.0)
    assert d.acceptance_histogram == (0, 0, 0, 4)  # 2 prompts x 2 steps, all 3 drafts accepted
    assert d.agreement == 2 and d.first_divergence is None
    assert ar.tau == 1.0 and ar.acceptance_rate is None and ar.speedup == 1.0


def test_adversarial_drafter_gives_no_acceptance(pipe, monkeypatch):
    with_oracle(pipe, monkeypatch, adversarial=True)
    res = run_bench(pipe, PROMPTS, BenchConfig(methods=("dflash",), block_sizes=(4,), max_new_tokens=6, warmup=0))
    d = res.method("dflash-b4")
    assert d.tau == 1.0 and d.acceptance_rate == 0.0
    assert d.per_position_acceptance == (0.0, 0.0, 0.0)
    assert d.acceptance_histogram[0] == sum(d.acceptance_histogram) == 10  # 2 prompts x 5 steps
    assert d.agreement == 2  # still lossless


def test_protocol_warms_up_then_rotates_methods_per_prompt(monkeypatch):
    calls: list[tuple[str, int, int]] = []

    def fake_run(name):
        def run(pipe, opts_or_method, ids, params, mem, **kw):
            method = opts_or_method if isinstance(opts_or_method, str) else opts_or_method.decoder
            calls.append((method, ids[0], params.max_new_tokens))
            return PromptRun(
                tokens=(1, 2, 3), seconds=0.1, ttft_seconds=0.01, acceptance=AcceptanceCounts(steps=2, committed=2)
            )

        return run

    monkeypatch.setattr(bench_mod, "run_decoder", fake_run("dec"))
    monkeypatch.setattr(bench_mod, "run_generate", fake_run("gen"))
    tok = SimpleNamespace(encode=lambda text, add_special_tokens=True: [len(text)], decode=lambda ids: "x")
    fake = SimpleNamespace(
        tokenizer=tok,
        is_chat_model=False,
        drafter=SimpleNamespace(config=SimpleNamespace(raw={})),
        target=SimpleNamespace(max_positions=None, config=SimpleNamespace()),
        pair=SimpleNamespace(target_name="t", target_dir="/t", drafter_name="d", drafter_dir="/d"),
        block_size=4,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    prompts = PromptSet("p", "code", "", "", tuple(Prompt(str(i), "x" * (i + 1), "raw") for i in range(3)))
    progress = []
    res = run_bench(
        fake, prompts, BenchConfig(methods=("hf", "dflash"), max_new_tokens=32), progress=lambda *a: progress.append(a)
    )
    warm, timed = calls[:3], calls[3:]
    assert [c[0] for c in warm] == ["ar", "hf", "dflash"] and all(c[2] == 16 for c in warm)  # short, untimed
    assert [c[0] for c in timed] == ["ar", "hf", "dflash", "hf", "dflash", "ar", "dflash", "ar", "hf"]
    assert [c[1] for c in timed] == [1, 1, 1, 2, 2, 2, 3, 3, 3]  # prompt by prompt
    assert all(c[2] == 32 for c in timed)
    assert progress[-1][:2] == (12, 12)
    assert [len(m.runs) for m in res.methods] == [3, 3, 3]


def run_of(tokens, seconds=1.0):
    return PromptRun(
        tokens=tuple(tokens),
        seconds=seconds,
        ttft_seconds=0.1,
        acceptance=AcceptanceCounts(steps=len(tokens) - 1, committed=len(tokens) - 1),
    )


def test_divergence_is_reported_at_the_first_differing_token():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # stopped early
    base = [run_of([1, 2, 3, 4]), run_of([5, 6, 7, 8])]
    runs = [run_of([1, 2, 3, 4], 0.5), run_of([5, 6, 9, 8], 2.0)]
    m = summarise(MethodSpec("pld", "pld"), runs, base, "prompt n-grams", True, ["p0", "p1"], lambda t: f"<{t}>")
    assert m.agreement == 1
    d = m.first_divergence
    assert (d.prompt_index, d.prompt_id, d.position, d.expected, d.got) == (1, "p1", 2, 7, 9)
    assert (d.expected_text, d.got_text) == ("<7>", "<9>")
    assert m.speedup == pytest.approx((2.0 + 0.5) / 2)  # median of the per-prompt ratios 2.0 and 0.5
    assert m.tok_s_median == pytest.approx((8 + 2) / 2) and m.tok_s_min == 2 and m.tok_s_max == 8
    sampled = summarise(MethodSpec("pld", "pld"), runs, base, None, False, ["p0", "p1"])
    assert sampled.agreement is None and sampled.first_divergence is None


def result(name, method, speedup, tau=1.2):
    base = summarise(MethodSpec(name, method, None), [run_of([1, 2])], None, None, False, ["p"])
    return MethodResult(**{**base.__dict__, "speedup": speedup, "tau": tau})


def test_pitfalls_each_with_a_fix():
    rows = [
        result("ar", "ar", 1.0),
        result("pld", "pld", 0.8),
        result("dflash-b16", "dflash", 0.7),
        result("dflash", "dflash", 1.3),
    ]
    w = find_pitfalls(
        rows,
        drafter_name="d",
        thinking=True,
        quantized="int8",
        drafter_dtype_name="bfloat16",
        longest_context=900,
        drafter_train_length=512,
    )
    codes = [x.code for x in w]
    assert codes == ["slower-than-ar", "slower-than-ar", "thinking-mode", "quantized-target", "context-beyond-training"]
    assert "pld" in w[0].message and "0.80x" in w[0].message
    assert "--block-size" in w[1].fix
    assert "int8" in w[3].message and "bfloat16" in w[3].message
    assert "900" in w[4].message and "512" in w[4].message
    assert all(x.fix for x in w)
    ok = find_pitfalls(
        [result("ar", "ar", 1.0), result("dflash", "dflash", 1.4)],
        drafter_name="d",
        longest_context=100,
        drafter_train_length=512,
    )
    assert ok == []
    assert find_pitfalls(rows[:2], drafter_name=None, thinking=True, quantized="int8")[1:] == []  # no dflash row


def test_drafter_training_metadata():
    assert drafter_training_length({"training": {"max_len": 640}}) == 640
    assert drafter_training_length({"dflash_config": {"training": {"seq_len": 3072}}}) == 3072
    assert drafter_training_length({"max_position_embeddings": 40960}) is None  # not a training length
    assert drafter_dtype({"torch_dtype": "bfloat16"}) == "bfloat16"
    assert drafter_dtype({"dtype": "float32", "training": {"dtype": "bfloat16"}}) == "bfloat16"


def test_builtin_prompt_sets_are_offline():
    sizes = {name: len(load_dataset(name).prompts) for name in DATASETS}
    assert sizes == {
        "humaneval": 164,
        "mbpp": 40,
        "gsm8k": 40,
        "mt-bench": 80,
        "chat-coding": 12,
        "ood-chat": 22,
        "fim": 27,
    }
    he = load_dataset("humaneval").prompts[0]
    assert he.id == "HumanEval/0" and he.mode == "raw" and he.text.startswith("from typing import List")
    mb = load_dataset("MBPP").prompts[0]
    assert (
        mb.mode == "chat" and "remove first and last occurrence" in mb.text and 'assert remove_Occ("hello"' in mb.text
    )
    assert load_dataset("mt_bench").prompts[0].id == "mt-bench/81"
    for name in DATASETS:
        assert load_dataset(name).describe()["license"]
    with pytest.raises(ConfigError, match="unknown dataset 'x'; use one of humaneval, mbpp, gsm8k, mt-bench"):
        load_dataset("x")


def test_prompt_files(tmp_path):
    f = tmp_path / "p.jsonl"
    lines = [
        json.dumps("plain string"),
        json.dumps({"id": "q1", "prompt": "def f():", "mode": "raw"}),
        json.dumps({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}),
        json.dumps({"question_id": 81, "turns": ["first turn", "second turn"]}),
        "",
    ]
    f.write_text("\n".join(lines))
    ps = load_prompt_file(f).prompts
    assert [p.id for p in ps] == ["p.jsonl:1", "q1", "p.jsonl:3", "81"]
    assert [p.mode for p in ps] == ["auto", "raw", "chat", "chat"]
    assert ps[2].messages[0] == {"role": "system", "content": "be brief"} and ps[2].text == "hi"
    assert ps[3].text == "first turn"
    t = tmp_path / "p.txt"
    t.write_text("one\n\n two \n")
    assert [p.text for p in load_prompt_file(t).prompts] == ["one", " two "]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"mode": "chat", "nothing": 1}\n')
    with pytest.raises(InputError, match="bad.jsonl line 1: no prompt text"):
        load_prompt_file(bad)


def test_encode_prompt_modes(pipe):
    raw = encode_prompt(pipe, Prompt("a", "hello", "raw"))
    chat = encode_prompt(pipe, Prompt("a", "hello", "chat"))
    auto = encode_prompt(pipe, Prompt("a", "hello"))
    assert raw == pipe.tokenizer.encode("hello") and len(chat) > len(raw)
    assert auto == chat  # the tiny target has a chat template, like `dflash run`
    assert encode_prompt(pipe, Prompt("a", "hello", "chat"), mode="raw") == raw


def test_store_roundtrip_and_compare(tmp_path):
    doc = {
        "created": "2026-01-01T00:00:00+00:00",
        "environment": {
            "target": {"id": "t"},
            "drafter": None,
            "device": "cpu",
            "device_name": "cpu",
            "dtype": "float32",
            "torch": "2",
            "transformers": "5",
        },
        "dataset": {"name": "mbpp", "count": 2},
        "config": {"max_new_tokens": 8, "temperature": 0.0},
        "methods": [
            {
                "name": "ar",
                "tokens_per_second": {"median": 10.0},
                "ttft_seconds": 0.1,
                "tau": 1.0,
                "acceptance_rate": None,
                "speedup": 1.0,
            }
        ],
    }
    store = BenchStore(tmp_path / "state" / "bench.sqlite")
    a = store.save(json.loads(json.dumps(doc)))
    doc["methods"][0]["tokens_per_second"]["median"] = 12.5
    doc["dataset"]["name"] = "gsm8k"
    b = store.save(json.loads(json.dumps(doc)), label="faster")
    assert (a, b) == (1, 2)
    assert [r.id for r in store.history()] == [2, 1] and store.history()[0].label == "faster"
    cmp = compare_runs(store.get("prev"), store.get("last"))
    assert cmp.rows[0].change("tok_s") == pytest.approx(0.25)
    assert cmp.differences == ("dataset: mbpp -> gsm8k",)
    with pytest.raises(InputError, match="not a bench run id"):
        store.get("abc")
    (tmp_path / "junk.sqlite").write_text("not a database")
    from runtime.errors import DFlashError

    with pytest.raises(DFlashError, match="unreadable"):
        BenchStore(tmp_path / "junk.sqlite").history()
