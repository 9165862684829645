"""Tier 3: the reference fixture (z-lab/dflash goldens) reproduces exactly."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from runtime.config import SamplingParams
from runtime.engine import chain_decoder, plain_decoder
from runtime.engine.models.drafter_io import load_draft_model
from runtime.engine.models.target import TargetModel
from runtime.pipeline import load_target_model
from tests.fakes import collect_ids


@pytest.fixture(scope="module")
def golden(fixture_dir):
    return json.loads((fixture_dir / "golden.json").read_text())


@pytest.fixture(scope="module")
def models(fixture_dir):
    model = load_target_model(fixture_dir / "target", torch.device("cpu"), torch.float32, attn="eager")
    return TargetModel(model), load_draft_model(fixture_dir / "drafter")


def test_config_parsed_as_published(models, golden):
    _, drafter = models
    assert drafter.dflash.block_size == golden["block_size"]
    assert drafter.dflash.mask_token_id == golden["mask_token_id"]
    assert list(drafter.dflash.target_layer_ids) == golden["target_layer_ids"]


def test_output_ids_match_reference(models, golden):
    target, drafter = models
    prompt, n = golden["prompt_ids"], golden["max_new_tokens"]
    events = list(chain_decoder(target, drafter).stream(prompt, SamplingParams(max_new_tokens=n)))
    assert prompt + collect_ids(events) == golden["dflash_output_ids"]
    plain = list(plain_decoder(target).stream(prompt, SamplingParams(max_new_tokens=n)))
    assert prompt + collect_ids(plain) == golden["greedy_output_ids"]


def test_draft_blocks_match_reference(models, golden):
    # The reference always drafts b-1 tokens and runs one extra step past max_new_tokens (it
    # truncates afterwards); we honour max tokens exactly, so decode a little further and compare
    # every block the reference drafted.
    target, drafter = models
    prompt, n = golden["prompt_ids"], golden["max_new_tokens"]
    events = list(chain_decoder(target, drafter).stream(prompt, SamplingParams(max_new_tokens=n + 8)))
    drafts = [list(e.draft) for e in events if e.type == "block"]
    assert drafts[: len(golden["draft_blocks"])] == golden["draft_blocks"]


@torch.inference_mode()
def test_first_step_logits_match_reference(models, golden):
    target, drafter = models
    first = golden["first_step"]
    prompt = golden["prompt_ids"]
    target.set_taps(drafter.dflash.target_layer_ids)
    cache = target.new_cache()
    logits, feats = target.forward(torch.tensor([prompt]), cache, logits_to_keep=1)
    anchor = int(logits[-1].argmax())
    assert anchor == first["anchor_token"]
    b, m = drafter.dflash.block_size, drafter.dflash.mask_token_id
    block = torch.tensor([[anchor] + [m] * (b - 1)])
    p = len(prompt)
    hidden = drafter(target.embed(block), drafter.fuse_context(feats), torch.arange(0, p + b)[None])
    draft_logits = target.lm_head(hidden[:, 1:])  # [1, b-1, V]
    assert list(draft_logits.shape) == first["draft_logits_shape"]
    assert draft_logits[0].argmax(-1).tolist() == first["draft_argmax"]
    torch.testing.assert_close(
        draft_logits[0].sum(-1), torch.tensor(first["draft_logits_sum_per_slot"]), atol=1e-4, rtol=0
    )
    torch.testing.assert_close(
        draft_logits[0, 0, :8], torch.tensor(first["draft_logits_first8_slot1"]), atol=1e-4, rtol=0
    )


def test_fixture_through_cli_json(fixture_dir, golden):
    from dflash_cli.app import app

    runner = CliRunner()
    ids = ",".join(str(i) for i in golden["prompt_ids"])
    result = runner.invoke(
        app,
        [
            "run",
            "--target",
            str(fixture_dir / "target"),
            "--drafter",
            str(fixture_dir / "drafter"),
            "--prompt-ids",
            ids,
            "-n",
            str(golden["max_new_tokens"]),
            "--dtype",
            "float32",
            "--json",
            "--verify-length",  # the reference verifies whole blocks; the adaptive K probes shorter ones
            str(golden["block_size"] - 1),
        ],
    )
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["type"] for line in lines][0] == "prefill" and lines[-1]["type"] == "done"
    assert all(line["type"] == "block" for line in lines[1:-1])
    out = [t["id"] for line in lines[:-1] for t in line["tokens"]]
    assert golden["prompt_ids"] + out == golden["dflash_output_ids"]
    drafts = [line["draft"] for line in lines if line["type"] == "block"]
    full = [d for d in drafts if len(d) == golden["block_size"] - 1]
    assert full == golden["draft_blocks"][: len(full)]
    assert lines[-1]["stats"]["generated_tokens"] == golden["max_new_tokens"]
