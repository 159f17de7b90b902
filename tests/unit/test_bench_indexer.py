"""bench/indexer at a tiny size: the workload is replayable and well-formed, KvIndex answers it
like the brute-force reference, and the report has the documented shape."""

from __future__ import annotations

import json
from pathlib import Path

from bench.indexer import run
from bench.indexer.sides import Dynamo, Ours, load_dynamo
from bench.indexer.workload import WorkloadConfig, generate, reference_matches
from services.common.block_hash import block_hashes, local_block_hash

TINY = WorkloadConfig(total_blocks=400, workers=4, prefixes=8, prefix_max=12, suffix_max=6,
                      evict=0.4, queries=80, seed=7)


def test_workload_is_replayable_and_well_formed() -> None:
    wl = generate(TINY)
    assert generate(TINY).events == wl.events and generate(TINY).queries == wl.queries
    assert generate(WorkloadConfig(**{**TINY.__dict__, "seed": 8})).events != wl.events
    assert wl.stored_blocks >= TINY.total_blocks and wl.removed_blocks > 0
    # per worker: ids from 0 without holes; stored chains continue a block the worker holds;
    # removals drop only held blocks; replaying gives the final holdings
    held: dict[int, set[int]] = {w: set() for w in range(TINY.workers)}
    next_id = dict.fromkeys(range(TINY.workers), 0)
    for e in wl.events:
        assert e.event_id == next_id[e.worker]
        next_id[e.worker] += 1
        if e.kind == "stored":
            assert e.hashes and len(e.locals) == len(e.hashes)
            assert e.parent is None or e.parent in held[e.worker]
            assert not held[e.worker] & set(e.hashes)
            held[e.worker].update(e.hashes)
        else:
            assert e.kind == "removed" and set(e.hashes) <= held[e.worker]
            held[e.worker].difference_update(e.hashes)
    assert held == wl.held
    kinds = {q.kind for q in wl.queries}
    assert kinds == {"hit", "replay", "miss"}
    for q in wl.queries:
        assert list(q.hashes) == block_hashes(q.tokens, TINY.block_size)
        assert list(q.locals) == [local_block_hash(q.tokens[i:i + TINY.block_size])
                                  for i in range(0, len(q.tokens), TINY.block_size)]
        ref = reference_matches(wl.held, q.hashes)
        if q.kind == "miss":
            assert ref == {}
    assert sum(bool(reference_matches(wl.held, q.hashes)) for q in wl.queries) > 40


def test_kvindex_agrees_with_the_brute_force_reference() -> None:
    wl = generate(TINY)
    ours = Ours()
    ours.apply_all(ours.convert_events(wl.events))
    assert {int(w[1:]): set().union(*t.values()) for w, t in ours.index.dump().items()} == \
        {w: hs for w, hs in wl.held.items() if hs}
    for q in wl.queries:
        got = ours.query(ours.query_input(q))
        assert ours.normalise(got) == reference_matches(wl.held, q.hashes)
        assert all(o.by_tier == {"device": o.blocks} for o in got.values())


def test_run_size_report_shape_and_sanity() -> None:
    tree_cls, info = load_dynamo()
    assert set(info) >= {"available", "error", "import", "version"}
    sides = [Ours()] + ([Dynamo(tree_cls)] if tree_cls is not None else [])
    row = run.run_size(TINY, sides, event_reps=1, passes=2, no_gc=False, chunk=16)
    json.dumps(row)
    assert row["workload"]["queries"] == TINY.queries
    assert row["workload"]["index_stats"]["workers"] == TINY.workers
    for name in [s.name for s in sides]:
        r = row["sides"][name]
        assert r["mismatches"] == 0
        assert r["events_per_s"] > 0 and r["queries_per_s"] > 0 and r["hash_us_mean"] > 0
        lat = r["latency_us"]
        assert lat["n"] == 2 * TINY.queries and 0 < lat["p50"] <= lat["p99"] <= lat["max"]
        assert len(r["passes"]) == 2 and set(r["latency_us_by_kind"]) == {"hit", "replay",
                                                                          "miss"}
    assert ("ratios" in row) == (tree_cls is not None)


def test_main_writes_json_and_png(tmp_path: Path) -> None:
    code = run.main(["--sizes", "150,300", "--workers", "3", "--queries", "20", "--passes",
                     "1", "--event-reps", "1", "--no-dynamo", "--cpu", "none",
                     "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "indexer.json").read_text())
    assert report["schema"] == "kvmesh.bench.indexer/1" and report["all_correct"]
    assert [r["total_blocks"] for r in report["results"]] == [150, 300]
    assert report["dynamo"]["available"] is False and "ratios" not in report["results"][0]
    assert report["png"] is None or (tmp_path / "indexer.png").stat().st_size > 0


def test_percentiles() -> None:
    p = run.percentiles_us(list(range(1000, 101000, 1000)))  # 1..100 µs
    assert (p["p50"], p["p90"], p["p99"], p["max"], p["n"]) == (50.0, 90.0, 99.0, 100.0, 100)
