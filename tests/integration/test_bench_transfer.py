"""Smoke test of ``python -m bench.transfer``: two real NIXL agents, tiny sizes, no timing asserts.

It runs the benchmark as a subprocess (NIXL may segfault at interpreter exit, so it must not
live in the pytest process) and checks that the JSON report has positive throughputs, that
every byte check passed, and that the peer process did not outlive the run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl not installed"),
]


def test_bench_transfer_tiny(tmp_path: Path) -> None:
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.transfer", "--sizes", "4KiB,1MiB", "--iters", "2",
         "--warmup", "1", "--out", str(tmp_path)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]

    report = json.loads((tmp_path / "transfer.json").read_text())
    assert report["all_verified"] is True
    assert report["config"]["ucx_env"]["UCX_NET_DEVICES"] == "lo"
    assert [r["size_bytes"] for r in report["results"]] == [4096, 1 << 20]
    for row in report["results"]:
        assert all(row["verified"].values()), row
        for key in ("read_gbps", "write_gbps", "memcpy_gbps"):
            stats = row[key]
            assert stats["n"] == 2
            assert 0 < stats["p10"] <= stats["median"] <= stats["p90"], (key, stats)
        assert row["read_ratio"] > 0 and row["write_ratio"] > 0
    if importlib.util.find_spec("matplotlib") is not None:
        assert report["png"] == "transfer.png"
        assert (tmp_path / "transfer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert report["peer"]["exit_code"] == 0, report["peer"]
    with pytest.raises(ProcessLookupError):  # the peer did not outlive the benchmark
        os.kill(report["peer"]["pid"], 0)
