"""The confidence cut: chain steps verify as many drafts as the drafter's own confidence makes worth
their cost, the calibration learns from the target's choices, and output stays exact."""

from __future__ import annotations

import json
import math

from typer.testing import CliRunner

from dflash_cli.app import app
from runtime import DecodeOptions, LoadOptions, ModelRef, RuntimeConfig, load_pipeline
from runtime.config import SamplingParams
from runtime.engine import tree_decoder
from runtime.engine.calibrate import VerifyCosts
from runtime.engine.confidence import ConfidenceCut
from runtime.engine.events import BlockVerified
from runtime.engine.models.target import TargetModel
from runtime.engine.plan import AdaptivePlanner
from runtime.engine.step import SlotCandidates
from runtime.engine.tree import tree_from_candidates, truncate_tree
from tests.fakes import collect_ids, greedy_reference, make_drafter, make_target

# a CPU float32 verify: each extra token costs 6-20% of a one-token forward
F32 = [1.0, 1.19, 1.25, 1.33, 1.45, 1.52, 1.59, 1.68, 1.78]


def chain_of(slots: list[float]) -> tuple[list[list[float]], object]:
    """Per-slot candidates where only the argmax has any mass, and their best-first tree."""
    vals = [[math.log(p), math.log(1e-4)] for p in slots]
    return vals, tree_from_candidates(vals, [[10 + d, 50 + d] for d in range(len(slots))], anchor=1, budget=len(slots))


def test_sure_drafts_get_long_chains_and_unsure_ones_short():
    cut = ConfidenceCut(F32, rate=1.5)
    assert cut.tree_size(*chain_of([0.97] * 7)) == 7
    assert cut.tree_size(*chain_of([0.15] * 7)) == 0
    mixed = cut.tree_size(*chain_of([0.97, 0.97, 0.05] + [0.97] * 4))
    assert 2 <= mixed < 7  # a doubtful slot ends the chain: nothing behind it is likely to be reached


def test_a_higher_throughput_asks_more_of_each_draft():
    slow, fast = ConfidenceCut(F32, rate=1.0), ConfidenceCut(F32, rate=3.0)
    slots = [0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]
    assert slow.tree_size(*chain_of(slots)) > fast.tree_size(*chain_of(slots))


def test_calibration_learns_an_overconfident_drafter():
    cut = ConfidenceCut(F32, rate=1.5, draft_cost=0.1)
    sure = chain_of([0.95] * 7)
    assert cut.tree_size(*sure) == 7
    for _ in range(60):  # the drafter is sure, the target disagrees at the first slot every time
        cut.tree_size(*sure)
        cut.observe(sure[0], [-1], tokens=1, nodes=8)
    assert cut.accept_prob(math.log(0.95)) < 0.2
    assert cut.tree_size(*sure) == 0
    assert cut.rate < 1.0  # one token per 8-token verify: the measured throughput fell


def test_policy_sizes_steps_only_when_asked():
    on = AdaptivePlanner(7, F32, prior=[0.6], cut=True)
    off = AdaptivePlanner(7, F32, prior=[0.6], cut=False)
    assert on.choice[0] == 0 and off.choice[0] == 0  # costs known only within the block: chains planned
    assert off.tree_cap() == 0 and off.cut is None and not off.plan().tree  # without the cut: the planned chain
    assert on.tree_cap() == 7 and on.plan().tree  # with it: a tree as big as the block is deep, cut per step
    vals, tree = chain_of([0.99] * 7)
    cands = SlotCandidates(vals, [[10 + d, 50 + d] for d in range(7)])
    assert on.keep(cands, tree) == 7 and off.keep(cands, tree) == 7


def test_decoding_with_the_cut_is_exact_and_varies_the_length():
    model = make_target("qwen3", vocab_size=96, seed=3)
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=6)
    for prompt in ([1, 2, 3], [40, 41], [7] * 9):
        pol = AdaptivePlanner(5, F32[:6], draft_cost=0.1, prior=[0.5])
        events = list(tree_decoder(target, drafter, tree_budget=pol).stream(prompt, SamplingParams(max_new_tokens=40)))
        assert collect_ids(events) == greedy_reference(model, prompt, 40)
        sizes = {len(e.draft) - e.copied for e in events if isinstance(e, BlockVerified)}
        assert sizes <= set(range(6))


def test_option_turns_it_off_and_requests_share_the_calibration(tiny_pair, monkeypatch):
    t, d = tiny_pair
    pipe = load_pipeline(
        ModelRef(target=str(t), drafter=str(d)), RuntimeConfig(device="cpu", dtype="float32"), LoadOptions()
    )
    pipe.costs = VerifyCosts(tuple(F32 + [2.0] * 60), 0.1, 0.001)  # measured costs up to tree sizes

    def cut(opts: DecodeOptions) -> ConfidenceCut | None:
        planner = pipe.make_decoder(opts).planner
        assert isinstance(planner, AdaptivePlanner)
        return planner.cut

    monkeypatch.setenv("DFLASH_CONFIDENCE_CUT", "0")  # the runtime reads no environment: the CLI does
    assert cut(DecodeOptions()) is not None and cut(DecodeOptions(confidence_cut=False)) is None
    first, second = cut(DecodeOptions()), cut(DecodeOptions())
    assert first is not None and second is not None  # later requests start from what earlier ones learned
    assert first.calibration is second.calibration is pipe.hit_rates


