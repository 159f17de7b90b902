"""Store master metadata in Redis, so it survives a master restart.

Layout: two hashes per namespace, ``kvmesh:<ns>:store:segments`` (segment id → record)
and ``kvmesh:<ns>:store:objects`` (key → record); records are the JSON of
``core/records.py``. Each hash field is the latest state of one segment or object (not a
journal of operations), so the hashes never grow beyond the live metadata. A sentinel key
``kvmesh:<ns>:store:sentinel`` says the hashes were written by a master in this Redis
dataset.

Contract:

- :class:`RedisMetadata` (url, namespace, tls): the client comes from
  :func:`services.common.redis_conn.redis_client`; with mesh TLS material and a
  ``rediss://`` URL it logs in as the ACL user ``store_master``, which owns
  ``kvmesh:<ns>:store:*`` and nothing else (:mod:`services.common.redis_acl`).
  ``load()`` → (segment records, object records); ``write(changes)``
  applies one :class:`Changes` (HSET written records, HDEL deleted ones) in a single
  MULTI/EXEC transaction; ``rewrite(snapshot)`` replaces both hashes by a whole
  snapshot and sets the sentinel, in one transaction; ``epoch()`` → (the server's
  ``run_id``, whether the sentinel is there); ``clear()`` deletes both hashes and the
  sentinel; ``close()``.
- :class:`Persister`: ``flush()`` drains the master's changes and writes them. It is
  write-through when called after every mutating RPC (the service does): when the reply
  leaves, its metadata is in Redis. Flushes are serialised; a failed write keeps its
  changes pending (later changes fold in, the newest record wins) and the next flush
  retries them, so Redis converges once it is back. Counts written records and failures
  (``records_written``, ``failures``); the first failure of an outage logs one line, later
  ones only when their number in a row is a power of two, the recovery one line.
  With no ``RedisMetadata`` it only drains (persistence off).
- Redis restarts: ``mark()`` (at start, after the restore) notes the server's ``run_id``
  and sets the sentinel. ``check()`` (every tick) compares them: a new ``run_id`` (Redis
  restarted: its data wiped, or kept by AOF less what it had not fsynced) or a missing
  sentinel (the data was flushed or deleted) makes it rewrite the master's WHOLE metadata
  (:meth:`StoreMaster.snapshot`, so every complete object a later master restart must
  restore), log one line with the cause and count it in ``rewrites``. A failed check or
  rewrite counts as a failure and is tried again on the next check.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.common.redis_conn import redis_client
from services.common.tls import MeshTls
from services.store_master.core import Changes, StoreMaster, decode, encode
from services.store_master.core.records import Record

log = logging.getLogger(__name__)


def hash_names(namespace: str) -> tuple[str, str]:
    """(segments hash, objects hash) of a namespace."""
    return f"kvmesh:{namespace}:store:segments", f"kvmesh:{namespace}:store:objects"


def _puts(updates: dict[str, Record | None]) -> dict[Any, Any]:
    return {k: encode(r) for k, r in updates.items() if r is not None}


class RedisMetadata:
    """The two Redis hashes holding a namespace's store metadata."""

    def __init__(self, redis_url: str, namespace: str, tls: MeshTls | None = None) -> None:
        self._redis: aioredis.Redis = redis_client(redis_url, tls, "store_master")
        self.segments_key, self.objects_key = hash_names(namespace)
        self.sentinel_key = f"kvmesh:{namespace}:store:sentinel"

    async def load(self) -> tuple[list[Record], list[Record]]:
        segs: dict[Any, Any] = await self._redis.hgetall(self.segments_key)
        objs: dict[Any, Any] = await self._redis.hgetall(self.objects_key)
        return _decode_all(segs.values()), _decode_all(objs.values())

    async def write(self, changes: Changes) -> int:
        pipe = self._redis.pipeline(transaction=True)
        for name, updates in ((self.segments_key, changes.segments),
                              (self.objects_key, changes.objects)):
            put = _puts(updates)
            gone = [k for k, r in updates.items() if r is None]
            if put:
                pipe.hset(name, mapping=put)
            if gone:
                pipe.hdel(name, *gone)
        await pipe.execute()
        return len(changes.segments) + len(changes.objects)

    async def rewrite(self, snapshot: Changes) -> int:
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(self.segments_key, self.objects_key)
        for name, records in ((self.segments_key, snapshot.segments),
                              (self.objects_key, snapshot.objects)):
            put = _puts(records)
            if put:
                pipe.hset(name, mapping=put)
        pipe.set(self.sentinel_key, b"1")
        await pipe.execute()
        return len(snapshot.segments) + len(snapshot.objects)

    async def epoch(self) -> tuple[str, bool]:
        pipe = self._redis.pipeline(transaction=False)
        pipe.info("server")
        pipe.exists(self.sentinel_key)
        info, present = await pipe.execute()
        return str(info.get("run_id", "")), bool(present)

    async def mark(self) -> str:
        """Sets the sentinel; returns the server's run_id."""
        await self._redis.set(self.sentinel_key, b"1")
        return (await self.epoch())[0]

    async def clear(self) -> None:
        await self._redis.delete(self.segments_key, self.objects_key, self.sentinel_key)

    async def close(self) -> None:
        await self._redis.aclose()


