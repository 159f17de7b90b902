"""Store master metadata in Redis, so it survives a master restart.

Layout: two hashes per namespace, ``kvmesh:<ns>:store:segments`` (segment id → record)
and ``kvmesh:<ns>:store:objects`` (key → record); records are the JSON of
``core/records.py``. Each hash field is the latest state of one segment or object (not a
journal of operations), so the hashes never grow beyond the live metadata.

Contract:

- :class:`RedisMetadata`: ``load()`` → (segment records, object records); ``write(changes)``
  applies one :class:`Changes` (HSET written records, HDEL deleted ones) in a single
  MULTI/EXEC transaction; ``clear()`` deletes both hashes; ``close()``.
- :class:`Persister`: ``flush()`` drains the master's changes and writes them. It is
  write-through when called after every mutating RPC (the service does): when the reply
  leaves, its metadata is in Redis. Flushes are serialised; a failed write keeps its
  changes pending (later changes fold in, the newest record wins) and the next flush
  retries them, so Redis converges once it is back. Counts written records and failures.
  With no ``RedisMetadata`` it only drains (persistence off).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.store_master.core import Changes, StoreMaster, decode, encode
from services.store_master.core.records import Record

log = logging.getLogger(__name__)


def hash_names(namespace: str) -> tuple[str, str]:
    """(segments hash, objects hash) of a namespace."""
    return f"kvmesh:{namespace}:store:segments", f"kvmesh:{namespace}:store:objects"


class RedisMetadata:
    """The two Redis hashes holding a namespace's store metadata."""

    def __init__(self, redis_url: str, namespace: str) -> None:
        self._redis: aioredis.Redis = aioredis.Redis.from_url(redis_url)
        self.segments_key, self.objects_key = hash_names(namespace)

    async def load(self) -> tuple[list[Record], list[Record]]:
        segs: dict[Any, Any] = await self._redis.hgetall(self.segments_key)
        objs: dict[Any, Any] = await self._redis.hgetall(self.objects_key)
        return _decode_all(segs.values()), _decode_all(objs.values())

    async def write(self, changes: Changes) -> int:
        pipe = self._redis.pipeline(transaction=True)
        for name, updates in ((self.segments_key, changes.segments),
                              (self.objects_key, changes.objects)):
            put: dict[Any, Any] = {k: encode(r) for k, r in updates.items() if r is not None}
            gone = [k for k, r in updates.items() if r is None]
            if put:
                pipe.hset(name, mapping=put)
            if gone:
                pipe.hdel(name, *gone)
        await pipe.execute()
        return len(changes.segments) + len(changes.objects)

    async def clear(self) -> None:
        await self._redis.delete(self.segments_key, self.objects_key)

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
        self.records_written = 0
        self.failures = 0

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
                self.failures += 1
                log.warning("store metadata not persisted (will retry): %s", exc)
                return False
            self._pending = Changes()
            return True
