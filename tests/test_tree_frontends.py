"""Tree verification through the front ends and the budget choice: the budget policy, calibration of
tree-sized verifies, Pipeline.make_decoder, `dflash run/bench --tree-budget(s)`, serve's per-request
``tree_budget``, and the TUI's ghost text for losing branches."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from dflash_cli.app import app
from runtime import DecodeOptions, LoadOptions, ModelRef, RuntimeConfig, SamplingParams, load_pipeline
from runtime.engine import tree_decoder
from runtime.engine.acceptance import AcceptanceCounter
from runtime.engine.calibrate import VerifyCosts, measure_costs
from runtime.engine.events import BlockVerified, Finished, PrefillDone, TokenEvent, TokenStatus
from runtime.engine.models.target import TargetModel
from runtime.engine.plan import AdaptivePlanner, FixedPlanner, best_plan, expected_tokens, prior_coverage
from runtime.engine.step import StepOutcome
from runtime.engine.tree import chain_tree
from runtime.errors import ConfigError
from tests.fakes import collect_ids, greedy_reference, make_drafter, make_stats, make_target
from tests.http_helpers import post

runner = CliRunner()


# -- the budget policy ------------------------------------------------------------------------
def test_expected_tokens_of_chains_and_trees():
    cov = [[0.5, 0.3, 0.1], [0.5, 0.3, 0.1]]
    assert expected_tokens(cov, 0) == 1.0
    assert expected_tokens(cov, 2, chain=True) == pytest.approx(1 + 0.5 + 0.25)
    # best 2 nodes: rank0 at depth 1 (0.5), then rank1 at depth 1 (0.3) beats depth 2 (0.25)
    assert expected_tokens(cov, 2) == pytest.approx(1 + 0.5 + 0.3)
    assert expected_tokens(cov, 4) > expected_tokens(cov, 2) > expected_tokens(cov, 1)
    table = prior_coverage([0.6, 0.5], depth=3)
    assert len(table) == 3 and table[2][0] == 0.5 and all(sum(row) <= 1 for row in table)


def test_best_plan_follows_the_verify_costs():
    cov = prior_coverage([0.6], depth=7)
    flat = [1.0] * 65
    steep = [1.0 + 0.3 * n for n in range(65)]
    b, _ = best_plan(cov, flat, 0.1, 7)
    assert b == 64  # verifying is free: the biggest tree wins
    b, k = best_plan(cov, steep, 0.1, 7)
    assert b == 0 and 1 <= k <= 7  # every extra token costs: a short chain
    b, k = best_plan(cov, flat[:8], 0.1, 7)
    assert b == 0 and k == 7  # no cost known beyond the block: trees are not considered


def test_adaptive_policy_learns_from_ranks():
    pol = AdaptivePlanner(3, [1.0] * 65, prior=[0.5], prior_weight=2, every=1)
    before = pol.coverage()[0][1]
    step = StepOutcome(chain_tree(1, [2, 3, 4]), [0], [9, 9, 9, 9], [1, 1, -1], None, 3, 0.0)
    for _ in range(20):
        pol.observe(step)  # the target keeps picking the drafter's second choice
    assert pol.coverage()[0][1] > before and pol.choice[0] > 0 and pol.plan().tree


def test_adaptive_tree_decoding_switching_plans_stays_exact():
    model = make_target("qwen3", vocab_size=96, seed=2)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=6)
    # costs that make the plan move between chains and trees as the coverage estimate changes
    costs = [1.0 + 0.05 * n for n in range(33)]
    for p in ([1, 2, 3], [40, 41], [7] * 9):
        pol = AdaptivePlanner(5, costs, draft_cost=0.5, prior=[0.2], prior_weight=1, every=1)
        events = list(tree_decoder(target, drafter, tree_budget=pol).stream(p, SamplingParams(max_new_tokens=30)))
        assert collect_ids(events) == greedy_reference(model, p, 30)


def test_tree_budget_validation():
    with pytest.raises(ConfigError):
        DecodeOptions(tree_budget=-1)
    model = make_target("qwen3", vocab_size=64)
    target = TargetModel(model)
    with pytest.raises(ConfigError):
        tree_decoder(target, make_drafter(model.config, block_size=4), tree_budget=0)


# -- calibration and the pipeline -----------------------------------------------------------------
@pytest.fixture(scope="module")
def pipe(tiny_pair):
    t, d = tiny_pair
    return load_pipeline(
        ModelRef(target=str(t), drafter=str(d)), RuntimeConfig(device="cpu", dtype="float32"), LoadOptions()
    )


def test_calibration_costs_tree_sized_verifies(pipe):
    costs = measure_costs(pipe, context=8, reps=1, max_tokens=33)
    assert len(costs.verify) == 33 and costs.verify[0] == 1.0 and all(c > 0 for c in costs.verify)
    assert len(measure_costs(pipe, context=8, reps=1).verify) == pipe.block_size


def test_make_decoder_builds_chain_or_tree(pipe):
    def shape(opts: DecodeOptions) -> tuple[str, bool, int]:
        dec = pipe.make_decoder(opts)
        plan = dec.planner.plan()
        return dec.name, plan.tree, dec.lookup

    assert shape(DecodeOptions(tree_budget=0)) == ("dflash", False, 0)  # chains, no lookup
    dec = pipe.make_decoder(DecodeOptions(tree_budget=8))
    assert isinstance(dec.planner, FixedPlanner) and dec.tree_budget == 8 and dec.lookup == 16
    assert shape(DecodeOptions(decoder="ar", tree_budget=8)) == ("ar", False, 0)
    saved = pipe.costs
    try:
        pipe.costs = None  # auto on a CPU without measured tree costs: chains, as before
        assert shape(DecodeOptions()) == ("dflash", False, 0)
        pipe.costs = VerifyCosts(tuple([1.0] * 65), 0.1, 0.001)  # flat costs up to 65 tokens: a tree
        auto = pipe.make_decoder(DecodeOptions())
        assert isinstance(auto.planner, AdaptivePlanner) and auto.planner.plan().tree and auto.tree_budget >= 16
        fixed = pipe.make_decoder(DecodeOptions(verify_length=2)).planner  # a chain asked for: on the device
        assert isinstance(fixed, FixedPlanner) and fixed.plan().depth == 2 and not fixed.plan().on_host
        ids = pipe.encode("def add(a, b):", chat=False)
        params = SamplingParams(max_new_tokens=16, ignore_eos=True)
        want = collect_ids(list(pipe.stream(ids, params, DecodeOptions(decoder="ar"))))
        assert collect_ids(list(auto.stream(ids, params))) == want
    finally:
        pipe.costs = saved


# -- CLI ------------------------------------------------------------------------------------
def pair_args(tiny_pair):
    t, d = tiny_pair
    return ["--target", str(t), "--drafter", str(d), "--dtype", "float32", "--device", "cpu"]


def test_run_tree_budget_json_carries_the_tree(tiny_pair):
    base = [*pair_args(tiny_pair), "-n", "16", "--raw", "def fib(n):"]
    chain = runner.invoke(app, ["run", *base, "--tree-budget", "0"])
    tree = runner.invoke(app, ["run", *base, "--tree-budget", "6", "--json", "--stats"])
    assert chain.exit_code == 0 and tree.exit_code == 0, tree.output
    lines = [json.loads(x) for x in tree.stdout.splitlines()]
    blocks = [x for x in lines if x["type"] == "block"]
    assert any("parents" in b for b in blocks)
    for b in blocks:
        if "parents" in b:
            assert len(b["parents"]) == len(b["draft"]) == len(b["draft_text"]) <= 6
            assert len(b["path"]) == b["accepted"] and all(-1 <= p < i for i, p in enumerate(b["parents"]))
    assert lines[-1]["stats"]["tree_budget"] == 6
    assert "".join(t["text"] for x in lines[:-1] for t in x["tokens"]) == chain.stdout  # same text as the chain
    assert "tree 6" in tree.stderr
    # the stats line says how many nodes a step verified on average (the confidence cut varies it)
    st = lines[-1]["stats"]
    assert f"{st['drafted_tokens'] / st['verify_steps']:.1f} drafted/step" in tree.stderr
    bad = runner.invoke(app, ["run", *base, "--tree-budget", "-3"])
    assert bad.exit_code != 0 and "tree budget" in bad.stderr


def test_bench_tree_budget_rows(tiny_pair, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("def add(a, b):\nclass Stack:\n")
    r = runner.invoke(
        app,
        ["bench", *pair_args(tiny_pair), "--prompts", str(prompts), "-n", "10", "--methods", "dflash",
         "--tree-budgets", "0,4,auto", "--warmup", "0"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout.splitlines()[-1])
    rows = {m["name"]: m for m in doc["methods"]}
    assert list(rows) == ["ar", "dflash-chain", "dflash-tree4", "dflash-tree-auto"]
    assert rows["dflash-tree4"]["label"] == "dflash b4 tree4 lookup16" and rows["dflash-tree4"]["tree_budgets"] == [
        4,
        4,
    ]
    assert rows["dflash-chain"]["tree_budgets"] == [0, 0] and "tree" not in rows["dflash-chain"]["label"]
    assert all(m["agreement"]["identical"] == 2 for m in doc["methods"][1:])
    assert doc["config"]["tree_budgets"] == [0, 4, None]
    assert "dflash b4 tree4" in r.stderr
    bad = runner.invoke(app, ["bench", *pair_args(tiny_pair), "--tree-budgets", "4,x"])
    assert bad.exit_code != 0 and "--tree-budgets" in bad.stderr


def test_bench_lookup_rows_and_run_lookup_option(tiny_pair, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("def add(a, b): return a + b\\ndef add(a, b):\nclass Stack:\n")
    r = runner.invoke(
        app,
        ["bench", *pair_args(tiny_pair), "--prompts", str(prompts), "-n", "12", "--methods", "dflash",
         "--tree-budget", "4", "--lookups", "0,8,auto", "--warmup", "0"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout.splitlines()[-1])
    rows = {m["name"]: m for m in doc["methods"]}
    assert list(rows) == ["ar", "dflash-lookup0", "dflash-lookup8", "dflash-lookup-auto"]
    assert rows["dflash-lookup0"]["label"] == "dflash b4 tree4"
    assert rows["dflash-lookup8"]["label"] == "dflash b4 tree4 lookup8"
    assert rows["dflash-lookup-auto"]["label"] == "dflash b4 tree4 lookup16"
    assert [run["lookup"] for run in rows["dflash-lookup8"]["runs"]] == [8, 8]
    assert all(m["agreement"]["identical"] == 2 for m in doc["methods"][1:])
    assert doc["config"]["lookups"] == [0, 8, None]
    base = [*pair_args(tiny_pair), "-n", "16", "--raw", "--tree-budget", "4", "--stats", "def f(x): def f(x):"]
    on = runner.invoke(app, ["run", *base, "--lookup", "8"])
    off = runner.invoke(app, ["run", *base, "--lookup", "0"])
    assert on.exit_code == 0 and off.exit_code == 0, on.output
    assert on.stdout == off.stdout  # lossless either way
    assert "lookup 8 (" in on.stderr and "copied)" in on.stderr and "lookup" not in off.stderr
    for bad in (["run", *base, "--lookup", "-1"], ["bench", *pair_args(tiny_pair), "--lookups", "4,x"]):
        res = runner.invoke(app, bad)
        assert res.exit_code == 2 and "lookup" in res.stderr, res.output


# -- serve ----------------------------------------------------------------------------------
def test_serve_takes_tree_budget_per_request(server, pipe):
    body = {"prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0, "dflash": {"tree_budget": 5}}
    status, resp = post(server.url + "/v1/completions", body)
    assert status == 200, resp
    assert resp["dflash"]["stats"]["tree_budget"] == 5
    ids = pipe.encode("def add(a, b):", chat=False)
    want = "".join(
        e.text
        for e in pipe.stream(ids, SamplingParams(max_new_tokens=12), DecodeOptions(decoder="ar"))
        if e.type != "done"
    )
    assert resp["choices"][0]["text"] == want
    status, resp = post(server.url + "/v1/completions", {**body, "dflash": {"tree_budget": -1}})
    assert status == 400 and "tree_budget" in resp["error"]["message"]
    status, resp = post(server.url + "/v1/completions", {**body, "dflash": {"tree_budget": 100000}})
    assert status == 400 and "tree_budget" in resp["error"]["message"]  # capped: one request cannot stall a step
    status, resp = post(server.url + "/v1/completions", {**body, "dflash": {"tree_budget": "big"}})
    assert status == 400 and "tree_budget" in resp["error"]["message"]


def test_serve_takes_lookup_per_request(server):
    body = {"prompt": "x = 1\nx = 1\nx =", "max_tokens": 12, "temperature": 0, "dflash": {"tree_budget": 4}}
    texts = []
    for lookup in (0, 12):
        status, resp = post(server.url + "/v1/completions", {**body, "dflash": {"tree_budget": 4, "lookup": lookup}})
        assert status == 200, resp
        assert resp["dflash"]["stats"]["lookup"] == lookup and resp["dflash"]["stats"]["copied_tokens"] >= 0
        texts.append(resp["choices"][0]["text"])
    assert texts[0] == texts[1]
    for bad in (-1, 1000, "long"):
        status, resp = post(server.url + "/v1/completions", {**body, "dflash": {"lookup": bad}})
        assert status == 400 and "lookup" in resp["error"]["message"]


# -- TUI ------------------------------------------------------------------------------------
def tree_events():
    tok = lambda i, s, st: TokenEvent(i, s, st)  # noqa: E731
    first = PrefillDone(3, 0.01, (tok(1, "x = ", TokenStatus.TARGET),))
    # drafts: 0 'fo' (root child), 1 'o' under 0, 2 'ba' (root child), 3 'r' under 2; the target took 'ba' then 'z'
    step = BlockVerified(
        draft=(10, 11, 12, 13),
        draft_text=("fo", "o", "ba", "r"),
        accepted=1,
        tokens=(tok(12, "ba", TokenStatus.ACCEPTED), tok(14, "z", TokenStatus.TARGET)),
        seconds=0.01,
        parents=(-1, 0, -1, 2),
        path=(2,),
    )
    # nothing accepted: two losing branches 'fo|o' and 'qu|x'
    lost = BlockVerified(
        draft=(20, 21, 22, 23),
        draft_text=("fo", "o", "qu", "x"),
        accepted=0,
        tokens=(tok(15, "!", TokenStatus.TARGET),),
        seconds=0.01,
        parents=(-1, 0, -1, 2),
        path=(),
    )
    counter = AcceptanceCounter(slots=2)
    counter.record(4, 1, depth=2)  # the two steps above: a tree of 4 nodes, depth 2, one accepted
    counter.record(4, 0, depth=2)
    stats = make_stats(generated_tokens=4, acceptance=counter.counts(), tree_budget=4)
    return [first, step, lost, Finished("length", stats)]


def test_tui_shows_losing_branches_as_ghost_text():
    from tests.test_tui import SIZE, app_for, ready, run, send, transcript_text
    from tests.tui_fakes import FakeBackend, ReplayDecoder
    from tui.widgets import TokenChunk

    async def body():
        app = app_for(FakeBackend(ReplayDecoder(tree_events())), view="origin")
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send(pilot, "go")
            text = transcript_text(app)
            # after the accepted 'ba': its lost child 'r'; at the root of the second step: both branches
            assert text == "x = ba" + "r" + "z" + "foo│qux" + "!"
            rejected = [p for c in app.query(TokenChunk) for p in c.parts if p[1] == "rejected"]
            assert [p[0] for p in rejected] == ["r", "foo│qux"]
            assert app.last_answer().text == "x = baz!"
            tracker = app.tracker
            assert tracker.final is not None and tracker.final.tree_budget == 4

    run(body())


def test_tui_colours_tokens_the_context_lookup_copied():
    from tests.test_tui import SIZE, app_for, ready, run, send, transcript_text
    from tests.tui_fakes import FakeBackend, ReplayDecoder
    from tui.widgets import Legend, TokenChunk

    tok = lambda i, s, st: TokenEvent(i, s, st)  # noqa: E731
    first = PrefillDone(3, 0.01, (tok(1, "x = ", TokenStatus.TARGET),))
    # drafter nodes 0 'fo', 1 'o'; the lookup appended 2 'ba' (root child) and 3 'r' under it;
    # the target took 'ba', 'r' (both copied), then 'z' of its own
    step = BlockVerified(
        draft=(10, 11, 12, 13),
        draft_text=("fo", "o", "ba", "r"),
        accepted=2,
        tokens=(
            tok(12, "ba", TokenStatus.ACCEPTED),
            tok(13, "r", TokenStatus.ACCEPTED),
            tok(14, "z", TokenStatus.TARGET),
        ),
        seconds=0.01,
        parents=(-1, 0, -1, 2),
        path=(2, 3),
        copied=2,
    )
    # a drafted node accepted, the copied branch lost
    drafted = BlockVerified(
        draft=(20, 21, 22),
        draft_text=("qu", "x", "!"),
        accepted=1,
        tokens=(tok(20, "qu", TokenStatus.ACCEPTED), tok(15, "?", TokenStatus.TARGET)),
        seconds=0.01,
        parents=(-1, 0, -1),
        path=(0,),
        copied=1,
    )
    counter = AcceptanceCounter(slots=2)
    counter.record(4, 2, depth=2)
    counter.record(3, 1, depth=2)
    stats = make_stats(generated_tokens=6, acceptance=counter.counts(), tree_budget=2, lookup=16, copied_tokens=2)

    async def body():
        app = app_for(FakeBackend(ReplayDecoder([first, step, drafted, Finished("length", stats)])), view="origin")
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send(pilot, "go")
            parts = [p for c in app.query(TokenChunk) for p in c.parts]
            assert [t for t, k in parts if k == "copied"] == ["bar"]
            assert [t for t, k in parts if k == "accepted"] == ["qu"]
            assert app.last_answer().text == "x = barzqu?"
            assert "x = barz" in transcript_text(app)
            assert "copied" in app.query_one(Legend).render().plain

    run(body())


def test_tui_stats_count_tree_depth_not_nodes():
    from tui.stats import GenerationTracker

    tracker = GenerationTracker(slots=3)
    for e in tree_events()[:-1]:
        tracker.update(e)
    c = tracker.counts
    assert c.drafted == 8 and c.accepted == 1 and c.steps == 2
    assert list(c.slot_tried[:2]) == [2, 2] and list(c.slot_accepted[:2]) == [1, 0]
    assert list(c.histogram[:2]) == [1, 1]
    assert replace(make_stats(), tree_budget=3).tree_budget == 3


@pytest.mark.parametrize("command", ["run", "chat", "bench", "serve"])
def test_every_generating_command_takes_tree_budget(command):
    r = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "--tree-budget" in r.output


def test_attention_without_custom_masks_refuses_trees():
    model = make_target("qwen3", vocab_size=64)
    model.config._attn_implementation = "flash_attention_2"
    target = TargetModel(model)
    with pytest.raises(ConfigError, match="flash_attention_2"):
        tree_decoder(target, make_drafter(model.config, block_size=4), tree_budget=4)


def test_recorded_rank_coverage_is_the_prior():
    table = [[0.2, 0.6, 0.1], [0.2, 0.6, 0.1]]
    pol = AdaptivePlanner(3, [1.0] * 65, prior=[0.9], prior_table=table)
    cov = pol.coverage()
    assert len(cov) == 3 and cov[0][:3] == pytest.approx([0.2, 0.6, 0.1]) and cov[2][1] == pytest.approx(0.6)
    assert pol.choice[0] > 0  # the argmax is usually wrong but rank 1 is right: a tree pays


def test_drafter_evaluation_measures_the_drafter_without_context_lookup(pipe):
    from runtime.train.evaluate import IdPrompt, evaluate

    ids = tuple(pipe.encode("x = 1\nx = 1\nx = 1\n", chat=False))
    saved = pipe.costs
    pipe.costs = VerifyCosts(tuple(1.0 + 0.01 * n for n in range(65)), 0.05, 0.01)  # trees look cheap
    try:
        result = evaluate(pipe, [IdPrompt(ids=ids, chat=False, source="repeat")], max_new_tokens=12, full_block=False)
        # while a user's run (the same automatic choice) looks up by default
        stats = list(pipe.stream(list(ids), SamplingParams(max_new_tokens=12)))[-1].stats
    finally:
        pipe.costs = saved
    auto = result.prompts[0].auto
    assert auto.lookup == 0 and auto.copied_tokens == 0 and result.prompts[0].same_output
    assert stats.lookup == 16  # the tree decoder ran
