"""Issue 46, defect 10: the server's memory settles under a soak of mixed requests (1 MB and 5 MB
bodies among them) instead of staying at the high-water mark of each large prompt."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.soak_serve import ROUND, growth, soak, start_server


@pytest.mark.slow
def test_server_rss_settles_over_a_soak_with_large_bodies(tmp_path: Path) -> None:
    srv = start_server(tmp_path)
    try:
        res = soak(srv.url, srv.proc.pid, 12 * ROUND, 60, 4, seed=0, say=lambda _line: None)
    finally:
        code = srv.stop()
    series = res["series"]
    mb = ", ".join(f"{n}:{kb / 1024:.0f}" for n, kb in series)
    assert not res["unexpected"], res["unexpected"][:10]
    assert code == 0
    warm = series[0][1]
    # a 1 MB prompt's tokenization frees a few hundred MB: it goes back to the OS, not kept by malloc
    assert max(kb for _, kb in series) < warm * 1.15, f"RSS (MB) after n requests: {mb}"
    assert growth(series, len(series) // 2 * 60) < 0.05, f"RSS (MB) after n requests: {mb}"
