"""`dflash bench --dataset fim`: the held-out FIM cases, the per-case table (cold ar and dflash, the
warm request one keystroke later), float32 equality with plain decoding, and the /infill rows of a
llama.cpp server (an in-process fake that answers like llama-server: SSE chunks, then a final chunk
with ``timings``)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from typer.testing import CliRunner

from dflash_cli.app import app
from runtime.bench.fim import COLUMNS, load_fim_cases
from tests.http_helpers import ThreadServer

runner = CliRunner()
MIDDLE = ["value = compute(x)", "\n", "    return value", "\n"]  # what the fake server streams


class FakeLlamaServer:
    """llama-server's ``/infill`` as editors see it: streamed ``{"content", "stop": false}`` chunks,
    then ``{"stop": true, "timings": {...}, "tokens_cached", ...}``. Prompt "tokens" are characters;
    with ``cache_prompt`` the common prefix with its last cached prompt is not read again."""

    PER_SECOND = 42.5

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.cached = ""
        self.lock = threading.Lock()
        self.app = Starlette(routes=[Route("/infill", self.infill, methods=["POST"])])

    async def infill(self, request: Request) -> Any:
        body = await request.json()
        with self.lock:
            self.requests.append(body)
            self.auth.append(request.headers.get("authorization"))
            prompt = f"{body['input_prefix']}\x00{body['input_suffix']}"
            cache_n = 0
            if body.get("cache_prompt"):
                cache_n = len(os.path.commonprefix([self.cached, prompt]))
                self.cached = prompt
        n = int(body["n_predict"])
        pieces = MIDDLE[:n]
        final = {
            "content": "",
            "stop": True,
            "stop_type": "eos" if n >= len(MIDDLE) else "limit",
            "tokens_predicted": len(pieces),
            "tokens_evaluated": len(prompt),
            "tokens_cached": cache_n,
            "timings": {
                "cache_n": cache_n,
                "prompt_n": len(prompt) - cache_n,
                "prompt_ms": 12.0,
                "predicted_n": len(pieces),
                "predicted_ms": 30.0,
                "predicted_per_second": self.PER_SECOND,
            },
        }
        if not body.get("stream"):
            return JSONResponse({**final, "content": "".join(pieces)})

        def events() -> Any:
            for piece in pieces:
                yield f"data: {json.dumps({'content': piece, 'stop': False})}\n\n"
            yield f"data: {json.dumps(final)}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def fim_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny pair with Qwen's FIM tokens; its context widened to hold a whole case file (its
    byte-level tokenizer spends about one token per 1.5 characters)."""
    from tests.fakes import save_pair

    target, drafter = save_pair(tmp_path_factory.mktemp("fim-bench"), block_size=4, fim="qwen")
    cfg = json.loads((target / "config.json").read_text())
    cfg["max_position_embeddings"] = 2048
    (target / "config.json").write_text(json.dumps(cfg))
    return target, drafter


def bench(*args: str) -> Any:
    return runner.invoke(app, ["bench", "--dataset", "fim", *args])


def pair_args(pair: tuple[Path, Path]) -> list[str]:
    return ["--target", str(pair[0]), "--drafter", str(pair[1]), "--dtype", "float32", "--device", "cpu"]


def rows(stderr: str) -> dict[tuple[str, str], list[str]]:
    """The table's rows keyed by (case, engine)."""
    out = {}
    for line in stderr.splitlines():
        if line.startswith("| ") and not line.startswith(("| case ", "| ---")):
            cells = [c.strip() for c in line.strip("|").split("|")]
            out[(cells[0], cells[3])] = cells
    return out


def test_fim_cases_are_held_out_files_in_five_languages():
    from runtime.bench.datasets import load_dataset
    from runtime.train.dedupe import evaluation_index

    cases = load_fim_cases()
    assert len(cases) >= 24
    assert len({c.language for c in cases}) >= 5
    assert len({c.id for c in cases}) == len(cases)
    assert {c.cut for c in cases} == {"line", "lines", "block", "body"}
    for c in cases:
        assert c.prefix.strip() and c.middle.strip() and c.filename, c.id
        assert 20 <= (c.prefix + c.middle + c.suffix).count("\n") <= 120, c.id
    # registered as a dataset: the whole files, which every training dedupe checks against
    ps = load_dataset("fim")
    assert [p.id for p in ps.prompts] == [c.id for c in cases]
    index = evaluation_index()
    assert all(index.matches(c.prefix + c.middle + c.suffix) for c in cases)


