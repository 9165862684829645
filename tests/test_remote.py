"""The remote backend against fake vLLM, SGLang and plain OpenAI servers on a loopback port.

The fakes answer in the shapes the engines document (vLLM: ``metrics.speculative_decoding`` on the
usage chunk, ``vllm:spec_decode_*`` counters on /metrics; SGLang: ``sglext.spec_tokens_details``).
"""

from __future__ import annotations

import json

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route
from typer.testing import CliRunner

from dflash_cli.app import app as cli_app
from runtime import SamplingParams
from runtime.client.flavours import parse_prometheus
from runtime.client.http import RemoteError
from runtime.client.remote import RemoteBackend
from runtime.engine.events import BlockVerified, Finished, PrefillDone, TokenStatus
from tests.http_helpers import ThreadServer, free_port

runner = CliRunner()
VLLM_SPEC = {
    "mean_acceptance_length": 2.5,
    "draft_acceptance_rate": 0.1,
    "acceptance_histogram": [1, 0, 1, 0],
    "num_spec_steps": 2,
    "num_accepted_draft_tokens": 3,
    "num_draft_tokens": 30,
    "num_spec_tokens": 15,
}
SGL_SPEC = {
    "spec_accept_rate": 0.1,
    "spec_accept_length": 2.5,
    "spec_num_correct_drafts": 6,
    "spec_num_proposed_drafts": 60,
    "spec_verify_ct": 4,
    "spec_correct_drafts_histogram": [1, 2, 1],
}


# llama-server's final-chunk timings: 2 tokens in 40 ms (50 tok/s), ngram drafts 6, accepted 1
LLAMA_TIMINGS = {
    "prompt_n": 7,
    "prompt_ms": 70.0,
    "predicted_n": 2,
    "predicted_ms": 40.0,
    "predicted_per_second": 50.0,
    "draft_n": 6,
    "draft_n_accepted": 1,
}


class FakeEngine:
    """An OpenAI-compatible fake that streams "Hel" + "lo" and records what it was sent."""

    def __init__(self, owner: str, model: str = "Qwen/Qwen3-8B", key: str | None = None) -> None:
        self.owner, self.model, self.key = owner, model, key
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.per_request_metrics = True
        self.counters = [10.0, 100.0, 40.0]  # vllm: drafts, draft tokens, accepted tokens
        self.per_pos = [25.0, 15.0]  # vllm: accepted tokens per draft position (they add up to the accepted)
        self.fail_mid_stream = False
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.models),
                Route("/v1/chat/completions", self.complete, methods=["POST"]),
                Route("/v1/completions", self.complete, methods=["POST"]),
                Route("/metrics", self.metrics),
            ]
        )

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": self.owner}]})

    async def metrics(self, request: Request):
        d, t, a = self.counters
        p0, p1 = self.per_pos
        lines = [
            "# TYPE vllm:spec_decode_num_drafts counter",
            f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {d}',
            f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {t}',
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {a}',
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} {p0}',
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="1"}} {p1}',
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def complete(self, request: Request):
        self.headers.append(dict(request.headers))
        if self.key and request.headers.get("authorization") != f"Bearer {self.key}":
            return JSONResponse({"error": {"message": "Unauthorized", "type": "auth"}}, status_code=401)
        body = await request.json()
        self.requests.append(body)
        if body.get("model") != self.model:
            return JSONResponse(
                {"error": {"message": f"The model `{body.get('model')}` does not exist."}}, status_code=404
            )
        chat = request.url.path.endswith("chat/completions")
        self.counters = [self.counters[0] + 2, self.counters[1] + 30, self.counters[2] + 3]
        self.per_pos = [self.per_pos[0] + 2, self.per_pos[1] + 1]  # 2 steps: both accept draft 1, one draft 2

        def choice(text, finish=None):
            if chat:
                return {"index": 0, "delta": {"content": text} if text is not None else {}, "finish_reason": finish}
            return {"index": 0, "text": text or "", "finish_reason": finish}

        def gen():
            yield {"choices": [choice("")]}
            yield {"choices": [choice("Hel")]}
            if self.fail_mid_stream:
                yield {"error": {"message": "engine died", "type": "InternalServerError"}}
                return
            yield {"choices": [choice("lo")]}
            last = {"choices": [choice(None, "stop")]}
            if self.owner == "llamacpp":  # llama-server: its own timings on the final chunk
                last["timings"] = LLAMA_TIMINGS
            yield last
            if self.owner == "sglang":
                yield {"choices": [], "sglext": {"spec_tokens_details": SGL_SPEC}}
            usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}
            if self.owner == "vllm" and self.per_request_metrics:
                usage["metrics"] = {"speculative_decoding": VLLM_SPEC}
            yield usage

        async def sse():
            for c in gen():
                yield f"data: {json.dumps(c)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")