def _decode_all(raws: Iterable[Any]) -> list[Record]:
    out = []
    for raw in raws:
        try:
            out.append(decode(raw))
        except ValueError:
            log.warning("skipping an undecodable store metadata record")
    return out


class Persister:
    """Write-through of a master's changes to a :class:`RedisMetadata` (or nowhere)."""

    def __init__(self, master: StoreMaster, store: RedisMetadata | None) -> None:
        self._master = master
        self._store = store
        self._lock = asyncio.Lock()
        self._pending = Changes()
        self._run_id = ""
        self._failing = 0  # failures in a row
        self.records_written = 0
        self.failures = 0
        self.rewrites = 0

    @property
    def enabled(self) -> bool:
        return self._store is not None

    async def flush(self) -> bool:
        """Writes every change so far; False when the write failed (kept for retry)."""
        async with self._lock:
            self._pending.merge(self._master.drain_changes())
            if self._store is None or not self._pending:
                self._pending = Changes()
                return True
            batch = self._pending
            try:
                self.records_written += await self._store.write(batch)
            except (RedisError, OSError) as exc:
                self._failed("store metadata not persisted (will retry)", exc)
                return False
            self._pending = Changes()
            self._recovered()
            return True

    async def mark(self) -> None:
        """Notes the Redis server now holding the metadata (see the module docstring); when
        that fails, the next ``check()`` rewrites everything."""
        if self._store is None:
            return
        try:
            self._run_id = await self._store.mark()
        except (RedisError, OSError) as exc:
            self._failed("store metadata sentinel not set (will rewrite)", exc)

    async def check(self) -> bool:
        """Rewrites the whole metadata when Redis restarted or lost it; True when it did."""
        if self._store is None:
            return False
        async with self._lock:
            try:
                run_id, marked = await self._store.epoch()
                if run_id == self._run_id and marked:
                    return False
                self._pending.merge(self._master.drain_changes())  # in the snapshot too
                snapshot = self._master.snapshot()
                self.records_written += await self._store.rewrite(snapshot)
            except (RedisError, OSError) as exc:
                self._failed("store metadata check/rewrite failed (will retry)", exc)
                return False
            why = (f"Redis restarted (run_id {self._run_id} -> {run_id})"
                   if run_id != self._run_id else "the store metadata vanished from Redis")
            log.warning("%s: rewrote the whole store metadata (%d segments, %d objects)",
                        why, len(snapshot.segments), len(snapshot.objects))
            self._run_id = run_id
            self._pending = Changes()
            self.rewrites += 1
            self._recovered()
            return True

    def _failed(self, what: str, exc: Exception) -> None:
        self.failures += 1
        self._failing += 1
        n = self._failing
        if n == 1:
            log.warning("%s: %r", what, exc)
        elif n & (n - 1) == 0:
            log.warning("%s (%d failures in a row): %r", what, n, exc)

    def _recovered(self) -> None:
        if self._failing:
            log.info("store metadata persisted again after %d failures", self._failing)
            self._failing = 0
