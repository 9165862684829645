"""The GPU check script cannot rot: its CPU dry run (tiny shapes) runs here, and the distilled
GPU tests run where CUDA is (marked ``gpu``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def run_check(tmp_path: Path, device: str, sections: str) -> dict:
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", device, "--quick"]
    cmd += ["--out", str(tmp_path), "--sections", sections]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return {s: json.loads((tmp_path / f"{s}.json").read_text()) for s in sections.split(",")}


def check(results: dict) -> None:
    for name, doc in results.items():
        assert "error" not in doc, (name, doc.get("error"), doc.get("traceback"))
    assert results["exactness"]["float32_exact"]
    assert results["host_reads"]["chain"]["reads_per_step"] == [1]
    assert set(results["host_reads"]["tree"]["reads_per_step"]) <= {1, 2}
    rows = results["speed"]["rows"]
    assert {r["decoder"] for r in rows} == {"plain", "chain", "tree"} and all(r["same_as_plain"] for r in rows)
    assert all(r["tau"] > 1.5 for r in rows if r["decoder"] != "plain")  # the oracle's drafts are accepted


def test_cpu_dry_run_of_the_gpu_check(tmp_path):
    check(run_check(tmp_path, "cpu", "exactness,speed,host_reads,profile,costs"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_exactness_and_host_reads(tmp_path):
    check(run_check(tmp_path, "cuda", "exactness,speed,host_reads"))
