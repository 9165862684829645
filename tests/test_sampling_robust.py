"""No value that passes validation makes sampling fail (issue 46, defect 6): temperatures below
``GREEDY_BELOW`` decode greedily, top-p keeps at least the most likely token, and over the accepted
ranges of temperature, top-p and top-k and extreme logits (bf16 and float32) no step produces NaN
or an id outside the vocabulary."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from typer.testing import CliRunner

from dflash_cli.app import app
from runtime.config import GREEDY_BELOW, SamplingParams
from runtime.engine.sampling import probabilities, sample
from tests.fakes import one_line

V = 50
TEMPERATURES = [0.0, 1e-300, 1e-45, 1e-40, 1e-30, 1e-8, GREEDY_BELOW / 2, GREEDY_BELOW, 2e-5, 1e-3, 0.1, 0.8, 1.0, 2.0]
TEMPERATURES += [100.0, 1e30, 1e300]
TOP_PS = [None, 1e-300, 1e-45, 1e-30, 1e-8, 0.01, 0.5, 0.95, 0.999999, 1.0]
TOP_KS = [None, 0, 1, 2, V - 1, V, 10**9]


def extreme_logits(dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    """[4, V] logits batches: ordinary, huge, tiny, flat, one-hot, with the dtype's extremes and infinities."""
    big = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).tiny
    base = torch.randn(4, V, generator=gen)
    out = [base * s for s in (1e-30, 1e-5, 1.0, 30.0, 1e4, 1e30, 1e38)]
    out.append(torch.zeros(4, V))  # all equal
    out.append(torch.full((4, V), -big))  # all at the most negative finite value
    half = torch.linspace(0, big, V // 2)
    spread = torch.cat([-half.flip(0), half])[:V].repeat(4, 1)  # the whole range in one row
    assert bool(torch.isfinite(spread).all())
    out.append(spread)
    hot = torch.full((4, V), -1e4)
    hot[:, 7] = 1e4
    out.append(hot)
    masked = base.clone()
    masked[:, ::2] = float("-inf")  # half the vocabulary masked away
    out.append(masked)
    one_left = torch.full((4, V), float("-inf"))
    one_left[:, 3] = 0.0
    out.append(one_left)
    with_posinf = base.clone()
    with_posinf[:, 5] = float("inf")
    out.append(with_posinf)
    out.append(torch.full((4, V), tiny))
    out.append(base.sign() * tiny * 3)
    return [x.to(dtype) for x in out]


def check_step(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> None:
    probs = probabilities(logits, params)
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    assert bool(torch.isfinite(probs).all()), (params, logits)
    assert bool((probs >= 0).all())
    assert torch.allclose(probs.sum(-1), torch.ones(logits.shape[0]), atol=1e-4), (params, probs.sum(-1))
    ids = sample(logits, params, gen)
    assert ids.shape == (logits.shape[0],) and ids.dtype == torch.int64
    assert bool(((ids >= 0) & (ids < logits.shape[-1])).all()), (params, ids)
    # a token the filtered distribution forbids is never sampled
    assert bool((probs.gather(-1, ids[:, None]) > 0).all()), (params, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_no_accepted_value_makes_a_step_produce_nan_or_a_bad_id(dtype):
    gen = torch.Generator().manual_seed(0)
    batches = extreme_logits(dtype, torch.Generator().manual_seed(1))
    # the whole grid on a few batches, every batch on a slice of the grid
    for t, p, k in itertools.product(TEMPERATURES, TOP_PS, TOP_KS):
        params = SamplingParams(temperature=t, top_p=p, top_k=k)
        for logits in batches[2:4]:
            check_step(logits, params, gen)
    rng = random.Random(0)
    for logits in batches:
        for _ in range(40):
            params = SamplingParams(
                temperature=rng.choice([rng.choice(TEMPERATURES), 10 ** rng.uniform(-320, 300), rng.uniform(0, 2)]),
                top_p=rng.choice([rng.choice(TOP_PS), 10 ** rng.uniform(-320, 0), rng.uniform(1e-9, 1.0)]),
                top_k=rng.choice([rng.choice(TOP_KS), rng.randint(0, 2 * V)]),
            )
            check_step(logits, params, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_temperatures_below_the_epsilon_are_greedy_and_tiny_top_p_keeps_the_best_token(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, V, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    best = torch.argmax(logits.float(), dim=-1)
    for t in (1e-300, 1e-45, 1e-40, 1e-8, GREEDY_BELOW / 2):
        params = SamplingParams(temperature=t)
        assert params.greedy
        assert torch.equal(sample(logits, params, gen), best)
        assert torch.equal(probabilities(logits, params).argmax(-1), best)
        assert bool((probabilities(logits, params).max(-1).values == 1.0).all())
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy  # the epsilon itself samples
    for p in (1e-300, 1e-45, 1e-8):
        assert torch.equal(sample(logits, SamplingParams(temperature=0.8, top_p=p), gen), best)
    # a mild temperature still samples: not every row picks its argmax over many draws
    draws = torch.stack([sample(logits, SamplingParams(temperature=1.0, seed=0), gen) for _ in range(20)])
    assert bool((draws != best).any())


# -- the front ends --------------------------------------------------------------------------------------
runner = CliRunner()


def test_run_with_a_tiny_temperature_is_greedy(tiny_pair):
    t, d = tiny_pair
    args = ["run", "--target", str(t), "--drafter", str(d), "--dtype", "float32", "--device", "cpu", "--raw", "-n", "8"]
    greedy = runner.invoke(app, [*args, "--temperature", "0", "def fib(n):"])
    assert greedy.exit_code == 0, greedy.output
    for temp in ("1e-40", "1e-6"):
        r = runner.invoke(app, [*args, "--temperature", temp, "def fib(n):"])
        assert r.exit_code == 0, r.output
        assert r.stdout == greedy.stdout
    assert GREEDY_BELOW == 1e-5 and "below 1e-5" in one_line(runner.invoke(app, ["run", "--help"]).stdout)  # documented


@pytest.fixture(scope="module")
def tiny_server(tiny_pair):
    from dflash_cli.server.app import create_app
    from dflash_cli.server.config import ServeConfig
    from runtime import ModelRef, RuntimeConfig, load_pipeline
    from tests.http_helpers import ThreadServer

    t, d = tiny_pair
    pipe = load_pipeline(ModelRef(target=str(t), drafter=str(d)), RuntimeConfig(device="cpu", dtype="float32"))
    with ThreadServer(create_app(pipe, ServeConfig(model_names=("tiny",)))) as srv:
        yield srv


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 1e-45}, {"temperature": 0.8, "top_p": 1e-300}, {"temperature": 1e-6, "top_p": 1e-30}],
    ids=["temperature 1e-45", "top_p 1e-300", "both tiny"],
)
def test_server_tiny_temperature_or_top_p_is_200_and_greedy(tiny_server, sampling):
    from tests.http_helpers import post

    body = {"prompt": "def fib(n):", "max_tokens": 8}
    status, greedy = post(tiny_server.url + "/v1/completions", {**body, "temperature": 0})
    assert status == 200, greedy
    status, out = post(tiny_server.url + "/v1/completions", {**body, **sampling})
    assert status == 200, out
    assert out["choices"][0]["text"] == greedy["choices"][0]["text"]