def run_events(backend, **kw):
    return list(backend.stream("hi", SamplingParams(temperature=0.0, max_new_tokens=8), **kw))


def test_vllm_text_and_per_request_spec_metrics():
    fake = FakeEngine("vllm")
    with ThreadServer(fake.app) as srv:
        backend = RemoteBackend(srv.url + "/v1/")
        events = run_events(backend)
        assert backend.describe()["engine"] == "vllm" and backend.capabilities.per_token_origin is False
    assert isinstance(events[0], PrefillDone) and events[0].text == "Hel"
    assert isinstance(events[1], BlockVerified) and events[1].text == "lo" and events[1].draft == ()
    assert all(t.status == TokenStatus.TARGET for e in events[:-1] for t in e.tokens)
    done = events[-1]
    assert isinstance(done, Finished) and done.reason == "stop"
    s = done.stats
    assert (s.prompt_tokens, s.generated_tokens, s.verify_steps, s.drafted_tokens, s.accepted_tokens) == (
        7,
        2,
        2,
        30,
        3,
    )
    assert s.tau == 2.5 and s.block_size == 16 and s.verify_length == 15 and s.decoder == "dflash"
    assert s.acceptance_histogram == (1, 0, 1, 0) and s.per_position_acceptance == (0.5, 0.5, 0.0)
    sent = fake.requests[0]
    assert (
        sent["model"] == "Qwen/Qwen3-8B"
        and sent["stream"] is True
        and sent["stream_options"] == {"include_usage": True}
    )
    assert sent["chat_template_kwargs"] == {"enable_thinking": False} and "dflash" not in sent
    assert "return_spec_tokens_details" not in sent


def test_vllm_without_per_request_metrics_uses_prometheus_counters():
    fake = FakeEngine("vllm")
    fake.per_request_metrics = False
    with ThreadServer(fake.app) as srv:
        s = run_events(RemoteBackend(srv.url))[-1].stats
    assert (s.verify_steps, s.drafted_tokens, s.accepted_tokens) == (2, 30, 3)
    assert s.tau == pytest.approx(2.5) and s.per_position_acceptance == (1.0, 0.5)


def test_sglang_spec_tokens_details():
    fake = FakeEngine("sglang")
    with ThreadServer(fake.app) as srv:
        events = run_events(RemoteBackend(srv.url), chat=False)
    s = events[-1].stats
    assert "".join(e.text for e in events[:-1]) == "Hello"
    assert (s.verify_steps, s.drafted_tokens, s.accepted_tokens, s.tau) == (4, 60, 6, 2.5)
    assert s.block_size == 16 and s.acceptance_histogram == (1, 2, 1)
    sent = fake.requests[0]
    assert sent["return_spec_tokens_details"] is True and sent["prompt"] == "hi" and "chat_template_kwargs" not in sent


