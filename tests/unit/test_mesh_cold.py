"""bench.mesh_profile.cold: the step is a real routing decision (a worker is chosen, the
entry released), every way of spending a gap is measured at every gap, and the report
and its plot are written."""

from __future__ import annotations

import json
from pathlib import Path

from bench.mesh_profile import cold


def test_the_step_routes_and_releases() -> None:
    step = cold.router_step(64)
    for _ in range(3):
        step()  # raises when the router gives no worker


def test_every_way_and_gap_is_reported(tmp_path: Path) -> None:
    assert cold.main(["--samples", "3", "--gaps-ms", "0,0.2", "--out", str(tmp_path),
                      "--name", "c"]) == 0
    report = json.loads((tmp_path / "c.json").read_text())
    assert list(report["ways"]) == list(cold.WAYS)
    for way, rows in report["ways"].items():
        assert list(rows) == ["0", "0.2"], way
        assert all(0 < r["median_us"] <= r["p90_us"] for r in rows.values()), way
        assert report["cold_over_warm"][way] > 0
    assert (tmp_path / "c.png").stat().st_size > 0