def test_fim_bench_table_equality_warm_cache_and_llama_rows(fim_pair):
    fake = FakeLlamaServer()
    with ThreadServer(fake.app) as srv:
        r = bench(*pair_args(fim_pair), "--limit", "3", "-n", "8", "--llama-infill", srv.url)
    assert r.exit_code == 0, r.output
    cases = load_fim_cases()[:3]
    # the table (stderr): every column, one row per case and engine, and the medians
    assert "| " + " | ".join(COLUMNS) + " |" in r.stderr
    table = rows(r.stderr)
    for c in cases:
        for engine in ("ar", "dflash", "llama.cpp"):
            assert (c.id, engine) in table, (c.id, engine)
        ar, df, llama = table[(c.id, "ar")], table[(c.id, "dflash")], table[(c.id, "llama.cpp")]
        assert df[13] == "yes"  # float32: DFlash's tokens are plain decoding's
        assert float(df[6]) >= 1.0 and float(ar[6]) == 1.0  # tau
        assert int(df[8]) >= 0 and df[10].endswith("%") and df[10] != "0%"  # TTFT, warm cached share
        assert llama[7] == "42.5"  # its own timings.predicted_per_second
        assert llama[9] != "-" and llama[12] != "-"  # its middle holds a line: time to the first line
    assert table[("**median**", "dflash")][13] == "3/3"
    assert "dflash tokens equal plain decoding's on 3/3 cases" in r.stderr

    # the JSON document (stdout)
    doc = json.loads(r.stdout)
    assert doc["kind"] == "fim" and doc["engines"] == ["ar", "dflash", "llama.cpp"] and doc["dtype"] == "float32"
    for c, got in zip(cases, doc["cases"], strict=True):
        assert got["id"] == c.id
        ar, df, llama = (got["engines"][k] for k in ("ar", "dflash", "llama.cpp"))
        assert df["same_as_ar"] is True and df["cold"]["token_ids"] == ar["cold"]["token_ids"]
        assert df["cold"]["tokens_cached"] == 0 and ar["cold"]["tokens_cached"] == 0  # cold: cache off
        warm = df["warm"]
        # one character typed at the cursor: the prompt up to the cursor comes from the cache
        assert 0 < warm["tokens_cached"] < warm["prompt_tokens"] and warm["ttft_seconds"] > 0
        assert llama["cold"]["timings"]["predicted_per_second"] == FakeLlamaServer.PER_SECOND
        assert llama["cold"]["text"] == "".join(MIDDLE) and llama["cold"]["finish"] == "stop"
        assert llama["warm"]["tokens_cached"] == len(c.prefix)  # the fake's cache_n, read back
        assert llama["cold"]["first_line_seconds"] <= llama["cold"]["total_seconds"]

    # what llama.cpp was asked: per case cold (no cache), the file opened, then one keystroke later
    assert len(fake.requests) == 3 * len(cases)
    for i, c in enumerate(cases):
        cold, opened, typed = fake.requests[3 * i : 3 * i + 3]
        assert (cold["input_prefix"], cold["input_suffix"]) == (c.prefix, c.suffix)
        assert cold["cache_prompt"] is False and cold["n_predict"] == 8 and cold["temperature"] == 0
        assert opened["cache_prompt"] is True and opened["input_prefix"] == c.prefix
        assert typed["cache_prompt"] is True and typed["input_prefix"] == c.prefix + c.middle[0]
        assert typed["input_suffix"] == c.suffix and typed["n_predict"] == 8


def test_fim_bench_against_a_server_only_and_formats(monkeypatch):
    monkeypatch.setenv("DFLASH_API_KEY", "sekrit")
    fake = FakeLlamaServer()
    with ThreadServer(fake.app) as srv:
        r = bench("--server", srv.url, "--limit", "2", "-n", "4", "--format", "md")
        c = bench("--server", srv.url, "--limit", "1", "-n", "4", "--format", "csv")
    assert r.exit_code == 0, r.output
    table = rows(r.stdout)
    ids = [case.id for case in load_fim_cases()[:2]]
    assert set(table) == {(i, "server") for i in ids} | {("**median**", "server")}
    assert "servers only" in r.stderr
    assert set(fake.auth) == {"Bearer sekrit"}  # the key goes with every request
    assert c.exit_code == 0, c.output
    header, *lines = c.stdout.strip().splitlines()
    assert header.split(",") == list(COLUMNS) and lines[0].split(",")[3] == "server"


def test_fim_bench_bad_input(fim_pair, tiny_pair):
    r = bench(*pair_args(fim_pair), "--methods", "ar", "--label", "x")
    assert r.exit_code == 2 and "--dataset fim does not take --methods, --label" in r.stderr
    r = bench(*pair_args(fim_pair), "--block-size", "2,4")
    assert r.exit_code == 2 and "one --block-size" in r.stderr
    r = bench(*pair_args(fim_pair), "-n", "0")
    assert r.exit_code == 2 and "--max-tokens must be >= 1" in r.stderr
    r = runner.invoke(app, ["bench", "--llama-infill", "http://127.0.0.1:9"])
    assert r.exit_code == 2 and "--dataset fim" in r.stderr
    # a target without FIM tokens: a clear error before anything runs
    r = bench("--target", str(tiny_pair[0]), "--drafter", str(tiny_pair[1]), "--dtype", "float32", "--limit", "1")
    assert r.exit_code == 2 and "declares no fill-in-the-middle tokens" in r.stderr
    # nothing listening: the remote error's exit code, one line
    r = bench("--server", "http://127.0.0.1:9", "--limit", "1")
    assert r.exit_code == 7 and "cannot reach http://127.0.0.1:9/infill" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_fim_header_names_quantized_weights():
    """`--quantize int8` shows in the header above the table (the dtype alone said bfloat16)."""
    from types import SimpleNamespace

    from runtime.bench.fim_table import header_lines

    env = {"target": {"id": "T"}, "drafter": {"id": "D"}, "device_name": "CPU", "quantize": "int8"}
    result = SimpleNamespace(
        environment=env, cases=[1, 2], config=SimpleNamespace(max_new_tokens=8), servers={}, dtype="bfloat16",
        summary=lambda: {},
    )  # fmt: skip
    assert header_lines(result)[0].endswith("T + D, CPU, bfloat16, int8 weights")  # type: ignore[arg-type]
    result.environment = {**env, "quantize": None}
    assert header_lines(result)[0].endswith("T + D, CPU, bfloat16")  # type: ignore[arg-type]
