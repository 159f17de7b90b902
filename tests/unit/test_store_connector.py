"""KvmeshStoreConnector's scheduler side inside a real vLLM scheduler (tiny model's config,
no engine, no network), with the real store master (core and servicer) answering the
lookups: what it reports as matched, which blocks it plans to load and save, what it
announces."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import pytest
from vllm.distributed.kv_events import BlockStored
from vllm.lora.request import LoRARequest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput

from services.common.block_hash import block_hashes
from tests.store_inproc import CoreMaster
from tests.vllm_scheduler import (
    EventRecorder,
    create_request,
    create_scheduler,
    create_vllm_config,
    runner_output,
)
from workers.kv.configs import store_kv_transfer_config
from workers.kv.event_translate import EventTranslator
from workers.kv.store.metadata import StoreMeta, StoreWorkerMeta
from workers.kv.store.planner import BlockJob
from workers.kv.store_client import StoreClient
from workers.kv.store_connector import KvmeshStoreConnector

BS = 32


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 700 + 3 for i in range(n)]


class Store:
    """The real store master, core and gRPC servicer (:class:`~tests.store_inproc.CoreMaster`),
    behind the stub seam of a real metadata-only StoreClient (the gRPC hop is the only thing
    left out). ``asked`` lists the keys of each lookup; the scheduler side never calls any
    other RPC."""

    def __init__(self) -> None:
        self.inproc = CoreMaster()
        self.master = self.inproc.core
        self.master.mount_segment("node", "segment", 0, 1 << 20)

    def stub(self) -> Any:
        return self.inproc.stub()

    @property
    def asked(self) -> list[list[str]]:
        calls = self.inproc.calls
        assert {name for name, _ in calls} <= {"BatchExistKey"}, calls
        return [k for name, k in calls if name == "BatchExistKey"]

    def put(self, keys: list[str]) -> None:
        for k in keys:
            self.master.put_start(k, 64)
            self.master.put_end(k)

    def remove(self, key: str) -> None:
        # The read leases of earlier lookups run out first.
        self.inproc.clock.advance(self.master.params.lease_ttl_s + 1)
        self.master.remove(key)


Made = tuple[Scheduler, KvmeshStoreConnector, Store]


@pytest.fixture
def make() -> Iterator[Any]:
    made: list[Scheduler] = []

    def build(num_blocks: int = 256, max_num_batched_tokens: int = 1024,
              dtype: Literal["float32", "bfloat16"] = "float32", policy: str | None = None,
              **extra: Any) -> Made:
        ktc = store_kv_transfer_config("127.0.0.1:1", kv_load_failure_policy=policy,
                                       extra=extra)
        cfg = create_vllm_config(ktc,
                                 block_size=BS, dtype=dtype,
                                 max_num_batched_tokens=max_num_batched_tokens)
        sched = create_scheduler(cfg, num_blocks)
        made.append(sched)
        conn = sched.connector
        assert isinstance(conn, KvmeshStoreConnector) and conn.connector_scheduler is not None
        store = Store()
        half = conn.connector_scheduler
        assert half.client is not None
        half.client.close()
        half.client = StoreClient("127.0.0.1:1", nixl=False, stub=store.stub())
        return sched, conn, store

    yield build
    for sched in made:
        sched.shutdown()


def keys_of(conn: KvmeshStoreConnector, token_ids: list[int] | None) -> list[str]:
    assert conn.connector_scheduler is not None and token_ids is not None
    return conn.connector_scheduler.planner.keys_of(token_ids)


def step_meta(sched: Scheduler) -> tuple[Any, StoreMeta]:
    out = sched.schedule()
    meta = out.kv_connector_metadata
    assert isinstance(meta, StoreMeta)
    return out, meta


def jobs(js: list[BlockJob]) -> list[tuple[list[str], list[int]]]:
    return [(j.keys, j.block_ids) for j in js]


def test_keys_are_chained_hashes_under_a_layout_prefix(make: Any) -> None:
    _, conn, _ = make()
    toks = tokens(3 * BS + 5)
    keys = keys_of(conn, toks)
    assert [k.rsplit("/", 1)[1] for k in keys] == [f"{h:016x}" for h in block_hashes(toks, BS)]
    assert all(k.startswith("kv/") and "/tp0of1/" in k for k in keys)
    _, other, _ = make(dtype="bfloat16")
    assert keys_of(other, toks)[0] != keys[0]  # another layout never mixes


def test_matched_tokens_full_blocks_after_local_hit_never_last_token(make: Any) -> None:
    _, conn, store = make()
    req = create_request("r", tokens(5 * BS + 7))
    keys = keys_of(conn, req.prompt_token_ids)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)  # miss: compute
    store.put(keys)
    assert conn.get_num_new_matched_tokens(req, 0) == (5 * BS, False)
    assert conn.get_num_new_matched_tokens(req, 2 * BS) == (3 * BS, False)
    assert store.asked[-1] == keys[2:5]  # only the blocks after the local hit
    exact = create_request("e", tokens(4 * BS, seed=1))
    store.put(keys_of(conn, exact.prompt_token_ids))
    assert conn.get_num_new_matched_tokens(exact, 0) == (3 * BS, False)
    assert conn.get_num_new_matched_tokens(exact, 3 * BS) == (0, False)
    store.remove(keys[3])  # a hole stops the prefix
    assert conn.get_num_new_matched_tokens(req, 0) == (3 * BS, False)
    asked = len(store.asked)
    lora = create_request("l", tokens(3 * BS + 1, seed=3), lora=LoRARequest("l", 1, "/nonexistent"))
    store.put(keys_of(conn, lora.prompt_token_ids)[:1])
    assert conn.get_num_new_matched_tokens(lora, 0) == (0, False)
    assert len(store.asked) == asked  # not eligible: not even asked


def test_load_plan_and_saves_follow_the_steps(make: Any) -> None:
    sched, conn, store = make()
    toks = tokens(5 * BS + 7)
    keys = keys_of(conn, toks)
    # A finished request leaves block 0 in the engine's prefix cache (a local hit).
    warm = create_request("w", toks[:BS + 5], max_tokens=1)
    sched.add_request(warm)
    out, _ = step_meta(sched)
    sched.update_from_output(out, runner_output(sched, out))
    assert "w" not in sched.requests
    store.put(keys[:4])
    req = create_request("r", toks, max_tokens=2)
    sched.add_request(req)
    out, meta = step_meta(sched)
    assert store.asked[-1] == keys[1:5]  # after the local hit, never the last token's block
    # vLLM computes block 0 locally, loads 1-3 from the store and computes the rest.
    assert [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [
        ("r", 4 * BS)]
    assert out.num_scheduled_tokens == {"r": BS + 7}
    ids = sched.kv_cache_manager.get_block_ids("r")[0]
    assert jobs(meta.loads) == [(keys[1:4], list(ids[1:4]))]
    assert [j.first for j in meta.loads] == [1]
    # Block 4 becomes full in this step and was neither hit nor loaded: saved.
    assert jobs(meta.saves) == [(keys[4:5], [ids[4]])]
    sched.update_from_output(out, runner_output(sched, out))
    out, meta = step_meta(sched)
    assert out.num_scheduled_tokens == {"r": 1}
    assert not meta.loads and not meta.saves and not meta.prefetch
    sched.update_from_output(out, runner_output(sched, out))  # max_tokens: finished
    assert not sched.requests
    assert conn.connector_scheduler is not None
    assert "r" not in conn.connector_scheduler.planner.requests
    # request_finished said (False, None): vLLM freed every block at once.
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_chunked_prefill_saves_each_block_once(make: Any) -> None:
    sched, conn, store = make(max_num_batched_tokens=100)
    req = create_request("c", tokens(5 * BS + 7))
    keys = keys_of(conn, req.prompt_token_ids)
    sched.add_request(req)
    metas = []
    for want in (100, 67, 1):
        out, meta = step_meta(sched)
        assert out.num_scheduled_tokens == {"c": want}
        metas.append(meta)
        sched.update_from_output(out, runner_output(sched, out))
    assert store.asked == [keys[:5]]  # looked up once, a miss
    ids = sched.kv_cache_manager.get_block_ids("c")[0]
    m1, m2, m3 = metas
    assert jobs(m1.saves) == [(keys[:3], list(ids[:3]))]
    assert jobs(m2.saves) == [(keys[3:5], list(ids[3:5]))]
    assert not m3.saves and not any(m.loads for m in metas)


def test_save_and_load_can_be_switched_off(make: Any) -> None:
    sched, conn, store = make(save=False, load=False)
    req = create_request("q", tokens(3 * BS + 1))
    store.put(keys_of(conn, req.prompt_token_ids))
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.add_request(req)
    out, meta = step_meta(sched)
    assert [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [("q", 0)]
    assert out.num_scheduled_tokens == {"q": 3 * BS + 1}
    assert not meta.saves and not meta.loads and not store.asked


def test_store_master_is_required() -> None:
    ktc = store_kv_transfer_config("127.0.0.1:1")
    ktc["kv_connector_extra_config"] = {}
    cfg = create_vllm_config(ktc, block_size=BS)
    with pytest.raises(ValueError, match="store_master"):
        create_scheduler(cfg)


def test_stored_blocks_become_store_tier_events(make: Any) -> None:
    sched, conn, _ = make()
    recorder = EventRecorder()
    sched.kv_event_publisher = recorder  # type: ignore[assignment]
    toks = tokens(4 * BS + 3)
    req = create_request("v", toks)
    keys = keys_of(conn, toks)
    sched.add_request(req)
    out, meta = step_meta(sched)
    assert [j.block_ids for j in meta.saves] == [
        list(sched.kv_cache_manager.get_block_ids("v")[0][:4])]
    # The worker saved the first 3 of the 4 blocks (the 4th failed).
    sched.update_from_output(out, runner_output(sched, out, kv_connector_output=KVConnectorOutput(
        kv_connector_worker_meta=StoreWorkerMeta([("v", 0, 3)]))))
    events = recorder.take()
    assert len(events) == 1 and not list(conn.take_events())
    ev = events[0]
    assert isinstance(ev, BlockStored)
    assert ev.medium == "STORAGE" and ev.parent_block_hash is None
    assert ev.token_ids == toks[:3 * BS]
    translated = EventTranslator(BS).translate(
        {"type": "BlockStored", "block_hashes": ev.block_hashes, "parent_block_hash": None,
         "token_ids": ev.token_ids, "block_size": BS, "medium": ev.medium})
    assert [(t.kind, t.tier) for t in translated] == [("stored", "store")]
    assert list(translated[0].block_hashes) == [int(k.rsplit("/", 1)[1], 16) for k in keys[:3]]
    # Nothing saved: nothing announced; unknown jobs are ignored.
    out, _ = step_meta(sched)
    sched.update_from_output(out, runner_output(sched, out, kv_connector_output=KVConnectorOutput(
        kv_connector_worker_meta=StoreWorkerMeta([("v", 0, 0), ("zz", 0, 2)]))))
    assert not recorder.take()
    merged = StoreWorkerMeta([("a", 0, 1)]).aggregate(StoreWorkerMeta([("b", 1, 1)]))
    assert isinstance(merged, StoreWorkerMeta) and len(merged.done) == 2


def test_a_tenant_s_salted_prompt_has_its_own_store_keys(make: Any) -> None:
    sched, conn, store = make()
    recorder = EventRecorder()
    sched.kv_event_publisher = recorder  # type: ignore[assignment]
    toks = tokens(3 * BS + 1)
    planner = conn.connector_scheduler.planner
    a_keys = planner.keys_of(toks, "tenant-a")
    assert a_keys[0] != keys_of(conn, toks)[0] != planner.keys_of(toks, "tenant-b")[0]
    store.put(a_keys)
    hit = create_request("a", toks, cache_salt="tenant-a")
    assert conn.get_num_new_matched_tokens(hit, 0) == (3 * BS, False)
    for name, salt in (("b", "tenant-b"), ("plain", None)):  # B's guess and no tenant: miss
        assert conn.get_num_new_matched_tokens(create_request(name, toks, cache_salt=salt),
                                               0) == (0, False)
    # A's save is announced with A's salt, so the indexer's hashes are A's salted ones.
    saver = create_request("s", tokens(2 * BS + 1, seed=4), cache_salt="tenant-a")
    sched.add_request(saver)
    out, _ = step_meta(sched)
    sched.update_from_output(out, runner_output(sched, out, kv_connector_output=KVConnectorOutput(
        kv_connector_worker_meta=StoreWorkerMeta([("s", 0, 2)]))))
    (ev,) = recorder.take()
    assert isinstance(ev, BlockStored) and ev.extra_keys == [("tenant-a",), None]
    translated = EventTranslator(BS).translate(
        {"type": "BlockStored", "block_hashes": ev.block_hashes, "parent_block_hash": None,
         "token_ids": ev.token_ids, "block_size": BS, "medium": ev.medium,
         "extra_keys": ev.extra_keys})
    assert list(translated[0].block_hashes) == block_hashes(ev.token_ids, BS, salt="tenant-a")
    assert list(translated[0].block_hashes) == list(ev.block_hashes)


def queued_hit(make: Any, **extra: Any) -> tuple[list[StoreMeta], list[str], Store]:
    """A request whose lookup hits the store but that waits for free blocks, two steps."""
    sched, conn, store = make(num_blocks=8, **extra)  # 7 usable blocks
    sched.add_request(create_request("a", tokens(5 * BS + 3, seed=2), max_tokens=8))
    req = create_request("w", tokens(3 * BS + 2))  # 4 blocks: do not fit next to a's 6
    keys = keys_of(conn, req.prompt_token_ids)
    store.put(keys)
    sched.add_request(req)
    metas = []
    for _ in range(2):
        out, meta = step_meta(sched)
        assert set(out.num_scheduled_tokens) == {"a"}  # w stays queued
        metas.append(meta)
        sched.update_from_output(out, runner_output(sched, out))
    assert store.asked[1:] == [keys[:3], keys[:3]]  # after a's: w's, in both steps
    return metas, keys, store


def test_lookup_hit_of_a_queued_request_is_prefetched_once(make: Any) -> None:
    (m1, m2), keys, _ = queued_hit(make, l1_mib=1)
    assert m1.prefetch == keys[:3] and not m1.loads
    assert not m2.prefetch and not m2.loads  # once per request
    (m1, m2), _, _ = queued_hit(make)  # without L1 nothing is prefetched
    assert not m1.prefetch and not m2.prefetch


def test_a_failed_load_is_not_offered_again(make: Any) -> None:
    sched, conn, store = make(policy="recompute", async_load=True)
    req = create_request("f", tokens(4 * BS + 1))
    keys = keys_of(conn, req.prompt_token_ids)
    store.put(keys)
    assert conn.get_num_new_matched_tokens(req, 0) == (4 * BS, True)
    sched.add_request(req)
    out, meta = step_meta(sched)
    assert not out.num_scheduled_tokens  # parked: WAITING_FOR_REMOTE_KVS
    ids = list(sched.kv_cache_manager.get_block_ids("f")[0])
    assert [(j.req_id, j.keys, j.block_ids, j.first) for j in meta.loads] == [
        ("f", keys[:4], ids[:4], 0)]
    # The worker loaded only the first block, then failed.
    sched.update_from_output(out, runner_output(sched, out, kv_connector_output=KVConnectorOutput(
        finished_recving={"f"}, invalid_block_ids=set(ids[1:4]),
        kv_connector_worker_meta=StoreWorkerMeta([("f", 0, 1)]))))
    out, meta = step_meta(sched)
    assert out.num_scheduled_tokens == {"f": 3 * BS + 1}  # recomputed after block 0
    assert not meta.loads
    asked = len(store.asked)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    assert len(store.asked) == asked  # not even asked
