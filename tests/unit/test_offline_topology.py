"""Offline replay: ``--search-topology N`` (every split of N workers, with and without
conditional disaggregation, best capacity per split) and ``--timeline`` (per-interval
queues, KV use and preemptions per worker). Tiny synthetic traces; no network."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench.offline.cli import main
from bench.offline.config import SimConfig
from bench.offline.sweep import System
from bench.offline.timeline import run_timeline
from bench.offline.topology import best_per_split, split_name, splits, topology_systems
from bench.replay.trace import TraceRequest

TINY = SimConfig(trace_block_size=64, block_size=16, num_blocks=512,
                 max_num_batched_tokens=1024)


def tiny_trace(n: int = 24, seed: int = 2) -> list[TraceRequest]:
    rng = random.Random(seed)
    out, ids = [], 0
    for i in range(n):
        k = rng.randint(2, 5)
        hashes = tuple([0] + list(range(ids + 1, ids + k)))  # a shared first block
        ids += k
        out.append(TraceRequest(float(i * 150), k * 64 - 5, rng.randint(3, 12), hashes))
    return out


def write_trace(path: Path, trace: list[TraceRequest]) -> None:
    path.write_text("".join(json.dumps({"timestamp": r.timestamp_ms,
                                        "input_length": r.input_length,
                                        "output_length": r.output_length,
                                        "hash_ids": list(r.hash_ids)}) + "\n"
                            for r in trace))


def test_splits_cover_every_split_of_n() -> None:
    assert splits(3) == [(0, 0), (1, 2), (2, 1)]
    assert [split_name(p, d, 4) for p, d in splits(4)] == ["4agg", "1P3D", "2P2D", "3P1D"]
    with pytest.raises(ValueError):
        splits(1)


def test_topology_systems_try_both_disagg_modes_per_pd_split() -> None:
    systems = topology_systems(TINY, 3, ["kv", "ttft_hit"], ["kv_router"])
    ours = [s for s in systems if s.kind == "kvmesh"]
    assert len(ours) == 2 * (1 + 2 * 2)  # per policy: agg + 2 splits x cond on/off
    labels = {s.cfg.label() for s in ours}
    assert {"kv/3agg", "kv/1P2D-prefill_first", "kv/1P2D-prefill_first-always",
            "ttft_hit/2P1D-prefill_first-always"} <= labels
    dyn = [s for s in systems if s.kind == "dynamo"]
    assert [(s.cfg.prefill_workers, s.cfg.decode_workers) for s in dyn] == splits(3)
    assert all(s.router_mode == "kv_router" for s in dyn)


def test_best_per_split_picks_the_highest_capacity_and_the_ratio() -> None:
    a = System("a", "kvmesh", TINY.replace(workers=2))
    b = System("b", "kvmesh", TINY.replace(prefill_workers=1, decode_workers=1))
    c = System("c", "kvmesh", TINY.replace(prefill_workers=1, decode_workers=1,
                                          conditional_disagg=False))
    d = System("d", "dynamo", TINY.replace(prefill_workers=1, decode_workers=1), "kv_router")
    rows = best_per_split([(a, {"capacity": 2.0, "capacity_bounded": True}),
                           (b, {"capacity": 1.5, "capacity_bounded": True}),
                           (c, {"capacity": 3.0, "capacity_bounded": False}),
                           (d, {"capacity": 2.0, "capacity_bounded": True})], 2)
    assert [r["split"] for r in rows] == ["2agg", "1P1D"]
    assert rows[0]["best"] == "a" and "dynamo" not in rows[0]
    assert rows[1]["best"] == "c" and rows[1]["capacity"] == 3.0
    assert rows[1]["bounded"] is False and rows[1]["ratio"] == pytest.approx(1.5)


def test_search_topology_cli_on_a_tiny_trace(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, tiny_trace())
    out = tmp_path / "topo"
    rc = main(["--trace", str(trace), "--search-topology", "3", "--policies", "ttft_hit",
               "--speedups", "1,4", "--bisect-iters", "1", "--block-size", "16",
               "--num-blocks", "512", "--trace-block-size", "64",
               "--max-num-batched-tokens", "1024", "--out", str(out)])
    assert rc == 0
    rep = json.loads(out.with_suffix(".json").read_text())
    assert [r["split"] for r in rep["splits"]] == ["3agg", "1P2D", "2P1D"]
    assert len(rep["systems"]) == 5
    for row in rep["splits"]:
        assert row["best"] in row["candidates"]
        assert row["capacity"] == max(row["candidates"].values())
    assert out.with_suffix(".png").stat().st_size > 0
    assert main(["--trace", str(trace), "--search-topology", "1", "--out", str(out)]) == 2


def test_timeline_samples_every_worker_and_counts_the_routing() -> None:
    trace = tiny_trace(30)
    cfg = TINY.replace(prefill_workers=1, decode_workers=2, policy="ttft_hit", speedup=4.0)
    data = run_timeline(trace, cfg, interval_s=0.5)
    assert data["workers"] == {"p000": "prefill", "d001": "decode", "d002": "decode"}
    samples = data["samples"]
    assert [s["t"] for s in samples] == pytest.approx([0.5 * i for i in range(len(samples))])
    assert sum(s["routed"] for s in samples) == len(trace)
    assert sum(s["disaggregated"] for s in samples) == data["counters"]["routed_disaggregated"]
    for wid in data["workers"]:
        assert sum(s["workers"][wid]["steps"] for s in samples) > 0
        assert all(0.0 <= s["workers"][wid]["kv_usage"] <= 1.0 for s in samples)
    assert sum(s["workers"]["p000"]["prefill_tokens"] for s in samples) > 0
    assert sum(b["requests"] for b in data["slo_by_arrival"]) == len(trace)
    with pytest.raises(ValueError):
        run_timeline(trace, cfg, interval_s=0)


def test_timeline_cli_writes_json_and_png(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, tiny_trace(12))
    out = tmp_path / "pd"
    rc = main(["--trace", str(trace), "--prefill-workers", "1", "--decode-workers", "1",
               "--policies", "kv", "--block-size", "16", "--num-blocks", "512",
               "--trace-block-size", "64", "--timeline", "2", "--timeline-only",
               "--timeline-interval", "0.5", "--out", str(out)])
    assert rc == 0
    js = tmp_path / "pd_timeline-kv_1P1D-prefill_first.json"
    assert json.loads(js.read_text())["speedup"] == 2.0
    assert js.with_suffix(".png").stat().st_size > 0
    assert not out.with_suffix(".json").exists()  # --timeline-only: no sweep


def test_rows_from_merged_reports_group_by_split() -> None:
    from bench.offline.topology import rows_from_systems

    systems = [
        {"name": "kvmesh ttft_pd/4P4D-prefill_first", "kind": "kvmesh",
         "config": "ttft_pd/4P4D-prefill_first", "capacity": 6.0, "capacity_bounded": True},
        {"name": "kvmesh kv/4P4D-prefill_first-always", "kind": "kvmesh",
         "config": "kv/4P4D-prefill_first-always", "capacity": 4.0,
         "capacity_bounded": True},
        {"name": "dynamo kv_router/4P4D", "kind": "dynamo", "config": "dynamo kv_router",
         "capacity": 4.5, "capacity_bounded": True},
        {"name": "kvmesh kv/8agg", "kind": "kvmesh", "config": "kv/8agg", "capacity": 5.0,
         "capacity_bounded": False},
        {"name": "dynamo kv_router/8agg", "kind": "dynamo", "config": "dynamo kv_router",
         "capacity": 0.0, "capacity_bounded": False, "error": "boom"},
    ]
    rows = rows_from_systems(systems)
    assert [(r["split"], r["prefill"], r["decode"]) for r in rows] == [
        ("4P4D", 4, 4), ("8agg", 0, 0)]
    assert rows[0]["best"] == "kvmesh ttft_pd/4P4D-prefill_first"
    assert rows[0]["dynamo"] == {"kv_router": 4.5}
    assert rows[0]["ratio"] == pytest.approx(6.0 / 4.5)
    assert rows[1]["dynamo"] == {"kv_router": None} and rows[1]["ratio"] is None
