"""Keeps a :class:`~services.indexer.core.KvIndex` in step with the KV event stream.

Used by the indexer service and by a router with an embedded index (same stream, same
core). Contract of :class:`IndexFeed`:

- ``start()``: connects Redis and etcd, creates the consumer group (``MKSTREAM``) if
  needed and rewinds it to the stream's start, so the index is rebuilt from the stream
  after every (re)start; returns once that replay is applied (``ready``), then keeps
  consuming new entries (``XREADGROUP`` ``>``, acknowledged after they are applied).
- Batches are applied event by event. A :class:`~services.indexer.core.Gap` (an event id
  skipped) makes the feed ask the worker for its full state (``Worker.GetKvState``, the
  address comes from etcd) and resync that worker; the events of the batch that follow
  are then applied or ignored as already covered. Until a resync succeeds, a worker's
  later events keep reporting the gap (retried at most every ``retry_s`` of the injected
  ``clock``, monotonic seconds).
- A full-state entry a worker published itself replaces that worker's state unless the
  index is already past it.
- Workers whose etcd lease goes are removed from the index (also those found only in the
  replayed stream once the first etcd snapshot shows them gone).
- Malformed entries are counted and skipped; the feed never stops on bad input. A failed
  stream read (Redis hiccup) is logged and the reads restart ``retry_s`` later.
- ``stats`` (see :class:`FeedStats`), ``close()`` stops everything. Idempotent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from protos import discovery_pb2, kv_events_pb2, worker_pb2_grpc
from services.common.discovery import InstanceWatcher
from services.common.event_bus import BadEntry, decode_entry, stream_name
from services.common.grpc_client import ChannelPool
from services.common.injected import Clock
from services.common.periodic import Periodic
from services.indexer.core import Gap, KvEvent, KvIndex

log = logging.getLogger(__name__)

KIND_NAMES = {
    kv_events_pb2.KV_EVENT_KIND_STORED: "stored",
    kv_events_pb2.KV_EVENT_KIND_REMOVED: "removed",
    kv_events_pb2.KV_EVENT_KIND_CLEARED: "cleared",
}


@dataclass
class FeedStats:
    """Cumulative counters of a feed."""

    entries: int = 0
    events_applied: int = 0
    gaps: int = 0
    resyncs: int = 0
    resync_failures: int = 0
    workers_removed: int = 0
    bad_entries: int = 0


def state_blocks(state: kv_events_pb2.KvState) -> dict[str, Iterable[int]]:
    """tier → hashes of a KvState message."""
    return {t.tier: list(t.block_hashes) for t in state.tiers}


class IndexFeed:
    """See the module docstring."""

    def __init__(self, index: KvIndex, redis_url: str, etcd_endpoint: str, namespace: str,
                 group: str, consumer: str = "c0", *, clock: Clock,
                 batch: int = 512, block_ms: int = 500, retry_s: float = 1.0) -> None:
        self.index = index
        self.stream = stream_name(namespace)
        self.group = group
        self.consumer = consumer
        self.stats = FeedStats()
        self.ready = asyncio.Event()
        self._redis_url = redis_url
        self._batch = batch
        self._block_ms = block_ms
        self._retry_s = retry_s
        self._watcher = InstanceWatcher(etcd_endpoint, namespace, "worker")
        self._records: dict[str, discovery_pb2.InstanceRecord] = {}
        self._seen_alive: set[str] = set()
        self._pool = ChannelPool()
        self._last_try: dict[str, float] = {}
        self._redis: aioredis.Redis | None = None
        self._clock = clock
        # _follow reads until an error; the Periodic logs it and restarts after retry_s
        # (max_backoff_s = retry_s: a fixed retry delay, as before).
        self._follower = Periodic(f"index-feed-{group}", self._follow, retry_s,
                                  max_backoff_s=retry_s)

    async def start(self) -> None:
        """Replays the stream into the index, then follows it (see the contract)."""
        self._redis = aioredis.Redis.from_url(self._redis_url)
        try:
            await self._redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
            await self._redis.xgroup_setid(self.stream, self.group, id="0")
        self._watcher.on_change(self._on_workers)
        await self._watcher.start()
        while await self._read_once(block_ms=None):
            pass
        self._drop_dead_after_replay()
        self.ready.set()
        self._follower.start()

    def _on_workers(self, records: Mapping[str, discovery_pb2.InstanceRecord]) -> None:
        """An etcd snapshot: workers seen alive before and now gone lose their blocks."""
        self._records = dict(records)
        gone = self._seen_alive - set(records)
        self._seen_alive = set(records)
        for w in sorted(gone):
            self._drop(w)

    def _drop_dead_after_replay(self) -> None:
        alive = set(self._watcher.instances())
        for w in sorted(self.index.workers() - alive):
            self._drop(w)

    def _drop(self, worker: str) -> None:
        self.index.remove_worker(worker)
        self.stats.workers_removed += 1

    async def _follow(self) -> None:
        """Reads and applies new entries back to back; returns only by raising (a Redis
        hiccup), after which the Periodic retries in ``retry_s``."""
        while True:
            await self._read_once(block_ms=self._block_ms)
            self._follower.note_progress()

    async def _read_once(self, block_ms: int | None) -> int:
        """Reads and applies one chunk; returns the number of entries."""
        assert self._redis is not None
        resp: Any = await self._redis.xreadgroup(self.group, self.consumer, {self.stream: ">"},
                                            count=self._batch, block=block_ms)
        n = 0
        ids = []
        for _stream, entries in resp or ():
            for entry_id, fields in entries:
                ids.append(entry_id)
                n += 1
                await self._apply(fields)
        if ids:
            await self._redis.xack(self.stream, self.group, *ids)
        return n

    async def _apply(self, fields: Mapping[bytes, bytes]) -> None:
        self.stats.entries += 1
        try:
            msg = decode_entry(fields)
        except BadEntry as exc:
            self.stats.bad_entries += 1
            log.warning("skipping KV event entry: %s", exc)
            return
        if isinstance(msg, kv_events_pb2.KvState):
            if msg.event_id >= self.index.next_event_id(msg.worker_id) - 1:
                self.index.resync(msg.worker_id, msg.event_id, state_blocks(msg))
                self.stats.resyncs += 1
            return
        for ev in msg.events:
            kind = KIND_NAMES.get(ev.kind)
            if kind is None:
                self.stats.bad_entries += 1
                continue
            event = KvEvent(msg.worker_id, ev.event_id, kind, tuple(ev.block_hashes),
                            ev.tier or "device")
            try:
                gap = self.index.apply(event)
            except ValueError:
                self.stats.bad_entries += 1
                continue
            if gap is not None:
                self.stats.gaps += 1
                if not await self._resync(gap):
                    continue
                gap = self.index.apply(event)
                if gap is not None:
                    continue
            self.stats.events_applied += 1

    async def _resync(self, gap: Gap) -> bool:
        """Replaces the worker's state by its own full dump; False when unavailable."""
        now = self._clock()
        if now - self._last_try.get(gap.worker_id, -1e9) < self._retry_s:
            return False
        self._last_try[gap.worker_id] = now
        rec = self._records.get(gap.worker_id)
        if rec is None:
            self.stats.resync_failures += 1
            return False
        stub = worker_pb2_grpc.WorkerStub(self._pool.get(rec.address))
        try:
            state = await stub.GetKvState(kv_events_pb2.KvStateRequest(), timeout=5)
        except grpc.RpcError as exc:
            self.stats.resync_failures += 1
            log.warning("resync of %s failed: %s", gap.worker_id, exc)
            return False
        log.info("%s: events %d..%d missing; resynced at event %d", gap.worker_id,
                 gap.expected, gap.got - 1, state.event_id)
        self.index.resync(gap.worker_id, state.event_id, state_blocks(state))
        self._last_try.pop(gap.worker_id, None)
        self.stats.resyncs += 1
        return True

    async def close(self) -> None:
        """Stops following the stream and closes connections."""
        await self._follower.stop()
        await self._watcher.close()
        await self._pool.close()
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None
