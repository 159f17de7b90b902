"""L1Pool in front of a StoreClient, with the in-process master and fake NIXL agent of
tests.store_inproc (no network): write-behind saves, L1-first loads, prefetch, eviction."""

from __future__ import annotations

import numpy as np

from tests.store_inproc import CoreMaster, FakeAgent
from workers.kv.store.l1 import CLEAN, L1Pool
from workers.kv.store_client import StoreClient

SLOT = 256


def setup(slots: int = 4) -> tuple[CoreMaster, FakeAgent, L1Pool, list[tuple[object, list[str]]]]:
    master, agent = CoreMaster(), FakeAgent()
    master.add_segment("s0", 1 << 16, "node0")
    client = StoreClient("127.0.0.1:1", stub=master.stub(), agent=agent)
    saved: list[tuple[object, list[str]]] = []
    pool = L1Pool(client, SLOT, slots, on_saved=lambda job, res: saved.append((job, res)))
    return master, agent, pool, saved


def test_write_behind_save_then_l1_and_store_loads() -> None:
    master, agent, pool, saved = setup()
    kv = np.random.default_rng(1).integers(0, 255, 8 * SLOT, dtype=np.uint8)
    a = int(kv.ctypes.data)
    # Two "layers" of 128 B per block are gathered into one 256-B object.
    items = [("k0", [(a, 128), (a + 1024, 128)]), ("k1", [(a + 128, 128), (a + 1152, 128)])]
    assert pool.save(("r", 0), items)
    kv_copy = kv.copy()
    kv[:] = 0  # vLLM may reuse the blocks right away: L1 holds a copy
    assert pool.drain(5)
    assert saved == [(("r", 0), ["ok", "ok"])]
    assert all(master.complete(k) for k in ("k0", "k1"))
    assert pool.contains("k0") == CLEAN
    out = np.zeros(8 * SLOT, dtype=np.uint8)
    o = int(out.ctypes.data)
    assert pool.load([("k0", [(o, 128), (o + 1024, 128)]), ("zz", [(o, 256)])]) == [True, False]
    assert (out[:128] == kv_copy[:128]).all() and (out[1024:1152] == kv_copy[1024:1152]).all()
    # The store copy is byte-identical (read it back through the client, bypassing L1).
    out2 = np.zeros(SLOT, dtype=np.uint8)
    assert pool.client.get("k1", [(int(out2.ctypes.data), SLOT)]) == "ok"
    assert (out2[:128] == kv_copy[128:256]).all() and (out2[128:] == kv_copy[1152:1280]).all()
    # Saving keys already in L1 writes nothing new and reports them as already stored.
    assert pool.save(("r", 2), items[:1]) and pool.drain(5)
    assert saved[-1] == (("r", 2), ["exists"])
    pool.close()


def test_full_pool_falls_back_and_clean_slots_are_evicted() -> None:
    master, agent, pool, saved = setup(slots=2)
    kv = np.arange(4 * SLOT, dtype=np.uint8)
    a = int(kv.ctypes.data)
    agent.dead.add("node0")  # the store write fails
    assert pool.save("j1", [("x", [(a, SLOT)]), ("y", [(a + SLOT, SLOT)])])
    assert pool.drain(5) and saved[-1] == ("j1", ["failed", "failed"])
    assert pool.stats.flush_failures == 2  # still readable from L1 (clean), evictable
    agent.dead.clear()
    assert pool.save("j2", [("z", [(a, SLOT)])])  # evicts the LRU clean slot
    assert pool.drain(5) and pool.stats.evictions == 1
    assert pool.contains("x") is None and pool.contains("z") == CLEAN
    assert master.complete("z")
    pool.close()


def test_prefetch_brings_store_objects_into_l1() -> None:
    master, agent, pool, _ = setup()
    src = np.arange(SLOT, dtype=np.uint8)
    pool.client.register(int(src.ctypes.data), SLOT)
    assert pool.client.put("p", [(int(src.ctypes.data), SLOT)]) == "ok"
    pool.prefetch(["p", "missing"])
    assert pool.drain(5)
    assert pool.contains("p") == CLEAN and pool.contains("missing") is None
    assert (pool.stats.prefetched, pool.stats.prefetch_misses) == (1, 1)
    reads = len(agent.xfers)
    out = np.zeros(SLOT, dtype=np.uint8)
    assert pool.load([("p", [(int(out.ctypes.data), SLOT)])]) == [True]
    assert (out == src).all() and len(agent.xfers) == reads  # served from L1
    pool.close()
