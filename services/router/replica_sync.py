"""Router replica sync over Redis Streams: each router replica's in-flight load, per
worker, shared with the others (``--replica-sync``; Dynamo's ``--router-replica-sync``).

Several routers that route to the same workers (``kvmesh up --frontends N --router
embedded``: one router inside each frontend replica) each see only their own in-flight
requests. With sync on, each publishes a snapshot of its own per-worker shares
(:meth:`RouterCore.local_shares`, a ``router_pb2.ReplicaLoad``) and applies the others'
(:meth:`RouterCore.set_peer`), so its policies count the whole fleet's in-flight load.
Snapshots, not deltas: a lost or reordered message costs nothing once the next arrives,
a Redis outage heals by itself, and a replica that died stops counting after
``peer_timeout_s``.

Contract of :class:`ReplicaSync`:

- The stream is :func:`~services.common.redis_acl.sync_stream`
  (``kvmesh:<namespace>:router-sync``; the ``router`` Redis user may XADD and XREAD it), trimmed to
  about :data:`STREAM_MAXLEN` entries. Each entry has ``r`` (the replica id) and ``d``
  (a serialized ``ReplicaLoad``).
- Publishing: after a change of the core's own in-flight state (the core's
  ``on_change``, wired by :meth:`start`), a snapshot goes out at most ``interval_s``
  later; changes within one interval share one snapshot. With no change, one goes out
  every ``heartbeat_s`` (default a third of ``peer_timeout_s``). ``seq`` increases with
  each.
- Reading: from the entries of the last ``peer_timeout_s`` before :meth:`start` (by the
  Redis server's clock: a replica that joins hears the live peers' latest snapshots at
  once instead of at their next heartbeat; a dead peer's last one expires as any), then
  as they come (``XREAD BLOCK``), and after a read failure from the entries added after
  it (the next heartbeats fill the gap); the
  replica's own entries are skipped; a ``leaving`` snapshot drops its replica at once; an entry
  that does not parse is skipped and counted (``stats.bad_entries``, logged).
- Expiry: every ``peer_timeout_s / 4``, peers not heard from for more than
  ``peer_timeout_s`` are dropped (logged).
- Failures are never silent: a Redis error in the publisher or the reader is counted in
  ``stats.publish_failures`` / ``stats.read_failures`` and logged (bounded, by
  :class:`~services.common.periodic.Periodic`), which retries with backoff, and reported
  to ``on_failure("publish" | "read")`` (the router's metrics); routing goes on
  meanwhile with what is known (peers then expire).
- :meth:`close` stops the tasks, then publishes one ``leaving`` snapshot (best effort,
  within 1 s). Idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from google.protobuf.message import DecodeError
from redis.exceptions import RedisError

from protos import router_pb2
from services.common.periodic import Periodic
from services.common.redis_acl import sync_stream
from services.common.redis_conn import redis_client
from services.common.tls import MeshTls
from services.router.core import RouterCore
from services.router.peers import Share

log = logging.getLogger(__name__)

STREAM_MAXLEN = 1000
DEFAULT_INTERVAL_S = 0.01
DEFAULT_PEER_TIMEOUT_S = 3.0


def new_replica_id(prefix: str = "router") -> str:
    """A replica id unique to this start."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def encode_load(replica_id: str, seq: int, shares: Mapping[str, Share],
                leaving: bool = False) -> router_pb2.ReplicaLoad:
    """The ``ReplicaLoad`` of ``shares``."""
    return router_pb2.ReplicaLoad(
        replica_id=replica_id, seq=seq, leaving=leaving,
        workers=[router_pb2.WorkerShare(worker_id=w, in_flight=s.in_flight,
                                        active_blocks=s.active_blocks,
                                        pending_prefill_tokens=s.pending_prefill_tokens,
                                        decoding_alone=s.decoding_alone)
                 for w, s in sorted(shares.items())])


def decode_shares(msg: router_pb2.ReplicaLoad) -> dict[str, Share]:
    """The shares of a ``ReplicaLoad`` (a worker listed twice: the shares add up)."""
    out: dict[str, Share] = {}
    for w in msg.workers:
        out[w.worker_id] = out.get(w.worker_id, Share()) + Share(
            w.in_flight, w.active_blocks, w.pending_prefill_tokens, w.decoding_alone)
    return out


@dataclass
class SyncStats:
    """Counters of one :class:`ReplicaSync`."""

    published: int = 0
    applied: int = 0
    bad_entries: int = 0
    publish_failures: int = 0
    read_failures: int = 0
    expired_peers: int = 0


