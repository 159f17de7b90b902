"""``python -m bench.afd`` end to end on the tiny model with minimal reps: every variant
(unsplit, 1A1F and 2A1F on shm and NIXL, 1 and 2 microbatches) runs in one process tree,
split tokens equal unsplit's, and the JSON has the fields the report promises. No timing
asserts (2 shared cores). About a minute: a dozen processes start (torch, NIXL agents)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
VARIANTS = {"unsplit/mb1", "unsplit/mb2"} | {
    f"{t}/{tr}/mb{m}" for t in ("1A1F", "2A1F") for tr in ("shm", "nixl") for m in (1, 2)}


def _bench(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.afd", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_help_and_bad_arguments() -> None:
    done = _bench("--help", timeout=120)
    assert done.returncode == 0 and "--model" in done.stdout and "break-even" in done.stdout
    bad = _bench("--model", "tiny", "--microbatches", "3", timeout=120)
    assert bad.returncode == 2 and "--microbatches" in bad.stderr
    bad = _bench("--model", "tiny", "--transports", "rdma", timeout=120)
    assert bad.returncode == 2 and "--transports" in bad.stderr


@pytest.mark.slow
def test_bench_afd_tiny(tmp_path: Path) -> None:
    done = _bench("--model", "tiny", "--batches", "2", "--steps", "2", "--warmup", "0",
                  "--reps", "1", "--fit-hidden", "128,256", "--fit-batches", "1,2",
                  "--fit-reps", "1", "--out", str(tmp_path), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "afd.json").read_text())
    assert (tmp_path / "afd.png").stat().st_size > 0 and report["png"] == "afd.png"
    assert report["schema"] == "kvmesh.bench.afd/1" and report["ok"] is True
    assert report["errors"] == [] and report["token_mismatches"] == []
    assert {c["variant"] for c in report["cells"]} == VARIANTS
    assert set(report["summary"]) == VARIANTS
    for c in report["cells"]:
        assert c["tokens_match_unsplit"] is True, c["variant"]
        assert c["tpot_ms"] > 0 and c["tokens_per_s"] > 0
        assert c["concurrent_requests"] == 2 * (2 if c["topology"] == "2A1F" else 1)
        assert {"attention_compute", "ffn_compute"} <= set(c["per_layer_step_us"])
        if c["topology"] == "unsplit":
            continue
        assert set(c["per_message_us"]) >= {"transfer", "exposed_transfer", "ffn_queue"}
        assert 0.0 <= c["overlap_ratio"] <= 1.0
        assert set(c["idle_frac"]) == {"attention", "ffn"}
        assert c["messages"] == 2 * 2 * c["microbatches"] * (2 if c["topology"] == "2A1F"
                                                             else 1)  # steps x layers x mbs
    be = report["break_even"]
    assert set(be["compute_constants"]) == {"attn", "ffn"}
    for tr in ("shm", "nixl"):
        t = be["per_transport"][tr]
        assert t["round_trip_fit"]["source"].startswith("this run")
        assert set(t["table"]["break_even_hidden"]) == {"1", "8", "32", "128", "512"}
        assert t["table"]["rows"] and t["measured_vs_predicted"]
    assert "CPUs shared" in report["verdict"]
