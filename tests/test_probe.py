"""dflash doctor --speed's probe: configurations ranked by measured speed; a scheme far slower than
the fastest so far is skipped before its verify costs are measured (an int4 CPU kernel that takes
seconds per token must not stall the probe for hours)."""

from __future__ import annotations

from types import SimpleNamespace

from runtime.bench.probe import measure_speed
from runtime.engine.events import Finished


class FakePipe:
    def __init__(self, scheme: str | None, speeds: dict[str | None, float]) -> None:
        self.scheme, self.speeds, self.drafter = scheme, speeds, object()

    def describe(self) -> dict[str, str]:
        return {"target": "t", "device": "cpu", "dtype": "float32"}

    def encode(self, text: str) -> list[int]:
        return [1, 2, 3]

    def stream(self, ids, params, opts):
        gain = 1.3 if opts.decoder == "dflash" else 1.0
        stats = SimpleNamespace(decode_tokens_per_second=self.speeds[self.scheme] * gain, tau=1.5, verify_length=2)
        yield Finished(reason="length", stats=stats)


def test_slow_scheme_is_skipped_before_calibration_and_the_rest_ranked():
    speeds = {None: 18.0, "int8": 34.0, "int4": 0.7}
    calibrated: list[str | None] = []
    said: list[str] = []
    result = measure_speed(
        lambda s: FakePipe(s, speeds), progress=said.append, calibrate=lambda p: calibrated.append(p.scheme)
    )
    assert calibrated == [None, "int8"]  # int4 was never calibrated
    assert [(r.quantize, r.decoder) for r in result.rows] == [
        ("int8", "dflash"),
        ("int8", "ar"),
        ("none", "dflash"),
        ("none", "ar"),
    ]
    assert result.fastest.flags == "--quantize int8"
    assert any(m.startswith("skipping int4: plain decoding runs 0.70 tok/s here, 49x slower") for m in said)