def test_environment_sets_the_cli_default(monkeypatch):
    from dflash_cli.common import confidence_cut

    monkeypatch.delenv("DFLASH_CONFIDENCE_CUT", raising=False)
    assert confidence_cut(None) is True and confidence_cut(False) is False
    monkeypatch.setenv("DFLASH_CONFIDENCE_CUT", "0")
    assert confidence_cut(None) is False and confidence_cut(True) is True


def test_tree_steps_keep_the_best_first_prefix_worth_its_cost():
    # bf16-like costs: flat to 6 tokens, then each token costs
    cost = [1.0, 1.0, 1.0, 1.0, 1.03, 1.03, 1.21, 1.27, 1.32, 1.36, 1.41, 1.46, 1.52, 1.59, 1.66, 1.72, 1.79]
    cut = ConfidenceCut(cost, rate=2.0, draft_cost=0.1)
    sure = [[math.log(0.97), math.log(0.01)]] * 7
    tree = tree_from_candidates(sure, [[10 + d, 50 + d] for d in range(7)], anchor=1, budget=16)
    n = cut.tree_size(sure, tree)
    kept = truncate_tree(tree, n)
    assert n >= 7 and kept.max_depth == 7  # a sure chain is worth its whole depth
    assert all(p < i for i, p in enumerate(kept.parents))
    unsure = [[math.log(0.2), math.log(0.15)]] * 7
    tree = tree_from_candidates(unsure, [[10 + d, 50 + d] for d in range(7)], anchor=1, budget=16)
    assert cut.tree_size(unsure, tree) <= 5  # only what the flat part of the cost curve pays for
    # the runner-up calibration learns: the target keeps picking the second candidate
    before = cut.other_prob(math.log(0.15))
    for _ in range(40):
        cut.tree_size(unsure, tree)
        cut.observe(unsure, [1, 1], tokens=3, nodes=6)
    assert cut.other_prob(math.log(0.15)) > before + 0.3


def test_cli_confidence_cut_flags(tiny_pair, tmp_path):
    runner = CliRunner()
    t, d = tiny_pair
    base = ["--target", str(t), "--drafter", str(d), "--dtype", "float32", "--device", "cpu", "-n", "16"]
    on = runner.invoke(app, ["run", *base, "--raw", "def fib(n):", "--confidence-cut"])
    off = runner.invoke(app, ["run", *base, "--raw", "def fib(n):", "--no-confidence-cut"])
    assert on.exit_code == 0 and off.exit_code == 0, on.output + off.output
    assert on.stdout == off.stdout  # the cut changes how many drafts are verified, never the text
    prompts = tmp_path / "p.txt"
    prompts.write_text("def add(a, b):\n")
    r = runner.invoke(
        app, ["bench", *base, "--prompts", str(prompts), "--methods", "dflash", "--warmup", "0", "--no-confidence-cut"]
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout.splitlines()[-1])
    assert doc["config"]["confidence_cut"] is False
    assert doc["methods"][-1]["agreement"]["identical"] == 1


def _outcome(ranks: list[int], nodes: int) -> object:
    from runtime.engine.step import StepOutcome
    from runtime.engine.tree import DraftTree

    vals = [[math.log(0.9), math.log(0.05)] for _ in ranks]
    tree = DraftTree((1,), (-1,), (0,), (-1,))
    cands = SlotCandidates(vals, [[10, 50] for _ in ranks]) if ranks else None
    return StepOutcome(tree, [0], [2], list(ranks), cands, nodes - 1, 0.01)


def test_while_plain_decoding_pays_best_the_drafter_runs_only_on_probe_steps():
    """Verifies this dear (each token +40%) and drafts this poor make plain decoding the fastest plan:
    then steps skip the drafter (its forward would be paid for drafts the cut drops), all but one in
    PROBE_EVERY, which still drafts so the planner keeps learning; once drafts are accepted again,
    every step drafts."""
    from runtime.engine.plan import PROBE_EVERY

    dear = [1.0 + 0.4 * n for n in range(9)]
    planner = AdaptivePlanner(7, dear, draft_cost=0.3, prior=[0.2], prior_weight=4, every=4, trees=False)
    assert planner.choice == (0, 0) and planner.cut is not None
    depths = []
    for _ in range(2 * PROBE_EVERY):
        plan = planner.plan()
        depths.append(plan.depth)
        planner.observe(_outcome([-1] if plan.depth else [], plan.depth + 1))  # probes are rejected
    assert depths.count(0) == 2 * (PROBE_EVERY - 1) and all(d > 0 for d in depths[::PROBE_EVERY])
    for _ in range(40):  # now the target takes every argmax draft: drafting pays again
        plan = planner.plan()
        planner.observe(_outcome([0] * plan.depth, plan.depth + 1) if plan.depth else _outcome([], 1))
    assert planner.choice != (0, 0)
    assert all(planner.plan().depth > 0 for _ in range(3))
