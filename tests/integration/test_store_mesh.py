"""KV reuse across requests through the whole mesh: a vLLM worker started by the normal
worker wiring with ``--store-master`` (kvmesh store connector), a store node, the store
master, the indexer, router and frontend. A prefix evicted from the engine (its prefix
cache reset) comes back from the store: the client sees it in ``cached_tokens``, the
tokens equal the computed ones, and the indexer lists the blocks in tier ``store``. With
the official ``openai`` client, JSON-schema output with logprobs over a prefix loaded from
the store equals the aggregated session mesh's, token for token."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import httpx
import pytest

from protos import indexer_pb2, indexer_pb2_grpc
from services.common.config import load_config
from services.common.procs import Child
from services.frontend.main import FrontendApp, FrontendConfig, start_frontend
from services.frontend.models import Tokenizer
from services.frontend.openai_schema import parse_chat, with_tenant
from services.indexer.main import IndexerApp, IndexerConfig, start_indexer
from services.router.main import RouterApp, RouterConfig, start_router
from services.store_master.main import StoreMasterApp, StoreMasterConfig, start_store_master
from tests.integration.conftest import Mesh, base_args, wait_routable
from tests.integration.openai_pd_support import CASES, JSON_QUESTION, assert_same, client
from tests.integration.pd_support import prompt
from tests.waiting import wait_for
from workers.config import WorkerConfig
from workers.main import WorkerApp, start_worker
from workers.store_node import StoreNodeProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
NS = "storemesh"
BLOCK = 32


@dataclass
class StoreMesh:
    master: StoreMasterApp
    node: StoreNodeProcess
    worker: WorkerApp
    indexer: IndexerApp
    router: RouterApp
    frontend: FrontendApp


@pytest.fixture(scope="module")
async def smesh(etcd: Child, redis_server: Child, tiny_model: str) -> AsyncIterator[StoreMesh]:
    args = [*base_args(etcd.address, NS), "--redis-url", f"redis://{redis_server.address}"]
    master = await start_store_master(load_config(StoreMasterConfig, [
        *base_args(etcd.address, NS), "--persist", "none"], {}))
    node = await asyncio.to_thread(StoreNodeProcess, master.server.address, 32)
    worker = await start_worker(load_config(WorkerConfig, [
        *args, "--model-path", tiny_model, "--model-name", "tiny", "--kv-cache-gib", "0.05",
        "--max-model-len", "512", "--store-master", master.server.address], {}))
    indexer = await start_indexer(load_config(IndexerConfig, [*args, "--group", "ix-st"], {}))
    router = await start_router(load_config(RouterConfig, [
        *args, "--policy", "kv", "--indexer", "remote"], {}))
    frontend = await start_frontend(load_config(FrontendConfig, [
        *args, "--http-port", "0", "--router-address", router.server.address], {}))
    try:
        await wait_routable(router, 1, "the worker")
        yield StoreMesh(master, node, worker, indexer, router, frontend)
    finally:
        await frontend.server.stop()
        await router.server.stop()
        await indexer.server.stop()
        await worker.stop()
        node.stop()
        await master.server.stop()


async def complete(url: str, ids: list[int]) -> dict:  # type: ignore[type-arg]
    async with httpx.AsyncClient(timeout=120) as client:
        resp = await client.post(f"{url}/v1/completions", json={
            "model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


async def test_evicted_prefix_comes_back_from_the_store(smesh: StoreMesh) -> None:
    head = prompt(77, 5 * BLOCK)
    first = await complete(smesh.frontend.base_url, [*head, 9, 8, 7])
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    async with grpc.aio.insecure_channel(smesh.indexer.server.address) as ch:
        stub = indexer_pb2_grpc.IndexerStub(ch)

        last: indexer_pb2.FindMatchesResponse | None = None

        async def in_store_tier() -> indexer_pb2.FindMatchesResponse | None:
            nonlocal last
            last = await stub.FindMatches(indexer_pb2.FindMatchesRequest(
                token_ids=head, block_size=BLOCK))
            return last if any(o.by_tier.get("store", 0) == 5 for o in last.overlaps) else None

        # saved blocks are announced with tier "store"
        await wait_for(in_store_tier, 10,
                       lambda: "the 5 saved blocks in the index with tier 'store'; last "
                               f"response: {last}",
                       interval_s=0.1)
    assert await smesh.worker.engine.reset_prefix_cache()  # the engine forgets the prefix
    again = await complete(smesh.frontend.base_url, [*head, 9, 8, 7])
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 5 * BLOCK
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    counters = smesh.worker.engine.counters()
    assert counters["kv_external_loaded_tokens"] >= 5 * BLOCK


async def test_json_schema_logprobs_from_the_store_match_aggregated(
        smesh: StoreMesh, mesh: Mesh, tiny_model: str) -> None:
    """openai_pd_support's JSON-schema case (logprobs, top_logprobs, whitespace banned):
    computed, then with its prompt's full blocks loaded from the store (the engine's prefix
    cache reset), both equal to the session mesh's (cold) answer; usage exact."""
    case, tok, salt = CASES["json_schema_logprobs"], Tokenizer(tiny_model), "store-json"
    ref = await case.run(client(mesh.url), salt, tok)
    first = await case.run(client(smesh.frontend.base_url), salt, tok)
    assert_same(first, ref, "computed")
    ids = tok.apply_chat([("user", JSON_QUESTION)])
    hit = (len(ids) - 1) // BLOCK * BLOCK
    assert ref.usage[0] == len(ids) and hit > 0
    body = {"model": "tiny", "messages": [{"role": "user", "content": JSON_QUESTION}],
            "cache_salt": salt}
    mesh_salt = with_tenant(parse_chat(body), "").cache_salt  # the open tenant's
    async with grpc.aio.insecure_channel(smesh.indexer.server.address) as ch:
        stub = indexer_pb2_grpc.IndexerStub(ch)
        last: list[indexer_pb2.FindMatchesResponse] = []

        async def saved() -> bool:
            last[:] = [await stub.FindMatches(indexer_pb2.FindMatchesRequest(
                token_ids=ids, block_size=BLOCK, cache_salt=mesh_salt))]
            return any(o.by_tier.get("store", 0) >= hit // BLOCK for o in last[0].overlaps)

        await wait_for(saved, 10, lambda: f"the prompt's {hit // BLOCK} blocks in the index "
                                          f"with tier 'store'; last response: {last}",
                       interval_s=0.1)
    loaded = smesh.worker.engine.counters()["kv_external_loaded_tokens"]
    assert await smesh.worker.engine.reset_prefix_cache()
    again = await case.run(client(smesh.frontend.base_url), salt, tok)
    assert_same(again.answer, ref.answer, "from the store")
    assert again.usage == (*ref.usage[:2], hit)
    assert smesh.worker.engine.counters()["kv_external_loaded_tokens"] - loaded == hit
