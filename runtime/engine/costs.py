"""What a verify costs, relative to a one-token target forward: the planners' cost model.

``cost[n - 1]`` is the relative cost of verifying n tokens (the anchor included). A device's curve
is measured once per model/device/dtype (``runtime.engine.calibrate``); until then the planner
starts from the prior of its device class below.
"""

from __future__ import annotations

from collections.abc import Sequence

# Priors by device class. CPU: measured ratios on a 2-core AVX-512 machine (16 tokens ~2x one),
# chains only (trees are planned on a CPU once their cost is measured). CUDA: nearly flat up to 65
# tokens, so trees are planned from the start (a guess until issue 43's GPU measurement).
DEFAULT_COST: dict[str, list[float]] = {
    "cpu": [1.0, 1.08, 1.16, 1.24, 1.31, 1.38, 1.45, 1.52, 1.58, 1.64, 1.70, 1.76, 1.82, 1.88, 1.94, 2.0],
    "cuda": [1.0] * 17 + [1.0 + 0.1 * (n - 17) / 48 for n in range(18, 66)],
    "mps": [1.0, 1.03, 1.06, 1.09, 1.12, 1.15, 1.18, 1.21, 1.24, 1.27, 1.3, 1.33, 1.36, 1.39, 1.42, 1.45],
}
DEFAULT_DRAFT_COST = 0.1  # one drafter forward, relative to a one-token verify, when not measured


def prior_cost(device_type: str) -> list[float]:
    """The cost prior of a device class (the CPU's for unknown classes)."""
    return list(DEFAULT_COST.get(device_type, DEFAULT_COST["cpu"]))


def running_max(costs: Sequence[float]) -> list[float]:
    """Each cost raised to the largest one before it: a longer verify never costs less."""
    out, top = [], 0.0
    for c in costs:
        top = max(top, float(c))
        out.append(top)
    return out
