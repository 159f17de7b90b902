"""Smoke test of ``python -m bench.store --part ops``: its own etcd, store master and store
node children, small sizes, no timing asserts (run as a subprocess: it ends with os._exit)."""

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


def test_bench_store_ops_tiny(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.store", "--part", "ops", "--sizes", "64KiB,1MiB",
         "--batch", "4", "--node-mib", "64", "--out", str(tmp_path)],
        cwd=REPO_ROOT, env={**os.environ, "UCX_NET_DEVICES": "lo"}, capture_output=True,
        text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "store.json").read_text())
    rows = report["rows"]
    assert [(r["size"], r["batch"]) for r in rows] == [(65536, 4), (1 << 20, 4), (65536, 1)]
    for row in rows:
        assert row["verified"] is True
        assert row["put_gbps"] > 0 and row["get_gbps"] > 0 and row["objects"] >= 4
    assert report["mooncake"] == "not run (pass --mooncake-python)"
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "store.png").stat().st_size > 0
