"""Inferring another tenant's prompt from the prefix cache, over plain HTTP: alice sends a
long prompt twice (her repeat reports ``cached_tokens`` > 0: the mock workers report prefix
hits as vLLM does); bob sends the very same prompt and gets ``cached_tokens`` 0; alice's
next repeat still hits. The mesh's own signals agree: the index (FindMatches, with the
router's certificate) and the router's prediction (Route with the frontend's, released)
find alice's blocks under alice's salt only, none under bob's or without a salt."""

from __future__ import annotations

import httpx

from protos import indexer_pb2, indexer_pb2_grpc, router_pb2, router_pb2_grpc
from services.common.grpc_client import channel
from services.frontend.auth import tenant_salt
from tests.security.conftest import ALICE, BLOCK, BOB, MODEL, TIMEOUT_S, SecureMesh
from tests.waiting import wait_for

FULL = 8
PROMPT = list(range(9000, 9000 + FULL * BLOCK + 5))  # 8 full blocks and a tail


async def cached_tokens(mesh: SecureMesh, headers: dict[str, str]) -> int:
    """One greedy completion of :data:`PROMPT`; its ``cached_tokens``."""
    async with httpx.AsyncClient(base_url=mesh.url, timeout=60) as client:
        resp = await client.post("/v1/completions", headers=headers, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def indexed(mesh: SecureMesh, salt: str) -> int:
    """The most leading blocks of :data:`PROMPT` one worker holds under ``salt``."""
    async with channel(mesh.address("indexer"), mesh.tls("router")) as ch:
        resp = await indexer_pb2_grpc.IndexerStub(ch).FindMatches(
            indexer_pb2.FindMatchesRequest(token_ids=PROMPT, block_size=BLOCK,
                                           cache_salt=salt), timeout=TIMEOUT_S)
    return max((o.blocks for o in resp.overlaps), default=0)


async def predicted(mesh: SecureMesh, salt: str, rid: str) -> int:
    """The router's predicted overlap of :data:`PROMPT` under ``salt`` (released)."""
    async with channel(mesh.address("router"), mesh.tls("frontend")) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        resp = await stub.Route(router_pb2.RouteRequest(
            request_id=rid, model=MODEL, token_ids=PROMPT, max_tokens=2, cache_salt=salt),
            timeout=TIMEOUT_S)
        await stub.Release(router_pb2.ReleaseRequest(request_id=rid), timeout=TIMEOUT_S)
    return resp.predicted_overlap_blocks


async def test_another_tenants_guess_of_a_prompt_never_hits(secure: SecureMesh) -> None:
    alice, bob = tenant_salt("alice"), tenant_salt("bob")
    await secure.settled()
    assert await cached_tokens(secure, ALICE) == 0
    await wait_for(lambda: indexed(secure, alice), 10, "alice's blocks in the index")
    assert await indexed(secure, alice) == FULL
    assert await cached_tokens(secure, ALICE) == FULL * BLOCK  # her own repeat hits
    # nothing of hers is found under bob's salt or none, by the index or the router
    assert await indexed(secure, bob) == 0
    assert await indexed(secure, "") == 0
    assert await predicted(secure, alice, "tenant-probe-a") == FULL
    assert await predicted(secure, bob, "tenant-probe-b") == 0
    # bob's guess: the same prompt, not a single cached token
    assert await cached_tokens(secure, BOB) == 0
    # and alice still hits, her blocks untouched by bob's request
    assert await cached_tokens(secure, ALICE) == FULL * BLOCK
