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


def test_bench_store_tls_part_tiny(tmp_path: Path) -> None:
    """``--part tls``: a plaintext and an mTLS master side by side, every RPC in both
    modes with ratio and cost, the connect cost, and put/get phases through both; no
    timing asserts (the figures are reported, not judged)."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.store", "--part", "tls", "--sizes", "64KiB",
         "--batch", "2", "--node-mib", "32", "--rpc-rounds", "1", "--rpc-calls", "8",
         "--tls-ops-rounds", "1", "--out", str(tmp_path)],
        cwd=REPO_ROOT, env={**os.environ, "UCX_NET_DEVICES": "lo"}, capture_output=True,
        text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not (tmp_path / "store.json").exists()  # part ops not run
    report = json.loads((tmp_path / "store_tls.json").read_text())
    assert report["tls"] == "both" and report["modes"] == ["insecure", "tls"]
    rows = {r["rpc"]: r for r in report["rpc"]["rows"]}
    assert set(report["rpc"]["data_path"]) < set(rows)
    assert {"Ping", "Stats"} < set(rows)
    for name, row in rows.items():
        assert row["insecure"]["n"] == row["tls"]["n"] > 0, name
        assert row["ratio"] > 0 and "cost_us" in row
        assert row["tls"]["cpu_us"] > 0 and row["cpu_ratio"] > 0
        assert ("within_10pct" in row) == (name in report["rpc"]["data_path"])
    assert isinstance(report["rpc"]["data_path_within_10pct"], bool)
    [conn] = report["rpc"]["connect"]
    assert conn["insecure"]["n"] == conn["tls"]["n"] == 5
    ops = report["ops"]
    for mode in ("insecure", "tls"):
        assert [(r["size"], r["batch"]) for r in ops[mode]] == [(65536, 2), (65536, 1)]
        assert all(r["verified"] for r in ops[mode])
    assert [(r["size"], r["batch"]) for r in ops["ratio"]] == [(65536, 2), (65536, 1)]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "store_tls.png").stat().st_size > 0
