"""Tier 1: the one acceptance counter, the one event JSON form, the one loading options object."""

from __future__ import annotations

import json

import pytest

from runtime.config import DecodeOptions
from runtime.engine.acceptance import AcceptanceCounter, AcceptanceCounts
from runtime.engine.events import (
    BlockVerified,
    Finished,
    GenerationStats,
    PrefillDone,
    TokenEvent,
    TokenStatus,
    event_from_json,
    event_to_json,
)
from runtime.errors import ConfigError
from runtime.session import SessionOptions


def counted(steps: list[tuple[int, int]], slots: int = 3) -> AcceptanceCounts:
    counter = AcceptanceCounter(slots=slots)
    for drafted, accepted in steps:
        counter.record(drafted, accepted)
    return counter.counts()


def test_statistics_derive_from_raw_counts():
    c = counted([(3, 3), (3, 1), (3, 0), (2, 2)])  # the last step verified two drafts only
    assert (c.steps, c.drafted, c.accepted, c.committed) == (4, 11, 6, 10)
    assert c.slot_tried == (4, 4, 3) and c.slot_accepted == (3, 2, 1)
    assert c.histogram == (1, 1, 1, 1)
    assert c.tau == 2.5 and c.acceptance_rate == pytest.approx(6 / 11)
    assert c.per_position == (0.75, 0.5, pytest.approx(1 / 3))


def test_no_steps_and_growing_blocks():
    assert AcceptanceCounts().tau == 1.0 and AcceptanceCounts().acceptance_rate == 0.0
    c = counted([(5, 4)], slots=2)  # a block larger than announced grows the counts
    assert c.slot_tried == (1, 1, 1, 1, 1) and c.histogram == (0, 0, 0, 0, 1, 0)
    plain = counted([(0, 0), (0, 0)], slots=0)
    assert plain.tau == 1.0 and plain.per_position == () and plain.histogram == (2,)


def test_counts_add_up_over_runs_and_pad():
    a, b = counted([(3, 3), (3, 0)]), counted([(1, 1)], slots=1)
    total = a + b
    assert total == counted([(3, 3), (3, 0), (1, 1)])
    assert (a + AcceptanceCounts()) == a and sum((a, b), AcceptanceCounts()) == total
    assert AcceptanceCounts().padded(2).histogram == (0, 0, 0) and a.padded(1) == a


def test_server_totals_give_per_slot_counts():
    """A server reporting a histogram (SGLang, vLLM's per-request summary) or per-position counts."""
    c = AcceptanceCounts.from_totals(4, 60, 6, histogram=[1, 2, 1])
    assert c.tau == 2.5 and c.slot_tried == (4, 4) and c.slot_accepted == (3, 1)
    v = AcceptanceCounts.from_totals(2, 30, 3, slot_accepted=[2, 1])
    assert v.per_position == (1.0, 0.5) and v.histogram == ()


def test_counts_round_trip_through_json():
    c = counted([(3, 2), (3, 3)])
    assert AcceptanceCounts.from_json(json.loads(json.dumps(c.to_json()))) == c
    assert AcceptanceCounts.from_json({}) == AcceptanceCounts()


def stats(acceptance: AcceptanceCounts) -> GenerationStats:
    return GenerationStats(5, 9, 0.25, 1.5, 6.0, 5.6, acceptance, 4, 3, "dflash")


def test_generation_stats_carry_counts_and_derive_the_rest():
    s = stats(counted([(3, 3), (3, 1)]))
    assert (s.verify_steps, s.drafted_tokens, s.accepted_tokens) == (2, 6, 4)
    assert s.tau == 3.0 and s.acceptance_histogram == (0, 1, 0, 1)
    d = s.to_json()
    assert d["tau"] == 3.0 and d["acceptance"]["slot_accepted"] == [2, 1, 1]
    assert GenerationStats.from_json(json.loads(json.dumps(d))) == s
    # a record without the raw counts (an older server): rebuilt from totals and histogram
    old = {k: v for k, v in d.items() if k != "acceptance"}
    rebuilt = GenerationStats.from_json(old)
    assert rebuilt.tau == s.tau and rebuilt.acceptance_histogram == s.acceptance_histogram


EVENTS = [
    PrefillDone(7, 0.125, (TokenEvent(11, "def", TokenStatus.TARGET),)),
    BlockVerified(
        draft=(1, 2, 3),
        draft_text=(" f", "(", "x"),
        accepted=2,
        tokens=(
            TokenEvent(1, " f", TokenStatus.ACCEPTED),
            TokenEvent(2, "(", TokenStatus.ACCEPTED),
            TokenEvent(9, "n", TokenStatus.TARGET),
        ),
        seconds=0.5,
    ),
    Finished("length", stats(counted([(3, 2)]))),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: e.type)
def test_events_round_trip_through_json(event):
    line = json.dumps(event_to_json(event), ensure_ascii=False)
    assert event_from_json(json.loads(line)) == event


def test_block_json_has_the_run_contract_and_rejects_unknown_events():
    d = event_to_json(EVENTS[1])
    assert d["draft"] == [1, 2, 3] and d["accepted"] == 2 and d["rejected_text"] == ["x"]
    assert [t["status"] for t in d["tokens"]] == ["accepted", "accepted", "target"]
    without = {k: v for k, v in d.items() if k != "draft_text"}  # an older server
    assert event_from_json(without) == EVENTS[1]
    with pytest.raises(ValueError):
        event_from_json({"type": "token"})
    with pytest.raises(ValueError):
        event_from_json({"type": "done", "reason": "exploded", "stats": {}})


def test_session_options_build_the_runtime_configs():
    opts = SessionOptions(model="qwen3-8b", device="cpu", dtype="float32", threads=2, offline=True, quantize="int8")
    assert opts.ref.preset == "qwen3-8b" and opts.runtime.threads == 2 and opts.runtime.dtype == "float32"
    assert opts.load.offline and opts.load.quantize == "int8"
    assert opts.decode == DecodeOptions() and opts.usage_log is None and opts.calibration_file is None
    with pytest.raises(ConfigError, match="--server excludes"):
        SessionOptions(server="http://127.0.0.1:1", target="some/model")
    with pytest.raises(ConfigError):
        SessionOptions(device="tpu")
