"""`dflash serve` for real: a subprocess on a loopback port with tiny models, driven over HTTP.

Two servers per test session (conftest.py, shared with the chat/bench --server tests): the tiny pair
with a tokenizer (chat and text), and the reference fixture (token ids; its drafter was trained
enough that drafts get accepted).
"""

from __future__ import annotations

import json
import threading

import pytest
from typer.testing import CliRunner

from dflash_cli.app import app
from runtime import DecodeOptions, LoadOptions, ModelRef, RuntimeConfig, SamplingParams, load_pipeline
from runtime.engine.events import Finished
from tests.http_helpers import get, metric, post, request, sse

MESSAGES = [{"role": "user", "content": "def fib(n):"}]
runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def _both_servers(serve_pool):
    """This module uses both servers: start them together (conftest.py's ``server`` and ``fixture_server``)."""
    serve_pool.get("tiny", "fixture")


@pytest.fixture(scope="module")
def local(tiny_pair):
    t, d = tiny_pair
    return load_pipeline(
        ModelRef(target=str(t), drafter=str(d)), RuntimeConfig(device="cpu", dtype="float32"), LoadOptions()
    )


def greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=n, **kw)


def local_text(events):
    return "".join(e.text for e in events if not isinstance(e, Finished))


def test_models_lists_the_served_pair(server):
    status, body = get(server.url + "/v1/models")
    assert status == 200 and body["object"] == "list"
    card = body["data"][0]
    assert card["id"] == "target" and card["owned_by"] == "dflash"
    assert card["dflash"]["block_size"] == 4 and card["dflash"]["chat_template"] is True