def test_plain_openai_server_gives_text_and_timing_only():
    fake = FakeEngine("openai", model="gpt-x")
    with ThreadServer(fake.app) as srv:
        s = run_events(RemoteBackend(srv.url))[-1].stats
        r = runner.invoke(cli_app, ["run", "--server", srv.url, "--stats", "hi"], input="")
    assert s.decoder == "remote" and s.verify_steps == 0 and s.generated_tokens == 2
    assert r.exit_code == 0 and r.stdout == "Hello"
    assert "tok/s" in r.stderr and "tau" not in r.stderr
    assert "chat_template_kwargs" not in fake.requests[0] and "return_spec_tokens_details" not in fake.requests[0]


def test_run_server_shows_engine_stats_and_maps_preset_names():
    fake = FakeEngine("vllm")
    with ThreadServer(fake.app) as srv:
        r = runner.invoke(cli_app, ["run", "--server", srv.url, "-m", "qwen3-8b", "--stats", "hi"], input="")
        bad = runner.invoke(cli_app, ["run", "--server", srv.url, "--decoder", "ar", "hi"], input="")
        unknown = runner.invoke(cli_app, ["run", "--server", srv.url, "-m", "llama-9", "hi"], input="")
    assert r.exit_code == 0 and r.stdout == "Hello", r.output
    assert "tau 2.50" in r.stderr and fake.requests[0]["model"] == "Qwen/Qwen3-8B"
    assert bad.exit_code == 2 and "not per request" in bad.stderr
    assert unknown.exit_code == 3 and "llama-9" in unknown.stderr


def test_api_key_comes_from_the_environment(monkeypatch):
    fake = FakeEngine("vllm", key="k-123")
    monkeypatch.delenv("DFLASH_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with ThreadServer(fake.app) as srv:
        r = runner.invoke(cli_app, ["run", "--server", srv.url, "hi"], input="")
        assert r.exit_code == 2 and "DFLASH_API_KEY" in r.stderr and r.stdout == ""
        monkeypatch.setenv("OPENAI_API_KEY", "k-123")
        r = runner.invoke(cli_app, ["run", "--server", srv.url, "hi"], input="")
        assert r.exit_code == 0 and r.stdout == "Hello"
        monkeypatch.setenv("DFLASH_API_KEY", "wrong")  # DFLASH_API_KEY wins over OPENAI_API_KEY
        r = runner.invoke(cli_app, ["run", "--server", srv.url, "hi"], input="")
        assert r.exit_code == 2


def test_failures_are_one_line_errors():
    fake = FakeEngine("vllm")
    fake.fail_mid_stream = True
    with ThreadServer(fake.app) as srv:
        r = runner.invoke(cli_app, ["run", "--server", srv.url, "hi"], input="")
    assert r.exit_code == RemoteError.exit_code and "engine died" in r.stderr
    assert r.stdout == "Hel"  # what arrived is kept
    r = runner.invoke(cli_app, ["run", "--server", f"127.0.0.1:{free_port()}", "hi"], input="")
    assert r.exit_code == RemoteError.exit_code and "cannot reach the server" in r.stderr
    assert "Traceback" not in r.output


def test_parse_prometheus_sums_label_sets():
    text = 'a_total{x="1"} 2\na_total{x="2"} 3\n# HELP b\nb_total 1\nc{position="0"} 4\n'
    assert parse_prometheus(text, ("a_total", "c")) == {"a_total": 5.0, "c[0]": 4.0}


def test_llamacpp_timings_give_its_own_decode_speed_and_acceptance():
    """llama-server's ``timings`` (measured in the server) replace client-side clocks; its draft
    counts give the acceptance of its speculative modes (steps = generated - accepted - 1)."""
    fake = FakeEngine("llamacpp")
    with ThreadServer(fake.app) as srv:
        events = run_events(RemoteBackend(srv.url + "/v1/"))
    s = events[-1].stats
    assert s.decoder == "llama.cpp" and s.decode_tokens_per_second == 50.0
    assert (s.ttft_seconds, round(s.total_seconds, 6), s.prompt_tokens, s.generated_tokens) == (0.07, 0.11, 7, 2)
    assert (s.drafted_tokens, s.accepted_tokens) == (6, 1) and abs(s.acceptance_rate - 1 / 6) < 1e-9
