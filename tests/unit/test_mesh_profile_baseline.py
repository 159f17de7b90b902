"""``bench.mesh_profile --baseline``: the cpu phase alternates between the baseline
checkout (the children's working directory) and this one, and reports current ÷ baseline."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import pytest

from bench.mesh_profile import run


def test_baseline_alternates_and_reports_ratios(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    base = tmp_path / "base"
    (base / "services" / "frontend").mkdir(parents=True)
    here = os.getcwd()
    seen: list[str] = []

    def fake_phase(phase: str, args: argparse.Namespace, cpu: Any) -> dict[str, Any]:
        assert phase == "cpu"
        side = "baseline" if os.getcwd() == str(base) else "current"
        seen.append(side)
        fe = 200.0 if side == "baseline" else 100.0
        client = 1000.0 if side == "baseline" else 2000.0  # the machine ran at half speed
        return {"load": {"req_per_s": 10.0, "p50_ms": 5.0, "p99_ms": 9.0},
                "cpu_us_per_req": {"frontend": fe, "fleet": 50.0},
                "cpu_us_per_req_mesh_total": fe + 50.0, "client_cpu_us_per_req": client}

    monkeypatch.setattr(run, "run_phase", fake_phase)
    out = run.compare_baseline(argparse.Namespace(rounds=2), base)
    assert seen == ["baseline", "current", "baseline", "current"]
    assert os.getcwd() == here
    ratio = out["ratio_current_over_baseline"]
    assert ratio["cpu_us_per_req.frontend"] == pytest.approx(0.5)
    assert ratio["cpu_us_per_req.fleet"] == pytest.approx(1.0)
    assert ratio["cpu_us_per_req_mesh_total"] == pytest.approx(150 / 250)
    assert out["means"]["baseline"]["req_per_s"] == pytest.approx(10.0)
    # normalised by the client's CPU per request: the same req/s on a machine at half
    # speed is twice the throughput
    assert ratio["req_per_s_at_client_speed"] == pytest.approx(2.0)
    assert ratio["cpu_over_client.frontend"] == pytest.approx(0.25)


def test_baseline_must_be_a_checkout(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="not a kvmesh checkout"):
        run.compare_baseline(argparse.Namespace(rounds=1), tmp_path)