def test_chat_matches_local_greedy_with_usage_and_stats(server, local):
    status, body = post(server.url + "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 16, "temperature": 0})
    assert status == 200, body
    assert body["object"] == "chat.completion" and body["model"] == "target"
    events = list(local.stream_messages(MESSAGES, greedy(16)))
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": local_text(events)}
    assert choice["finish_reason"] == ("length" if events[-1].reason == "length" else "stop")
    usage, stats = body["usage"], body["dflash"]["stats"]
    assert usage["prompt_tokens"] == len(local.encode_messages(MESSAGES))
    assert usage["completion_tokens"] == events[-1].stats.generated_tokens == stats["generated_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    steps = stats["verify_steps"]
    assert stats["decoder"] == "dflash" and stats["block_size"] == 4 and steps > 0
    assert stats["drafted_tokens"] > 0 and 0 <= stats["accepted_tokens"] <= stats["drafted_tokens"]
    assert stats["tau"] == pytest.approx((stats["accepted_tokens"] + steps) / steps)
    assert sum(stats["acceptance_histogram"]) == steps
    assert body["dflash"]["queue"]["position"] == 0


def test_chat_streaming_sends_chunks_with_token_status_then_usage(server):
    body = {"messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    status, chunks = sse(
        server.url + "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    _, whole = post(server.url + "/v1/chat/completions", body)
    assert status == 200 and chunks[-1] == "[DONE]"
    *content, finish, usage = chunks[:-1]
    assert content[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == content[0]["id"] for c in content)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    assert text == whole["choices"][0]["message"]["content"]
    tokens = [t for c in content for t in c["dflash"]["tokens"]]  # per-token origin, in order
    assert "".join(t["text"] for t in tokens) == text
    assert {t["status"] for t in tokens} <= {"accepted", "target"}
    assert [c["dflash"]["type"] for c in content] == ["prefill"] + ["block"] * (len(content) - 1)
    assert finish["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert finish["dflash"]["stats"]["generated_tokens"] == whole["usage"]["completion_tokens"]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]


def test_text_completion_streamed_and_not_match_local(server, local):
    prompt = "class Stack:\n    def push(self, x):"
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    status, whole = post(server.url + "/v1/completions", body)
    assert status == 200 and whole["object"] == "text_completion"
    _, chunks = sse(server.url + "/v1/completions", {**body, "stream": True})
    streamed = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    expected = local_text(local.stream(prompt, greedy(12), chat=False))
    assert whole["choices"][0]["text"] == streamed == expected
    assert whole["usage"]["prompt_tokens"] == len(local.encode(prompt, chat=False))


BAD = [
    ("invalid json", "/v1/chat/completions", b"{not json", 400, "invalid_json", None),
    ("not an object", "/v1/chat/completions", b"[1, 2]", 400, None, None),
    (
        "unknown model",
        "/v1/chat/completions",
        {"model": "gpt-9", "messages": MESSAGES},
        404,
        "model_not_found",
        "model",
    ),
    (
        "too many tokens",
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 65},
        400,
        "max_tokens_exceeded",
        "max_tokens",
    ),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "empty_messages", "messages"),
    ("no messages", "/v1/chat/completions", {"prompt": "x"}, 400, "empty_messages", "messages"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None, "messages"),
    ("bad temperature", "/v1/chat/completions", {"messages": MESSAGES, "temperature": "hot"}, 400, None, "temperature"),
    ("n > 1", "/v1/chat/completions", {"messages": MESSAGES, "n": 2}, 400, None, "n"),
    ("empty prompt", "/v1/completions", {"prompt": "  "}, 400, "empty_prompt", "prompt"),
    (
        "prompt beyond context",
        "/v1/completions",
        {"prompt": [5] * 600, "max_tokens": 4},
        400,
        "context_length_exceeded",
        None,
    ),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, case):
    _, path, body, want_status, want_code, want_param = case
    raw = body if isinstance(body, bytes) else None
    status, resp = request("POST", server.url + path, None if raw else body, raw=raw)
    assert status == want_status, resp
    err = resp["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    if want_code:
        assert err["code"] == want_code
    if want_param:
        assert err["param"] == want_param
    ok, again = post(server.url + "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert ok == 200, again


def test_unknown_endpoint_and_method(server):
    status, resp = get(server.url + "/v1/embeddings")
    assert status == 404 and resp["error"]["code"] == "not_found"
    status, resp = get(server.url + "/v1/chat/completions")
    assert status == 405 and resp["error"]["code"] == "method_not_allowed"


def test_concurrent_requests_are_queued_one_generation_at_a_time(server):
    body = {"messages": MESSAGES, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    barrier, results = threading.Barrier(3), []

    def call():
        barrier.wait()
        results.append(post(server.url + "/v1/chat/completions", body))

    threads = [threading.Thread(target=call) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert [s for s, _ in results] == [200, 200, 200]
    texts = {r["choices"][0]["message"]["content"] for _, r in results}
    assert len(texts) == 1  # same greedy text for each
    assert all(r["usage"]["completion_tokens"] == 24 for _, r in results)
    queue = sorted((r["dflash"]["queue"] for _, r in results), key=lambda q: q["started_at"])
    for earlier, later in zip(queue, queue[1:], strict=False):
        assert later["started_at"] >= earlier["finished_at"]  # never two generations at once
    assert max(q["position"] for q in queue) >= 1 and max(q["wait_seconds"] for q in queue) > 0


def test_metrics_counters_move(server):
    _, before = get(server.url + "/metrics")
    status, body = post(server.url + "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 10, "temperature": 0})
    assert status == 200
    post(server.url + "/v1/chat/completions", {"messages": []})
    _, after = get(server.url + "/metrics")
    stats = body["dflash"]["stats"]

    def delta(name, labels=""):
        return metric(after, name, labels) - metric(before, name, labels)

    assert delta("dflash_requests_total", 'endpoint="chat",status="200"') == 1
    assert delta("dflash_requests_total", 'endpoint="chat",status="400"') == 1
    assert delta("dflash_prompt_tokens_total") == body["usage"]["prompt_tokens"]
    assert delta("dflash_generation_tokens_total") == body["usage"]["completion_tokens"]
    assert delta("dflash_draft_tokens_total") == stats["drafted_tokens"] > 0
    assert delta("dflash_accepted_tokens_total") == stats["accepted_tokens"]
    assert delta("dflash_verify_steps_total") == stats["verify_steps"]
    assert delta("dflash_tau_count") == 1 and delta("dflash_tau_sum") == pytest.approx(stats["tau"])


def test_accepted_drafts_are_reported_and_counted(fixture_server, fixture_dir):
    golden = json.loads((fixture_dir / "golden.json").read_text())
    prompt, n = golden["prompt_ids"], golden["max_new_tokens"]
    _, before = get(fixture_server.url + "/metrics")
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    status, chunks = sse(fixture_server.url + "/v1/completions", body)
    assert status == 200
    tokens = [t for c in chunks[:-1] if c["dflash"]["type"] != "done" for t in c["dflash"]["tokens"]]
    assert [t["id"] for t in tokens] == golden["dflash_output_ids"][len(prompt) :]
    stats = chunks[-2]["dflash"]["stats"]
    assert stats["accepted_tokens"] == sum(t["status"] == "accepted" for t in tokens) > 0
    assert stats["tau"] > 1.0
    _, after = get(fixture_server.url + "/metrics")
    accepted = metric(after, "dflash_accepted_tokens_total") - metric(before, "dflash_accepted_tokens_total")
    assert accepted == stats["accepted_tokens"]


# -- dflash run --server gives what the local run gives ----------------------------------------------------
def cli(args):
    return runner.invoke(app, ["run", *args], input="")


@pytest.mark.parametrize("mode", [["--raw"], ["--chat", "--system", "Be brief."]], ids=["raw", "chat"])
def test_run_with_server_matches_local_run(server, tiny_pair, mode):
    t, d = tiny_pair
    local_run = cli(
        ["--target", str(t), "--drafter", str(d), "--dtype", "float32", "-n", "14", *mode, "def add(a, b):"]
    )
    remote_run = cli(["--server", server.url, "-n", "14", *mode, "def add(a, b):"])
    assert local_run.exit_code == 0 and remote_run.exit_code == 0, remote_run.output
    assert remote_run.stdout == local_run.stdout and remote_run.stdout


def test_run_with_server_json_keeps_token_origin_and_stats(fixture_server, fixture_dir):
    golden = json.loads((fixture_dir / "golden.json").read_text())
    ids = ",".join(map(str, golden["prompt_ids"]))
    pair = ["--target", str(fixture_dir / "target"), "--drafter", str(fixture_dir / "drafter"), "--dtype", "float32"]
    # the verify length is pinned: chosen from measured costs, it may differ between two processes
    k = ["--verify-length", "7"]
    local_run = cli([*pair, *k, "--prompt-ids", ids, "-n", "40", "--json"])
    remote_run = cli(["--server", fixture_server.url + "/v1", *k, "--prompt-ids", ids, "-n", "40", "--json", "--stats"])
    assert local_run.exit_code == 0 and remote_run.exit_code == 0, remote_run.output

    def shape(out):
        lines = [json.loads(x) for x in out.splitlines()]
        return [(x["type"], x.get("tokens"), x.get("draft"), x.get("accepted")) for x in lines[:-1]], lines[-1]

    local_events, local_done = shape(local_run.stdout)
    remote_events, remote_done = shape(remote_run.stdout)
    assert remote_events == local_events  # same tokens, same ACCEPTED/TARGET origin, same drafts
    for key in ("generated_tokens", "accepted_tokens", "drafted_tokens", "tau", "acceptance_histogram"):
        assert remote_done["stats"][key] == local_done["stats"][key]
    assert "tau" in remote_run.stderr and "tok/s" in remote_run.stderr


def test_run_with_server_prints_ids_when_the_served_target_has_no_tokenizer(fixture_server, fixture_dir):
    pair = ["--target", str(fixture_dir / "target"), "--drafter", str(fixture_dir / "drafter"), "--dtype", "float32"]
    local_run = cli([*pair, "--prompt-ids", "8,16,9,21", "-n", "12"])
    remote_run = cli(["--server", fixture_server.url, "--prompt-ids", "8,16,9,21", "-n", "12"])
    assert remote_run.exit_code == 0 and remote_run.stdout == local_run.stdout and remote_run.stdout.strip()


def test_run_with_server_rejects_target_and_reports_unreachable_server(tiny_pair, server):
    r = cli(["--server", server.url, "--target", str(tiny_pair[0]), "hi"])
    assert r.exit_code == 2 and "--server excludes --target" in r.stderr
    from tests.http_helpers import free_port

    r = cli(["--server", f"http://127.0.0.1:{free_port()}", "hi"])
    assert r.exit_code == 7 and "cannot reach the server" in r.stderr and r.stdout == ""


def test_decoder_options_per_request(server, local):
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "dflash": {"decoder": "ar"}}
    status, resp = post(server.url + "/v1/chat/completions", body)
    assert status == 200 and resp["dflash"]["stats"]["decoder"] == "ar"
    expected = local_text(local.stream_messages(MESSAGES, greedy(12), DecodeOptions(decoder="ar")))
    assert resp["choices"][0]["message"]["content"] == expected
    status, resp = post(server.url + "/v1/chat/completions", {**body, "dflash": {"decoder": "medusa"}})
    assert status == 400 and "decoder" in resp["error"]["message"]


@pytest.mark.parametrize(
    "opts",
    # the chain and its length are pinned: the served default picks chain or tree, and K, from the
    # server process's measured costs, which the local pipeline here does not have
    [
        DecodeOptions(tree_budget=0, verify_length=3),
        DecodeOptions(decoder="ar"),
        DecodeOptions(block_size=2),
        DecodeOptions(tree_budget=8),
    ],
    ids=["dflash", "ar", "b2", "tree8"],
)
def test_remote_backend_gives_the_local_events(server, local, opts):
    """What chat and bench do with --server: the same Backend calls, the same events as the local pair."""
    from runtime.client.remote import RemoteBackend

    remote = RemoteBackend(server.url)
    params = greedy(12, ignore_eos=True)
    got = list(remote.stream("def add(a, b):", params, opts, chat=False))
    want = list(local.stream("def add(a, b):", params, opts, chat=False))

    def shape(events):
        return [(type(e).__name__, [(t.token_id, t.text, t.status) for t in e.tokens]) for e in events[:-1]]

    assert shape(got) == shape(want) and len(got) > 2
    g, w = got[-1].stats, want[-1].stats
    assert (g.generated_tokens, g.decoder, g.block_size, g.drafted_tokens) == (
        w.generated_tokens,
        w.decoder,
        w.block_size,
        w.drafted_tokens,
    )
    if opts.tree_budget:  # the tree of every step comes back as it was verified
        trees = [[(e.draft, e.parents, e.path) for e in ev if e.type == "block"] for ev in (got, want)]
        assert trees[0] == trees[1] and any(p for _, p, _ in trees[0])
        assert g.tree_budget == w.tree_budget == 8
    assert remote.capabilities.per_token_origin and remote.describe()["engine"] == "dflash"
