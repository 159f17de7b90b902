"""Blocks the store connector saved reach the worker's KV event relay as tier ``store``:
vLLM-CPU engine (tiny model) with the connector and vLLM's ZMQ KV events → KvEventRelay →
Redis; the relay's state holds the prompt's chained hashes under "device" and "store"."""

from __future__ import annotations

import asyncio

import pytest

from services.common.block_hash import block_hashes
from services.common.config import load_config
from services.common.event_bus import stream_name
from services.common.procs import Child
from services.store_master.main import StoreMasterConfig, start_store_master
from tests.integration.conftest import base_args
from tests.integration.pd_support import BLOCK, KV_GIB, MAX_MODEL_LEN, prompt, run
from tests.waiting import wait_for
from workers.engines.vllm_engine import VllmEngine, VllmEngineConfig
from workers.kv.configs import store_kv_transfer_config
from workers.kv.event_relay import EventEndpoints, KvEventRelay, vllm_kv_events_config
from workers.model.tiny import ensure_tiny_model
from workers.store_node import StoreNodeProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


async def test_saved_blocks_are_published_with_tier_store(etcd: Child,
                                                          redis_server: Child) -> None:
    app = await start_store_master(load_config(StoreMasterConfig, [
        *base_args(etcd.address, "storeev"), "--tick-interval-s", "0.1"], {}))
    node = await asyncio.to_thread(StoreNodeProcess, app.server.address, 16)
    endpoints = EventEndpoints.create()
    relay = KvEventRelay("w-store", BLOCK, f"redis://{redis_server.address}",
                         stream_name("storeev"), endpoints)
    engine: VllmEngine | None = None
    try:
        await relay.start()
        engine = VllmEngine(VllmEngineConfig(
            model_path=str(ensure_tiny_model()), max_model_len=MAX_MODEL_LEN,
            block_size=BLOCK, kv_cache_space_gib=KV_GIB, seed=0,
            kv_transfer_config=store_kv_transfer_config(app.server.address),
            kv_events_config=vllm_kv_events_config(endpoints),
            env={"UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo"}))
        await engine.start()
        tokens = prompt(61, 5 * BLOCK + 3)
        await run(engine, "ev-store-1", tokens)
        want = set(block_hashes(tokens, BLOCK)[:5])

        def tiers() -> dict[str, set[int]]:
            return {t.tier: set(t.block_hashes) for t in relay.state().tiers}

        await wait_for(lambda: (want <= tiers().get("store", set())
                                and want <= tiers().get("device", set())), 15,
                       lambda: f"the prompt's 5 blocks in tiers store and device: {tiers()}")
        assert app.master.stats().complete_objects == 5
    finally:
        if engine is not None:
            await engine.shutdown()
        await relay.close()
        endpoints.remove()
        await asyncio.to_thread(node.stop)
        await app.server.stop()
