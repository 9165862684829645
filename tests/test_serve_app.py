"""The serve app's edge cases on a loopback port, with a scripted backend (no model): API key, queue
limit, a client that disconnects mid-stream, a generation that fails mid-stream, body size limit."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from dflash_cli.server.app import create_app
from dflash_cli.server.config import ServeConfig
from dflash_cli.server.protocol import Limits
from runtime.backend import Capabilities
from tests.fakes import ScriptedDecoder
from tests.http_helpers import ThreadServer, get, metric, post, sse

MESSAGES = [{"role": "user", "content": "hi"}]
BLOCKS = [(["a", "b"], "c", ["x"]), ([], "d", ["y", "z"]), (["e"], "f", [])]


class ScriptedBackend:
    """A ``Backend`` that replays a ``ScriptedDecoder`` (prompt ids are the message count)."""

    capabilities = Capabilities()

    def __init__(self, decoder: ScriptedDecoder) -> None:
        self.decoder = decoder
        self.cancelled = threading.Event()

    def describe(self):
        return {"target": "scripted", "drafter": "scripted-drafter", "block_size": 4}

    def _run(self, ids, params, cancel):
        for event in self.decoder.stream(ids, params, cancel):
            if getattr(event, "reason", None) == "cancelled":
                self.cancelled.set()
            yield event

    def stream_messages(self, messages, params, opts=None, cancel=None):
        return self._run(list(range(len(messages))), params, cancel)

    def stream(self, prompt, params, opts=None, cancel=None, *, chat=None, system=None):
        return self._run([1, 2, 3], params, cancel)

    def stream_ids(self, prompt_ids, params, opts=None, cancel=None):
        return self._run(list(prompt_ids), params, cancel)


def serve(decoder, **config):
    backend = ScriptedBackend(decoder)
    app = create_app(backend, ServeConfig(model_names=("scripted",), **config))
    return backend, ThreadServer(app)


def test_scripted_stream_has_token_status_and_stats():
    _, srv = serve(ScriptedDecoder(BLOCKS, first="<"))
    with srv:
        status, chunks = sse(srv.url + "/v1/chat/completions", {"messages": MESSAGES, "stream": True})
    assert status == 200 and chunks[-1] == "[DONE]"
    texts = [c["choices"][0]["delta"].get("content") for c in chunks[:-2]]
    assert texts == ["<", "abc", "d", "ef"]
    statuses = [[t["status"] for t in c["dflash"]["tokens"]] for c in chunks[1:-2]]
    assert statuses == [["accepted", "accepted", "target"], ["target"], ["accepted", "target"]]
    assert [c["dflash"]["draft_text"] for c in chunks[1:-2]] == [["a", "b", "x"], ["y", "z"], ["e"]]
    stats = chunks[-2]["dflash"]["stats"]
    assert (stats["accepted_tokens"], stats["drafted_tokens"], stats["verify_steps"]) == (3, 6, 3)


def test_api_key_is_required_when_set():
    _, srv = serve(ScriptedDecoder(BLOCKS), api_key="s3cret")
    with srv:
        status, body = post(srv.url + "/v1/chat/completions", {"messages": MESSAGES})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, _ = get(srv.url + "/v1/models")
        assert status == 401
        status, _ = post(
            srv.url + "/v1/chat/completions", {"messages": MESSAGES}, headers={"Authorization": "Bearer nope"}
        )
        assert status == 401
        status, body = post(
            srv.url + "/v1/chat/completions", {"messages": MESSAGES}, headers={"Authorization": "Bearer s3cret"}
        )
        assert status == 200 and body["choices"][0]["message"]["content"]
        assert get(srv.url + "/health")[0] == 200  # health and metrics stay open
        assert get(srv.url + "/metrics")[0] == 200


def test_full_queue_answers_503_and_recovers():
    decoder = ScriptedDecoder(BLOCKS * 4, delay=0.15)
    _, srv = serve(decoder, max_queue=0)
    with srv:
        results = []
        slow = threading.Thread(
            target=lambda: results.append(post(srv.url + "/v1/chat/completions", {"messages": MESSAGES}))
        )
        slow.start()
        time.sleep(0.3)  # the first generation is running
        status, body = post(srv.url + "/v1/chat/completions", {"messages": MESSAGES})
        assert status == 503 and body["error"]["code"] == "server_busy" and body["error"]["type"] == "server_error"
        decoder.delay = 0.0
        slow.join(10)
        assert results[0][0] == 200
        status, _ = post(srv.url + "/v1/chat/completions", {"messages": MESSAGES})
        assert status == 200
        text = get(srv.url + "/metrics")[1]
        assert metric(text, "dflash_requests_total", 'endpoint="chat",status="503"') == 1


def test_client_disconnect_mid_stream_cancels_the_generation():
    decoder = ScriptedDecoder(BLOCKS * 20, delay=0.05)
    backend, srv = serve(decoder)
    with srv:
        req = urllib.request.Request(
            srv.url + "/v1/chat/completions",
            data=json.dumps({"messages": MESSAGES, "stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        resp = urllib.request.urlopen(req, timeout=10)
        assert resp.readline().startswith(b"data: ")
        resp.close()  # the client goes away after the first chunk
        # the decoder saw the cancel token and stopped after its current block
        assert backend.cancelled.wait(5), "the generation kept running for a client that left"
        decoder.delay = 0.0
        assert post(srv.url + "/v1/chat/completions", {"messages": MESSAGES})[0] == 200


def test_failure_mid_stream_is_reported_in_band_and_the_server_keeps_serving():
    decoder = ScriptedDecoder(BLOCKS, fail_after=1)
    _, srv = serve(decoder)
    with srv:
        status, chunks = sse(srv.url + "/v1/chat/completions", {"messages": MESSAGES, "stream": True})
        assert status == 200 and chunks[-1] == "[DONE]"
        assert chunks[-2]["error"]["type"] == "server_error" and "scripted failure" in chunks[-2]["error"]["message"]
        status, body = post(srv.url + "/v1/chat/completions", {"messages": MESSAGES})
        assert status == 500 and body["error"]["code"] == "internal_error"
        decoder.fail_after = None
        assert post(srv.url + "/v1/chat/completions", {"messages": MESSAGES})[0] == 200


def test_body_over_the_limit_is_413():
    _, srv = serve(ScriptedDecoder(BLOCKS), limits=Limits(max_tokens=16, max_body_bytes=2000))
    with srv:
        status, body = post(srv.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 5000}]})
        assert status == 413 and body["error"]["code"] == "request_too_large"
        assert post(srv.url + "/v1/chat/completions", {"messages": MESSAGES})[0] == 200


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": MESSAGES, "logprobs": True}, "logprobs"),
        ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": MESSAGES, "stop": ["a"] * 17}, "stop"),
        ({"messages": MESSAGES, "top_p": 0}, None),
        ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": MESSAGES, "dflash": {"block_size": "big"}}, "dflash.block_size"),
    ],
)
def test_unsupported_or_invalid_fields_are_400(body, param):
    _, srv = serve(ScriptedDecoder(BLOCKS))
    with srv:
        status, resp = post(srv.url + "/v1/chat/completions", body)
    assert status == 400 and resp["error"]["param"] == param, resp
