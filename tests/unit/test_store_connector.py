"""KvmeshStoreConnector's scheduler side with duck-typed vLLM objects and a fake store
(no network): what it reports as matched, which blocks it plans to load and save."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from vllm.distributed.kv_events import BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from services.common.block_hash import block_hashes
from workers.kv.event_translate import EventTranslator
from workers.kv.store_connector import (
    KvmeshStoreConnector,
    StoreMeta,
    StoreWorkerMeta,
    store_kv_transfer_config,
)

BS = 32


def vllm_config(block_size: int = BS, dtype: str = "float32", **extra: Any) -> Any:
    ktc = store_kv_transfer_config("127.0.0.1:1", extra=extra)
    model = SimpleNamespace(
        architecture="LlamaForCausalLM", dtype=dtype, use_mla=False,
        get_total_num_hidden_layers=lambda: 2, get_total_num_kv_heads=lambda: 1,
        get_head_size=lambda: 64)
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=ktc[
            "kv_connector_extra_config"], is_kv_producer=True),
        model_config=model,
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1))


class FakeStore:
    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.asked: list[list[str]] = []

    def exists_prefix(self, keys: list[str]) -> int:
        self.asked.append(list(keys))
        n = 0
        for k in keys:
            if k not in self.keys:
                break
            n += 1
        return n


class FakeManager:
    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return (self.blocks[req_id],)


def make(**extra: Any) -> tuple[KvmeshStoreConnector, FakeStore, FakeManager]:
    conn = KvmeshStoreConnector(vllm_config(**extra), KVConnectorRole.SCHEDULER, None)
    store, mgr = FakeStore(), FakeManager()
    conn._client = store  # type: ignore[assignment]
    conn._kv_cache_manager = mgr  # type: ignore[assignment]
    return conn, store, mgr


def request(rid: str, n: int, seed: int = 0, **kw: Any) -> Any:
    tokens = [(seed * 7919 + i * 31) % 900 + 3 for i in range(n)]
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, num_computed_tokens=0,
                           lora_request=kw.get("lora"), mm_features=[], prompt_embeds=None)


def sched_out(new: list[tuple[str, int]] = (), cached: list[tuple[str, int]] = (),  # type: ignore[assignment]
              scheduled: dict[str, int] | None = None) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached],
                                              num_computed_tokens=[c for _, c in cached]),
        num_scheduled_tokens=scheduled or {})


def test_keys_are_chained_hashes_under_a_layout_prefix() -> None:
    conn, _, _ = make()
    req = request("r", 3 * BS + 5)
    keys = conn._keys(req.prompt_token_ids)
    hashes = block_hashes(req.prompt_token_ids, BS)
    assert [k.rsplit("/", 1)[1] for k in keys] == [f"{h:016x}" for h in hashes]
    assert all(k.startswith("kv/") and "/tp0of1/" in k for k in keys)
    other = KvmeshStoreConnector(vllm_config(dtype="bfloat16"), KVConnectorRole.SCHEDULER,
                                 None)
    assert other._keys(req.prompt_token_ids)[0] != keys[0]  # another layout never mixes


def test_matched_tokens_full_blocks_after_local_hit_never_last_token() -> None:
    conn, store, _ = make()
    req = request("r", 5 * BS + 7)
    keys = conn._keys(req.prompt_token_ids)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)  # miss: compute
    store.keys |= set(keys)
    assert conn.get_num_new_matched_tokens(req, 0) == (5 * BS, False)
    assert conn.get_num_new_matched_tokens(req, 2 * BS) == (3 * BS, False)
    assert store.asked[-1] == keys[2:5]  # only the blocks after the local hit
    exact = request("e", 4 * BS, seed=1)
    store.keys |= set(conn._keys(exact.prompt_token_ids))
    assert conn.get_num_new_matched_tokens(exact, 0) == (3 * BS, False)
    assert conn.get_num_new_matched_tokens(exact, 3 * BS) == (0, False)
    store.keys.discard(keys[3])  # a hole stops the prefix
    assert conn.get_num_new_matched_tokens(req, 0) == (3 * BS, False)
    asked = len(store.asked)
    lora = request("l", 3 * BS + 1, lora=object())
    assert conn.get_num_new_matched_tokens(lora, 0) == (0, False)
    assert len(store.asked) == asked  # not eligible: not even asked


def test_load_plan_and_saves_follow_the_steps() -> None:
    conn, store, mgr = make()
    req = request("r", 5 * BS + 7)
    keys = conn._keys(req.prompt_token_ids)
    store.keys |= set(keys[:4])
    mgr.blocks["r"] = [10, 11, 12, 13, 14, 15]
    assert conn.get_num_new_matched_tokens(req, BS) == (3 * BS, False)
    # vLLM sets num_computed_tokens (local + external) only after this call.
    conn.update_state_after_alloc(req, None, 3 * BS)  # type: ignore[arg-type]
    meta = conn.build_connector_meta(sched_out(new=[("r", 4 * BS)], scheduled={"r": BS + 7}))
    assert isinstance(meta, StoreMeta)
    assert [(j.keys, j.block_ids) for j in meta.loads] == [(keys[1:4], [11, 12, 13])]
    # Block 4 becomes full in this step and was neither hit nor loaded: saved.
    assert [(j.keys, j.block_ids) for j in meta.saves] == [(keys[4:5], [14])]
    meta = conn.build_connector_meta(sched_out(cached=[("r", 5 * BS + 7)],
                                               scheduled={"r": 1}))
    assert isinstance(meta, StoreMeta) and not meta.loads and not meta.saves
    assert conn.request_finished(req, [10, 11]) == (False, None)
    assert "r" not in conn._reqs


def test_chunked_prefill_saves_each_block_once() -> None:
    conn, _, mgr = make()
    req = request("c", 5 * BS + 7)
    keys = conn._keys(req.prompt_token_ids)
    mgr.blocks["c"] = list(range(20, 26))
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    conn.update_state_after_alloc(req, None, 0)  # type: ignore[arg-type]
    m1 = conn.build_connector_meta(sched_out(new=[("c", 0)], scheduled={"c": 100}))
    m2 = conn.build_connector_meta(sched_out(cached=[("c", 100)], scheduled={"c": 67}))
    m3 = conn.build_connector_meta(sched_out(cached=[("c", 167)], scheduled={"c": 1}))
    assert isinstance(m1, StoreMeta) and isinstance(m2, StoreMeta)
    assert isinstance(m3, StoreMeta)
    assert [j.block_ids for j in m1.saves] == [[20, 21, 22]]
    assert [j.keys for j in m2.saves] == [keys[3:5]] and not m3.saves


def test_save_and_load_can_be_switched_off() -> None:
    conn, store, mgr = make(save=False, load=False)
    req = request("q", 3 * BS + 1)
    store.keys |= set(conn._keys(req.prompt_token_ids))
    mgr.blocks["q"] = [1, 2, 3, 4]
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    meta = conn.build_connector_meta(sched_out(new=[("q", 0)], scheduled={"q": 3 * BS + 1}))
    assert isinstance(meta, StoreMeta) and not meta.saves


def test_store_master_is_required() -> None:
    cfg = vllm_config()
    cfg.kv_transfer_config.kv_connector_extra_config = {}
    with pytest.raises(ValueError, match="store_master"):
        KvmeshStoreConnector(cfg, KVConnectorRole.SCHEDULER, None)


def test_stored_blocks_become_store_tier_events() -> None:
    conn, _, mgr = make()
    req = request("v", 4 * BS + 3)
    keys = conn._keys(req.prompt_token_ids)
    mgr.blocks["v"] = [5, 6, 7, 8, 9]
    conn.get_num_new_matched_tokens(req, 0)
    conn.build_connector_meta(sched_out(new=[("v", 0)], scheduled={"v": 4 * BS + 3}))
    # The worker saved the first 3 of the 4 blocks (the 4th failed).
    conn.update_connector_output(SimpleNamespace(  # type: ignore[arg-type]
        finished_recving=None, kv_connector_worker_meta=StoreWorkerMeta([("v", 0, 3)])))
    events = list(conn.take_events())
    assert len(events) == 1 and not list(conn.take_events())
    ev = events[0]
    assert isinstance(ev, BlockStored)
    assert ev.medium == "STORAGE" and ev.parent_block_hash is None
    assert ev.token_ids == req.prompt_token_ids[:3 * BS]
    translated = EventTranslator(BS).translate(
        {"type": "BlockStored", "block_hashes": ev.block_hashes, "parent_block_hash": None,
         "token_ids": ev.token_ids, "block_size": BS, "medium": ev.medium})
    assert [(t.kind, t.tier) for t in translated] == [("stored", "store")]
    assert list(translated[0].block_hashes) == [int(k.rsplit("/", 1)[1], 16) for k in keys[:3]]
    # Nothing saved: nothing announced; unknown jobs are ignored.
    conn.update_connector_output(SimpleNamespace(  # type: ignore[arg-type]
        finished_recving=None,
        kv_connector_worker_meta=StoreWorkerMeta([("v", 0, 0), ("zz", 0, 2)])))
    assert not list(conn.take_events())
    merged = StoreWorkerMeta([("a", 0, 1)]).aggregate(StoreWorkerMeta([("b", 1, 1)]))
    assert isinstance(merged, StoreWorkerMeta) and len(merged.done) == 2


def test_lookup_hit_of_a_queued_request_is_prefetched_once() -> None:
    conn, store, mgr = make(l1_mib=1)
    req = request("w", 3 * BS + 2)
    keys = conn._keys(req.prompt_token_ids)
    store.keys |= set(keys)
    assert conn.get_num_new_matched_tokens(req, 0) == (3 * BS, False)
    # Not scheduled in this step (no update_state_after_alloc): prefetch its hits.
    meta = conn.build_connector_meta(sched_out())
    assert isinstance(meta, StoreMeta) and meta.prefetch == keys[:3] and not meta.loads
    conn.get_num_new_matched_tokens(req, 0)
    meta = conn.build_connector_meta(sched_out())
    assert isinstance(meta, StoreMeta) and not meta.prefetch  # once per request
    # Without L1 nothing is prefetched.
    plain, store2, _ = make()
    store2.keys |= set(keys)
    plain.get_num_new_matched_tokens(request("w", 3 * BS + 2), 0)
    meta = plain.build_connector_meta(sched_out())
    assert isinstance(meta, StoreMeta) and not meta.prefetch


def test_a_failed_load_is_not_offered_again() -> None:
    conn, store, mgr = make(async_load=True)
    req = request("f", 4 * BS + 1)
    keys = conn._keys(req.prompt_token_ids)
    store.keys |= set(keys)
    mgr.blocks["f"] = [1, 2, 3, 4, 5]
    assert conn.get_num_new_matched_tokens(req, 0) == (4 * BS, True)
    conn.update_state_after_alloc(req, None, 4 * BS)  # type: ignore[arg-type]
    meta = conn.build_connector_meta(sched_out())
    assert isinstance(meta, StoreMeta) and len(meta.loads) == 1
    conn.update_state_after_alloc(req, None, 4 * BS)  # type: ignore[arg-type]
    assert not conn._pending_loads  # the call after an async load plans nothing
    # The worker loaded only the first block, then failed.
    conn.update_connector_output(SimpleNamespace(  # type: ignore[arg-type]
        finished_recving={"f"}, kv_connector_worker_meta=StoreWorkerMeta([("f", 0, 1)])))
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
