"""The store connector's vLLM-free planner: settings, keys, lookups, load and save plans,
reports, and the worker half's result bookkeeping (no vLLM, no network)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.common.block_hash import block_hashes
from workers.kv.store.planner import (
    BlockJob,
    StorePlanner,
    StoreSettings,
    failed_blocks,
    job_counts,
    key_prefix,
    leading,
)

BS = 4
PREFIX = "kv/layout/tp0of1/"


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 131 + i * 7) % 97 + 1 for i in range(n)]


def planner(**kw: bool) -> StorePlanner:
    return StorePlanner(BS, PREFIX, **kw)


def hit_and_allocate(p: StorePlanner, req_id: str, toks: list[int], local: int,
                     hits: int) -> None:
    """A lookup after ``local`` locally cached blocks finds ``hits`` blocks; vLLM allocates."""
    p.track(req_id, toks, True)
    p.matched(req_id, local * BS, hits)
    p.allocated(req_id, hits * BS)


def test_the_planner_imports_no_vllm() -> None:
    code = ("import sys, workers.kv.store.planner; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parents[2])
    assert out.stdout.strip() == "[]"


def test_settings_from_extra_config() -> None:
    s = StoreSettings.from_extra({"store_master": "m:1"})
    assert s == StoreSettings("m:1", replicas=1, save=True, load=True, async_load=False,
                              publish_events=True, l1_bytes=0, segment_bytes=0,
                              rpc_timeout_s=5.0, transfer_timeout_s=10.0)
    s = StoreSettings.from_extra({"store_master": "m:1", "replicas": "2", "l1_mib": 3,
                                  "segment_mib": 1, "async_load": True, "save": False,
                                  "publish_events": False, "rpc_timeout_s": 1})
    assert (s.replicas, s.l1_bytes, s.segment_bytes, s.async_load, s.save, s.load,
            s.publish_events, s.rpc_timeout_s) == (2, 3 << 20, 1 << 20, True, False, True,
                                                   False, 1.0)
    hybrid = StoreSettings.from_extra({"store_master": "m:1"}, kv_cache_groups=2)
    assert not hybrid.save and not hybrid.load  # hybrid models: the store is off
    with pytest.raises(ValueError, match="store_master"):
        StoreSettings.from_extra({"replicas": 1})


def test_keys_are_the_prefix_and_chained_hashes() -> None:
    prefix = key_prefix("arch|float32|B32", 1, 2)
    assert prefix.startswith("kv/") and prefix.endswith("/tp1of2/")
    assert len(prefix.split("/")[1]) == 16
    assert key_prefix("arch|bfloat16|B32", 1, 2) != prefix
    p = planner()
    toks = tokens(3 * BS + 1)
    assert p.keys_of(toks) == [f"{PREFIX}{h:016x}" for h in block_hashes(toks, BS)]


def test_lookup_covers_full_blocks_after_the_local_hit_never_the_last_token() -> None:
    p = planner()
    toks = tokens(5 * BS + 1)
    keys = p.keys_of(toks)
    p.track("r", toks, True)
    assert p.lookup("r", 0) == keys[:5]
    assert p.lookup("r", 2 * BS) == keys[2:5]
    exact = tokens(4 * BS, seed=1)
    p.track("e", exact, True)
    assert p.lookup("e", 0) == p.keys_of(exact)[:3]  # the last token's block: computed
    assert p.lookup("e", 3 * BS) == []
    p.track("x", tokens(3 * BS), False)  # ineligible (LoRA, multimodal, embeddings)
    assert p.lookup("x", 0) == []
    p.track("empty", [], True)
    assert p.lookup("empty", 0) == []
    off = planner(load=False)
    off.track("r", toks, True)
    assert off.lookup("r", 0) == []


def test_matched_reports_whole_blocks_and_async() -> None:
    p = planner()
    p.track("r", tokens(5 * BS + 1), True)
    assert p.matched("r", BS, 3) == (3 * BS, False)
    assert p.matched("r", BS, 0) == (0, False)
    a = planner(async_load=True)
    a.track("r", tokens(5 * BS + 1), True)
    assert a.matched("r", 0, 2) == (2 * BS, True)
    assert a.matched("r", 0, 0) == (0, False)  # a miss is never asynchronous


def test_a_load_starts_at_the_local_hit_the_lookup_saw() -> None:
    p = planner()
    toks = tokens(5 * BS + 3)
    keys = p.keys_of(toks)
    hit_and_allocate(p, "r", toks, 1, 3)
    ids = [10, 11, 12, 13, 14, 15]
    plan = p.plan({"r": 4 * BS}, {"r": BS + 3}, lambda _: ids)
    assert [(j.req_id, j.keys, j.block_ids, j.first) for j in plan.loads] == [
        ("r", keys[1:4], [11, 12, 13], 1)]
    assert [(j.keys, j.block_ids, j.first) for j in plan.saves] == [(keys[4:5], [14], 4)]
    again = p.plan({"r": 5 * BS + 3}, {"r": 1}, lambda _: ids)
    assert not again.loads and not again.saves


def test_no_kv_cache_manager_plans_nothing_but_prefetch() -> None:
    p = planner(prefetch=True)
    hit_and_allocate(p, "r", tokens(3 * BS + 1), 0, 3)
    p.track("q", tokens(3 * BS + 1, seed=2), True)
    p.matched("q", 0, 2)
    plan = p.plan({"r": 3 * BS}, {"r": 1}, None)
    assert not plan.loads and not plan.saves
    assert plan.prefetch == p.keys_of(tokens(3 * BS + 1, seed=2))[:2]  # q, not r (loading)


def test_async_load_plans_once_and_a_short_report_marks_the_request() -> None:
    p = planner(async_load=True)
    toks = tokens(4 * BS + 1)
    hit_and_allocate(p, "f", toks, 0, 4)
    first = p.plan({}, {}, lambda _: [1, 2, 3, 4, 5])
    assert [j.block_ids for j in first.loads] == [[1, 2, 3, 4]]
    p.allocated("f", 4 * BS)  # vLLM's call after an async load: plans nothing
    assert not p.plan({}, {}, lambda _: [1, 2, 3, 4, 5]).loads
    stored = p.reported({"f"}, [("f", 0, 1)])  # loaded block 0, then failed
    assert [s.block_hashes for s in stored] == [block_hashes(toks, BS)[:1]]
    assert [s.token_ids for s in stored] == [toks[:BS]]
    assert p.lookup("f", 0) == []  # never offered the store again
    p.allocated("f", 4 * BS)  # no longer loading: a new plan
    assert [j.first for j in p.plan({}, {}, lambda _: [1, 2, 3, 4, 5]).loads] == [0]


def test_reports_become_stored_prefixes_unless_publishing_is_off() -> None:
    p = planner()
    toks = tokens(4 * BS + 3)
    p.track("v", toks, True)
    plan = p.plan({"v": 0}, {"v": 4 * BS + 3}, lambda _: [5, 6, 7, 8, 9])
    assert [j.block_ids for j in plan.saves] == [[5, 6, 7, 8]]
    stored = p.reported((), [("v", 0, 3)])
    assert len(stored) == 1
    assert stored[0].block_hashes == block_hashes(toks, BS)[:3]
    assert stored[0].token_ids == toks[:3 * BS]
    assert p.reported((), [("v", 0, 3), ("zz", 0, 2)]) == []  # reported once; unknown
    quiet = planner(publish=False)
    quiet.track("v", toks, True)
    quiet.plan({"v": 0}, {"v": 4 * BS + 3}, lambda _: [5, 6, 7, 8, 9])
    assert quiet.reported((), [("v", 0, 4)]) == []
    p.finished("v")
    assert "v" not in p.requests


def test_saves_skip_ineligible_requests_and_blocks_hit_locally() -> None:
    p = planner()
    p.track("x", tokens(3 * BS), False)
    p.track("h", tokens(4 * BS + 1), True)
    plan = p.plan({"x": 0, "h": 2 * BS}, {"x": 3 * BS, "h": 2 * BS + 1}, lambda _: [1, 2, 3,
                                                                                   4, 5])
    assert [(j.req_id, j.first, j.block_ids) for j in plan.saves] == [("h", 2, [3, 4])]
    off = planner(save=False)
    off.track("h", tokens(4 * BS + 1), True)
    assert not off.plan({"h": 0}, {"h": 4 * BS + 1}, lambda _: [1, 2, 3, 4, 5]).saves


def test_worker_bookkeeping() -> None:
    assert leading(["ok", "exists", "failed", "ok"], ("ok", "exists")) == 2
    assert leading([], ("ok",)) == 0
    jobs = [BlockJob("a", ["k1", "k2"], [1, 2], 0), BlockJob("b", ["k3"], [3], 4)]
    results = ["ok", "failed", "ok"]
    assert job_counts(jobs, results, ("ok",)) == [("a", 0, 1), ("b", 4, 1)]
    assert failed_blocks(jobs, results) == {2}
    with pytest.raises(ValueError):
        failed_blocks(jobs, results[:2])  # a result per block