class ReplicaSync:
    """Publishes ``core``'s own shares and applies its peers'; see the module docstring."""

    def __init__(self, core: RouterCore, redis_url: str, namespace: str,
                 tls: MeshTls | None = None, *, replica_id: str = "",
                 interval_s: float = DEFAULT_INTERVAL_S,
                 heartbeat_s: float | None = None,
                 peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
                 block_ms: int = 1000,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.core = core
        self.replica_id = replica_id or new_replica_id()
        self.stream = sync_stream(namespace)
        self.stats = SyncStats()
        self._url, self._tls = redis_url, tls
        self._interval_s = interval_s
        self._heartbeat_s = peer_timeout_s / 3 if heartbeat_s is None else heartbeat_s
        self._timeout_s, self._block_ms = peer_timeout_s, block_ms
        self._redis: aioredis.Redis | None = None
        self._seq = 0
        self._last_id = "$"
        self._changed = asyncio.Event()
        self._publisher = Periodic("replica-sync-publish", self._publish_loop, 0.5,
                                   max_backoff_s=5.0)
        self._reader = Periodic("replica-sync-read", self._read_loop, 0.5, max_backoff_s=5.0)
        self._tasks = [self._publisher, self._reader,
                       Periodic("replica-sync-expire", self._expire, peer_timeout_s / 4,
                                delay_first=True)]
        self._closed = False
        self._on_failure = on_failure

    async def start(self) -> None:
        """Connects, wires the core's ``on_change`` and starts the tasks."""
        self._redis = redis_client(self._url, self._tls)
        try:  # the stream id of peer_timeout_s ago (module docstring)
            sec, usec = await self._redis.time()
            since_ms = sec * 1000 + usec // 1000 - int(self._timeout_s * 1000)
            self._last_id = f"{max(since_ms, 0)}-0"
        except (RedisError, OSError) as exc:  # the reader's retries report the outage
            log.warning("replica sync: no Redis time at start (%r): peers are heard from "
                        "their next snapshot", exc)
        self.core.on_change = self._changed.set
        self._changed.set()  # announce this replica at once
        for task in self._tasks:
            task.start()

    async def _publish(self, leaving: bool = False) -> None:
        assert self._redis is not None
        self._seq += 1
        msg = encode_load(self.replica_id, self._seq,
                          {} if leaving else self.core.local_shares(), leaving)
        await self._redis.xadd(self.stream, {b"r": self.replica_id.encode(),
                                             b"d": msg.SerializeToString()},
                               maxlen=STREAM_MAXLEN, approximate=True)
        self.stats.published += 1

    async def _publish_loop(self) -> None:
        """Publishes after each change (coalesced by ``interval_s``) and every
        ``heartbeat_s``; a Redis error ends the run (Periodic logs it and retries)."""
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), self._heartbeat_s)
                self._changed.clear()
                await self._publish()
                self._publisher.note_progress()
                await asyncio.sleep(self._interval_s)  # coalesce the next changes
        except (RedisError, OSError):
            self.stats.publish_failures += 1
            if self._on_failure is not None:
                self._on_failure("publish")
            self._changed.set()  # publish as soon as Redis is back
            raise

    async def _read_loop(self) -> None:
        """Reads and applies the peers' snapshots; a Redis error ends the run."""
        assert self._redis is not None
        try:
            while True:
                resp: Any = await self._redis.xread({self.stream: self._last_id},
                                                    count=256, block=self._block_ms)
                for _stream, entries in resp or ():
                    for entry_id, fields in entries:
                        self._last_id = entry_id
                        self._apply(fields)
                self._reader.note_progress()
        except (RedisError, OSError):
            self.stats.read_failures += 1
            # Redis may come back empty (a restart without persistence) with a clock behind
            # the ids read so far: read what comes next instead of waiting for them
            self._last_id = "$"
            if self._on_failure is not None:
                self._on_failure("read")
            raise

    def _apply(self, fields: Mapping[bytes, bytes]) -> None:
        try:
            msg = router_pb2.ReplicaLoad.FromString(fields[b"d"])
        except (KeyError, DecodeError) as exc:
            self.stats.bad_entries += 1
            log.warning("replica sync stream %s: skipped an entry that is not a "
                        "ReplicaLoad (%r; %d so far)", self.stream, exc,
                        self.stats.bad_entries)
            return
        if msg.replica_id == self.replica_id or not msg.replica_id:
            return
        if msg.leaving:
            if self.core.drop_peer(msg.replica_id, msg.seq):
                log.info("router replica %s left", msg.replica_id)
            return
        known = self.core.peers.knows(msg.replica_id)
        if self.core.set_peer(msg.replica_id, msg.seq, decode_shares(msg)):
            self.stats.applied += 1
            if not known:
                log.info("router replica %s joined (replica sync)", msg.replica_id)

    async def _expire(self) -> None:
        for rid in self.core.expire_peers(self._timeout_s):
            self.stats.expired_peers += 1
            log.warning("router replica %s not heard from for %.1fs: its in-flight load "
                        "no longer counts", rid, self._timeout_s)

    async def close(self) -> None:
        """Stops, then tells the peers this replica left (best effort); idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            await task.stop()
        if self.core.on_change == self._changed.set:
            self.core.on_change = None
        if self._redis is None:
            return
        try:
            await asyncio.wait_for(self._publish(leaving=True), 1.0)
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("replica sync: could not announce that %s leaves (%r); the peers "
                        "drop it after %.1fs", self.replica_id, exc, self._timeout_s)
        await self._redis.aclose()
        self._redis = None
