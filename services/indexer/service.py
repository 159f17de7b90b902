"""The Indexer gRPC servicer: protobuf in, :class:`KvIndex` calls, protobuf out.

Contract:

- ``FindMatches``: exactly one of ``token_ids`` (hashed with ``block_size`` > 0, kvmesh's
  chained hashes) or ``block_hashes``; INVALID_ARGUMENT otherwise. Returns the overlap of
  every worker holding the query's first block, sorted by worker id.
- ``Dump``: the exact state (all workers, or one), with the last applied event id.
- ``Stats``: index sizes plus the feed's counters.
"""

from __future__ import annotations

import grpc

from protos import indexer_pb2, indexer_pb2_grpc, kv_events_pb2
from services.common.block_hash import block_hashes
from services.indexer.core import KvIndex
from services.indexer.feed import FeedStats


class IndexerServicer(indexer_pb2_grpc.IndexerServicer):
    """Serves queries on one KvIndex."""

    def __init__(self, index: KvIndex, stats: FeedStats) -> None:
        self._index = index
        self._stats = stats

    async def FindMatches(  # noqa: N802
        self, request: indexer_pb2.FindMatchesRequest, context: grpc.aio.ServicerContext
    ) -> indexer_pb2.FindMatchesResponse:
        if bool(request.token_ids) == bool(request.block_hashes):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "give exactly one of token_ids or block_hashes")
        if request.token_ids:
            if request.block_size <= 0:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "token_ids need a positive block_size")
            hashes = block_hashes(request.token_ids, request.block_size)
        else:
            hashes = list(request.block_hashes)
        matches = self._index.find_matches(hashes)
        return indexer_pb2.FindMatchesResponse(
            query_blocks=len(hashes),
            overlaps=[indexer_pb2.WorkerOverlap(worker_id=w, blocks=o.blocks,
                                                by_tier=dict(o.by_tier))
                      for w, o in sorted(matches.items())])

    async def Dump(  # noqa: N802
        self, request: indexer_pb2.DumpRequest, context: grpc.aio.ServicerContext
    ) -> indexer_pb2.DumpResponse:
        out = []
        for worker, tiers in sorted(self._index.dump().items()):
            if request.worker_id and worker != request.worker_id:
                continue
            out.append(kv_events_pb2.KvState(
                worker_id=worker, event_id=self._index.next_event_id(worker) - 1,
                tiers=[kv_events_pb2.TierBlocks(tier=t, block_hashes=sorted(hs))
                       for t, hs in sorted(tiers.items())]))
        return indexer_pb2.DumpResponse(workers=out)

    async def Stats(  # noqa: N802
        self, request: indexer_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> indexer_pb2.StatsResponse:
        sizes = self._index.stats()
        s = self._stats
        return indexer_pb2.StatsResponse(
            blocks=sizes["blocks"], workers=sizes["workers"], entries=sizes["entries"],
            events_applied=s.events_applied, gaps=s.gaps, resyncs=s.resyncs,
            workers_removed=s.workers_removed, stream_entries=s.entries)
