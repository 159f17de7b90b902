"""The Indexer gRPC servicer: protobuf in, :class:`KvIndex` calls, protobuf out.

Contract:

- ``FindMatches``: exactly one of ``token_ids`` (hashed with ``block_size`` > 0, kvmesh's
  chained hashes, salted with ``cache_salt``: a tenant's query never matches another
  tenant's blocks) or ``block_hashes``; INVALID_ARGUMENT otherwise, and for more than
  :data:`MAX_QUERY_TOKENS` token ids (ids must be >= 0), a ``block_size`` over
  :data:`MAX_BLOCK_SIZE` or more than :data:`MAX_QUERY_BLOCKS` hashes (a million tokens
  is far beyond any model's context; the limits only bound the work one query costs).
  Returns the overlap of every worker holding the query's first block, sorted by worker
  id.
- ``Dump``: the exact state (all workers, or one), with the last applied event id; a
  ``worker_id`` no worker has answers no workers.
- ``Stats``: index sizes plus the feed's counters (entries dropped for their signature
  and malformed ones included: a forged event shows there, never in the index).
"""

from __future__ import annotations

import grpc

from protos import indexer_pb2, indexer_pb2_grpc, kv_events_pb2
from services.common.block_hash import block_hashes
from services.indexer.core import KvIndex
from services.indexer.feed import FeedStats

MAX_QUERY_TOKENS = 1 << 20
MAX_QUERY_BLOCKS = 1 << 16
MAX_BLOCK_SIZE = 1 << 16


def query_problem(request: indexer_pb2.FindMatchesRequest) -> str | None:
    """Why a FindMatches request is refused (naming the field), or None."""
    if bool(request.token_ids) == bool(request.block_hashes):
        return "give exactly one of token_ids or block_hashes"
    if request.block_hashes:
        if request.cache_salt:
            return ("cache_salt applies to token_ids only: block_hashes are hashed already "
                    "(start them from the salt with services.common.block_hash)")
        if len(request.block_hashes) > MAX_QUERY_BLOCKS:
            return (f"block_hashes: at most {MAX_QUERY_BLOCKS} hashes, "
                    f"got {len(request.block_hashes)}")
        return None
    if not 0 < request.block_size <= MAX_BLOCK_SIZE:
        return f"token_ids need a block_size in 1..{MAX_BLOCK_SIZE}, got {request.block_size}"
    if len(request.token_ids) > MAX_QUERY_TOKENS:
        return f"token_ids: at most {MAX_QUERY_TOKENS} ids, got {len(request.token_ids)}"
    if min(request.token_ids) < 0:
        i = next(i for i, t in enumerate(request.token_ids) if t < 0)
        return f"token_ids[{i}] must be >= 0, got {request.token_ids[i]}"
    return None


class IndexerServicer(indexer_pb2_grpc.IndexerServicer):
    """Serves queries on one KvIndex."""

    def __init__(self, index: KvIndex, stats: FeedStats) -> None:
        self._index = index
        self._stats = stats

    async def FindMatches(  # noqa: N802
        self, request: indexer_pb2.FindMatchesRequest, context: grpc.aio.ServicerContext
    ) -> indexer_pb2.FindMatchesResponse:
        problem = query_problem(request)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if request.token_ids:
            hashes = block_hashes(request.token_ids, request.block_size,
                                  salt=request.cache_salt)
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
            workers_removed=s.workers_removed, stream_entries=s.entries,
            unsigned_entries=s.unsigned_entries, forged_entries=s.forged_entries,
            bad_entries=s.bad_entries)
