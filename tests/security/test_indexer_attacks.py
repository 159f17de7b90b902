"""Inferring another user's prompt from the index: ``Indexer.FindMatches`` by a caller that
is not a router (the only role that routes; frontends included), and ``Indexer.Dump``
(every worker's blocks) by anyone but an admin, are refused; the index is unchanged."""

from __future__ import annotations

from protos import indexer_pb2, indexer_pb2_grpc
from tests.security.conftest import BLOCK, SecureMesh, attack, roles_except

GUESS = list(range(500, 500 + 4 * BLOCK))


async def test_find_matches_by_a_non_router_role_is_refused(secure: SecureMesh,
                                                            who: str) -> None:
    before = await secure.settled()
    request = indexer_pb2.FindMatchesRequest(token_ids=GUESS, block_size=BLOCK)
    await attack(secure, who, secure.address("indexer"), "/kvmesh.indexer.Indexer/FindMatches",
                 lambda ch: indexer_pb2_grpc.IndexerStub(ch).FindMatches(request, timeout=5),
                 allowed="router", wrong_roles=roles_except("router"))
    assert await secure.snapshot() == before


async def test_dump_by_a_non_admin_is_refused(secure: SecureMesh, who: str) -> None:
    before = await secure.settled()
    await attack(secure, who, secure.address("indexer"), "/kvmesh.indexer.Indexer/Dump",
                 lambda ch: indexer_pb2_grpc.IndexerStub(ch).Dump(indexer_pb2.DumpRequest(),
                                                                  timeout=5),
                 allowed="admin", wrong_roles=roles_except("admin"))
    assert await secure.snapshot() == before
