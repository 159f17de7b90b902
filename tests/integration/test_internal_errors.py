"""An exception a servicer lets escape is answered INTERNAL naming it (never gRPC's
UNKNOWN), logged with its traceback, and the server keeps serving."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from protos import indexer_pb2, indexer_pb2_grpc
from services.common.server import MalformedRequestInterceptor
from services.indexer.core import KvIndex
from services.indexer.feed import FeedStats
from services.indexer.service import IndexerServicer


class BrokenIndex(KvIndex):
    """A real index whose lookups hit a bug."""

    def find_matches(self, *args: object, **kwargs: object) -> dict:  # type: ignore[override]
        raise RuntimeError("index bug")


@pytest.fixture
async def address() -> AsyncIterator[str]:
    server = grpc.aio.server(interceptors=[MalformedRequestInterceptor()])
    indexer_pb2_grpc.add_IndexerServicer_to_server(
        IndexerServicer(BrokenIndex(), FeedStats()), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def test_an_escaped_exception_is_internal_and_the_server_stays_up(
        address: str, caplog: pytest.LogCaptureFixture) -> None:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = indexer_pb2_grpc.IndexerStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.FindMatches(indexer_pb2.FindMatchesRequest(block_hashes=[1, 2]))
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "FindMatches failed: RuntimeError: index bug" in (err.value.details() or "")
        # The refusals of the servicer itself keep their codes; the server still serves.
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.FindMatches(indexer_pb2.FindMatchesRequest(token_ids=[-1],
                                                                  block_size=16))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert not (await stub.Dump(indexer_pb2.DumpRequest())).workers
    assert any("FindMatches failed" in r.getMessage() and r.exc_info for r in caplog.records)
