"""Keeps a :class:`~services.indexer.core.KvIndex` in step with the KV event stream.

Used by the indexer service and by a router with an embedded index (same stream, same
core). Contract of :class:`IndexFeed`:

- ``start()``: connects Redis and etcd, creates the consumer group (``MKSTREAM``) if
  needed and rewinds it to the stream's start, so the index is rebuilt from the stream
  after every (re)start; returns once that replay is applied (``ready``), then keeps
  consuming new entries (``XREADGROUP`` ``>`` with ``NOACK``: a restart replays the
  stream from its start rather than from a pending list, so none is kept and no
  ``XACK`` round trip follows each read).
- Batches are applied event by event. A :class:`~services.indexer.core.Gap` (an event id
  skipped) makes the feed ask the worker for its full state (``Worker.GetKvState``, the
  address comes from etcd) and resync that worker; the events of the batch that follow
  are then applied or ignored as already covered. Until a resync succeeds, a worker's
  later events keep reporting the gap (retried at most every ``retry_s`` of the injected
  ``clock``, monotonic seconds).
- A full-state entry a worker published itself replaces that worker's state unless the
  index is already past it.
- Workers whose etcd lease goes are removed from the index (also those found only in the
  replayed stream once the first etcd snapshot shows them gone), and so is a worker whose
  record comes back from a new process (pid or ``started_at_ms`` changed: a restart
  within the lease) unless the index already follows that process; its new events,
  numbered from 0 again, then rebuild it (a gap resyncs it from the worker).
- Incarnations (a worker id outlives its processes; each numbers its events from 0):
  every entry names its sender's ``started_at_ms`` (0 from older producers: event ids
  only, as before), and :class:`~services.indexer.core.Incarnations` decides. An entry of
  a later process than the one the index follows for that worker id drops the worker's
  blocks and event-id state and is applied from there (``incarnation_restarts``, one log
  line), so a replay of a stream holding several processes of one id ends with the last
  one's state, not with the first one's event ids hiding the later ones' events. Entries
  of an older process than the one followed, or than the live etcd record's
  ``started_at_ms``, are not applied (``stale_entries``; logged once per worker and
  incarnation). A record naming a later process than the one followed drops the
  worker's entry at once. A ``GetKvState`` answer passes the same test.
- Malformed entries are counted and skipped; the feed never stops on bad input.
- Signed events: with mesh TLS material (``tls``) the feed reads the mesh's event secret
  (``events.key`` in its tls folder; a missing one raises CertError at construction) and
  accepts only entries signed by the worker they name or by its owner
  (:func:`services.common.event_bus.decode_entry` with the signer's key, derived from the
  secret and the signer's name: field ``s``, else the worker id; the signer must be the
  worker id or, for a sub-id ``<name>.<suffix>`` such as a mock fleet's worker, its
  certificate name ``<name>``: :func:`services.common.worker_ids.may_act_as`). An
  unsigned or forged entry (wrong MAC, a signer that may not act as the worker id, or a
  signed entry carrying another worker's events) is dropped before it touches the index,
  so a forged full-state entry
  can no longer replace a worker's blocks nor push its event ids ahead. It is counted by
  reason (``unsigned_entries``, ``forged_entries``) and logged once per claimed worker id
  (for the first :data:`MAX_LOGGED_SENDERS` ids; after that, at powers of two of the
  count). Without ``tls`` unsigned entries are accepted, as before.
- Redis: :func:`services.common.redis_conn.redis_client` with ``tls`` (a ``rediss://``
  URL logs in as the ACL user of the certificate's role: ``indexer``, or ``router`` for a
  router's embedded index).
- Redis going away or restarting (see :meth:`IndexFeed._follow`): a failed read is counted
  (``read_failures``) and retried every ``retry_s``; the first failure of an outage logs
  one line with its cause, later ones only when their number is a power of two, and the
  recovery one line. The feed notices a *bus reset*: the server's ``run_id`` changed
  (checked at every retry and every ``retry_s`` while reading: a restart, whether the data
  was wiped or kept by AOF, which may lose its last second), or a read answered
  ``NOGROUP`` (the stream or the group is gone: wiped, ``FLUSHALL``, ``DEL``). On a reset
  it recreates the group at the start of what the stream now holds (``MKSTREAM``; a group
  kept by AOF stays where it is), logs one line with the cause, counts it
  (``bus_resets``), and resyncs every worker in etcd that publishes KV events
  (``kv_events`` capability) from its ``GetKvState``, since events published before the
  reset may be lost with no later event to reveal the gap. A worker whose resync fails is
  retried every ``retry_s`` until it succeeds or the worker leaves etcd.
- ``stats`` (see :class:`FeedStats`); ``live_workers()`` the worker ids of the latest etcd
  snapshot; ``close()`` stops everything. Idempotent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from protos import discovery_pb2, kv_events_pb2, worker_pb2_grpc
from services.common.discovery import InstanceWatcher
from services.common.event_bus import (
    UNSIGNED,
    BadEntry,
    BadSignature,
    KeyLookup,
    decode_entry,
    stream_name,
)
from services.common.grpc_client import ChannelPool
from services.common.injected import Clock
from services.common.periodic import Periodic
from services.common.redis_conn import PackedCommand, redis_client
from services.common.tls import EVENTS_KEY, MeshTls, derive_event_key
from services.indexer.core import Admission, Gap, Incarnations, KvEvent, KvIndex

log = logging.getLogger(__name__)

KIND_NAMES = {
    kv_events_pb2.KV_EVENT_KIND_STORED: "stored",
    kv_events_pb2.KV_EVENT_KIND_REMOVED: "removed",
    kv_events_pb2.KV_EVENT_KIND_CLEARED: "cleared",
}
MAX_LOGGED_SENDERS = 256


def _incarnation(rec: discovery_pb2.InstanceRecord) -> tuple[int, int]:
    """What tells two processes under one worker id apart."""
    return rec.pid, rec.started_at_ms


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
    read_failures: int = 0  # stream reads (or bus checks) that failed
    bus_resets: int = 0  # Redis restarts / lost streams or groups noticed
    unsigned_entries: int = 0  # dropped: no MAC although the mesh signs its events
    forged_entries: int = 0  # dropped: a MAC that does not prove the worker it names
    stale_entries: int = 0  # not applied: sent by an older process of their worker id
    incarnation_restarts: int = 0  # entries of a later process of a worker id seen


def state_blocks(state: kv_events_pb2.KvState) -> dict[str, Iterable[int]]:
    """tier → hashes of a KvState message."""
    return {t.tier: list(t.block_hashes) for t in state.tiers}


def _powers_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class IndexFeed:
    """See the module docstring."""

    def __init__(self, index: KvIndex, redis_url: str, etcd_endpoint: str, namespace: str,
                 group: str, consumer: str = "c0", *, clock: Clock,
                 batch: int = 512, block_ms: int = 500, retry_s: float = 1.0,
                 tls: MeshTls | None = None) -> None:
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
        self._watcher = InstanceWatcher(etcd_endpoint, namespace, "worker", tls=tls)
        self._records: dict[str, discovery_pb2.InstanceRecord] = {}
        self._seen_alive: set[str] = set()
        self._pool = ChannelPool(tls, "worker")
        self._tls = tls
        self._keys: KeyLookup | None = None
        if tls is not None:
            secret = tls.secret(EVENTS_KEY)
            self._keys = lambda signer: derive_event_key(secret, signer)
        self._sig_logged: set[str] = set()
        self._incarnations = Incarnations()
        self._stale_logged: dict[str, int] = {}  # worker → stale incarnation last logged
        self._last_try: dict[str, float] = {}
        self._resync_fails: dict[str, int] = {}  # failed resyncs in a row, per worker
        self._stale: set[str] = set()  # workers to resync after a bus reset
        self._redis: aioredis.Redis | None = None
        self._follow_read: PackedCommand | None = None  # the follower's blocking read
        self._run_id = ""  # the Redis server's run_id when last checked
        self._checked_at = 0.0
        self._failing = 0  # failed follow runs in a row (an outage)
        self._closing = False
        self._clock = clock
        # _follow reads until an error, which it logs and counts itself; the Periodic then
        # calls it again after retry_s (max_backoff_s = retry_s: a fixed retry delay).
        self._follower = Periodic(f"index-feed-{group}", self._follow, retry_s,
                                  max_backoff_s=retry_s)

    async def start(self) -> None:
        """Replays the stream into the index, then follows it (see the contract)."""
        self._redis = redis_client(self._redis_url, self._tls)
        self._follow_read = self._group_read("BLOCK", self._block_ms)
        self._run_id = await self._server_run_id()
        self._checked_at = self._clock()
        if not await self._ensure_group():
            await self._redis.xgroup_setid(self.stream, self.group, id="0")
        self._watcher.on_change(self._on_workers)
        await self._watcher.start()
        replay = self._group_read()
        try:
            while await self._read(replay):
                pass
        finally:
            await replay.close()
        self._drop_dead_after_replay()
        self.ready.set()
        self._follower.start()

    async def _ensure_group(self) -> bool:
        """Creates the group at the stream's start (and the stream if missing); False when
        the group already exists."""
        assert self._redis is not None
        try:
            await self._redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
            return False
        return True

    async def _server_run_id(self) -> str:
        assert self._redis is not None
        info: dict[str, Any] = await self._redis.info("server")
        return str(info.get("run_id", ""))

    def live_workers(self) -> set[str]:
        """The workers in the latest etcd snapshot."""
        return set(self._records)

    def _on_workers(self, records: Mapping[str, discovery_pb2.InstanceRecord]) -> None:
        """An etcd snapshot: workers seen alive before and now gone lose their blocks, and
        so does a worker that came back as a new process (new pid or start time: it
        restarted within its lease, and numbers its events from 0 again, which would
        otherwise read as redeliveries and be ignored)."""
        previous, self._records = self._records, dict(records)
        gone = self._seen_alive - set(records)
        self._seen_alive = set(records)
        for w in sorted(gone):
            self._drop(w)
            self._forget(w)
        for w, rec in sorted(records.items()):
            old = previous.get(w)
            restarted = old is not None and _incarnation(old) != _incarnation(rec)
            if self._incarnations.record_seen(w, rec.started_at_ms, restarted):
                if old is not None and restarted:
                    log.info("%s restarted (pid %d -> %d); its index entry starts over", w,
                             old.pid, rec.pid)
                else:
                    log.info("%s runs as a later process (started at %d ms) than its index "
                             "entry's; the entry starts over", w, rec.started_at_ms)
                self._drop(w)

    def _drop_dead_after_replay(self) -> None:
        alive = set(self._watcher.instances())
        for w in sorted(self.index.workers() - alive):
            self._drop(w)
            self._forget(w)

    def _drop(self, worker: str) -> None:
        self.index.remove_worker(worker)
        self.stats.workers_removed += 1

    def _forget(self, worker: str) -> None:
        self._incarnations.forget(worker)
        self._stale_logged.pop(worker, None)

    def _admit(self, worker: str, incarnation: int) -> bool:
        """Whether a message of ``worker``'s process ``incarnation`` is applied; a later
        process's first message drops the worker's index entry first (module docstring)."""
        followed = self._incarnations.current(worker)
        verdict = self._incarnations.admit(worker, incarnation)
        if verdict is Admission.STALE:
            self.stats.stale_entries += 1
            if self._stale_logged.get(worker) != incarnation:
                self._stale_logged[worker] = incarnation
                log.info("%s: ignoring KV entries of its older process (started at %d ms; "
                         "following %d ms)", worker, incarnation,
                         max(followed, self._incarnations.live(worker)))
            return False
        if verdict is Admission.NEWER:
            self.stats.incarnation_restarts += 1
            log.info("%s: KV entries of a new process (started at %d ms, was %d ms); its "
                     "index entry starts over", worker, incarnation, followed)
        if verdict is not Admission.CURRENT:  # FIRST drops state of unmarked entries, if any
            self.index.remove_worker(worker)
        return True

    async def _follow(self) -> None:
        """Reads and applies new entries back to back, checking for a bus reset first and
        every ``retry_s``; a Redis error ends the run (logged and counted by
        :meth:`_outage`), and the Periodic calls again ``retry_s`` later."""
        try:
            self._raise_if_closing()
            await self._check_bus()
            while True:
                self._raise_if_closing()
                try:
                    assert self._follow_read is not None
                    await self._read(self._follow_read)
                except ResponseError as exc:
                    if "NOGROUP" not in str(exc):
                        raise
                    await self._bus_reset(f"the stream or its group is gone ({exc})")
                    continue
                self._follower.note_progress()
                self._recovered()
                if self._clock() - self._checked_at >= self._retry_s:
                    await self._check_bus()
                if self._stale:
                    await self._resync_stale()
        except (RedisError, OSError) as exc:
            self._outage(exc)

    def _raise_if_closing(self) -> None:
        """Ends the follower once ``close()`` began, even if its cancel was lost in a Redis
        call (Python 3.11's ``asyncio.wait_for``, which redis-py sends through, drops a
        cancel that arrives as the send completes)."""
        if self._closing:
            raise asyncio.CancelledError

    async def _check_bus(self) -> None:
        """A changed server ``run_id`` means Redis restarted: a bus reset."""
        run_id = await self._server_run_id()
        self._checked_at = self._clock()
        if run_id != self._run_id:
            await self._bus_reset(f"Redis restarted (run_id {self._run_id} -> {run_id})")
            self._run_id = run_id

    async def _bus_reset(self, reason: str) -> None:
        """Recreates the group if it is gone and resyncs every KV-event worker."""
        created = await self._ensure_group()
        self.stats.bus_resets += 1
        self._stale = {w for w, rec in self._records.items() if "kv_events" in rec.capabilities}
        self._last_try.clear()
        log.warning("KV event stream %s: %s; consumer group %s %s; resyncing %d workers",
                    self.stream, reason, self.group, "recreated" if created else "kept",
                    len(self._stale))
        await self._resync_stale()

    def _outage(self, exc: Exception) -> None:
        self.stats.read_failures += 1
        self._failing += 1
        n = self._failing
        if n == 1:
            log.warning("KV event stream %s unreadable (%r); retrying every %.1fs",
                        self.stream, exc, self._retry_s)
        elif _powers_of_two(n):
            log.warning("KV event stream %s still unreadable (%d tries in a row): %r",
                        self.stream, n, exc)

    def _recovered(self) -> None:
        if self._failing:
            log.info("KV event stream %s readable again after %d failed tries", self.stream,
                     self._failing)
            self._failing = 0

    def _group_read(self, *block: Any) -> PackedCommand:
        """This consumer's ``XREADGROUP`` of new entries (``block``: ``"BLOCK", ms``), as
        one packed command on a connection of its own
        (:class:`~services.common.redis_conn.PackedCommand`)."""
        assert self._redis is not None
        return PackedCommand(self._redis, "XREADGROUP", "GROUP", self.group, self.consumer,
                             "COUNT", self._batch, *block, "NOACK", "STREAMS", self.stream,
                             ">")

    async def _read(self, read: PackedCommand) -> int:
        """Reads and applies one chunk with ``read``; returns the number of entries. The
        raw reply's field lists become the mapping the client's ``xreadgroup`` gives."""
        resp: Any = await read()
        n = 0
        for _stream, entries in (resp.items() if isinstance(resp, dict) else resp or ()):
            for _entry_id, flat in entries:
                n += 1
                await self._apply(dict(zip(flat[::2], flat[1::2], strict=True))
                                  if flat else {})
        return n

    async def _apply(self, fields: Mapping[bytes, bytes]) -> None:
        self.stats.entries += 1
        try:
            msg = decode_entry(fields, self._keys)
        except BadSignature as exc:
            self._rejected(exc)
            return
        except BadEntry as exc:
            self.stats.bad_entries += 1
            log.warning("skipping KV event entry: %s", exc)
            return
        if not self._admit(msg.worker_id, msg.started_at_ms):
            return
        if isinstance(msg, kv_events_pb2.KvState):
            if msg.event_id >= self.index.next_event_id(msg.worker_id) - 1:
                self.index.resync(msg.worker_id, msg.event_id, state_blocks(msg))
                self.stats.resyncs += 1
                self._stale.discard(msg.worker_id)
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
                if msg.started_at_ms > 0 and \
                        self._incarnations.current(msg.worker_id) != msg.started_at_ms:
                    break  # the resync found another process: this batch is not its
                gap = self.index.apply(event)
                if gap is not None:
                    continue
            self.stats.events_applied += 1

    def _rejected(self, exc: BadSignature) -> None:
        """Counts an entry dropped for its signature; logs once per claimed sender."""
        if exc.reason == UNSIGNED:
            self.stats.unsigned_entries += 1
        else:
            self.stats.forged_entries += 1
        total = self.stats.unsigned_entries + self.stats.forged_entries
        if exc.worker_id in self._sig_logged:
            return
        if len(self._sig_logged) < MAX_LOGGED_SENDERS:
            self._sig_logged.add(exc.worker_id)
        elif not _powers_of_two(total):
            return
        log.warning("dropping KV event entries: %s (%d dropped for their signature so far; "
                    "later ones for this worker id are only counted)", exc, total)

    def _may_try(self, worker: str) -> bool:
        """At most one resync attempt per worker every ``retry_s``."""
        now = self._clock()
        if now - self._last_try.get(worker, -1e9) < self._retry_s:
            return False
        self._last_try[worker] = now
        return True

    async def _resync(self, gap: Gap) -> bool:
        """Replaces the worker's state by its own full dump; False when unavailable."""
        if not self._may_try(gap.worker_id):
            return False
        state = await self._fetch_state(gap.worker_id)
        if state is None:
            return False
        if not self._apply_state(gap.worker_id, state):
            return False
        log.info("%s: events %d..%d missing; resynced at event %d", gap.worker_id,
                 gap.expected, gap.got - 1, state.event_id)
        return True

    async def _resync_stale(self) -> None:
        """Resyncs the workers left to resync after a bus reset (those due a try)."""
        self._stale &= set(self._records)
        due = sorted(w for w in self._stale if self._may_try(w))
        states = await asyncio.gather(*(self._fetch_state(w) for w in due))
        for worker, state in zip(due, states, strict=True):
            if state is not None and worker in self._stale:
                self._apply_state(worker, state)

    async def _fetch_state(self, worker: str) -> kv_events_pb2.KvState | None:
        """The worker's ``GetKvState``; None (counted, logged on the first failure in a row
        and then at powers of two) when it is not in etcd or does not answer."""
        rec = self._records.get(worker)
        if rec is None:
            self.stats.resync_failures += 1
            return None
        stub = worker_pb2_grpc.WorkerStub(self._pool.get(rec.address))
        try:
            return await stub.GetKvState(kv_events_pb2.KvStateRequest(), timeout=5)
        except grpc.RpcError as exc:
            self.stats.resync_failures += 1
            n = self._resync_fails[worker] = self._resync_fails.get(worker, 0) + 1
            if _powers_of_two(n):
                log.warning("resync of %s failed (%d in a row): %s %s", worker, n,
                            exc.code(), exc.details())  # type: ignore[attr-defined]
            return None

    def _apply_state(self, worker: str, state: kv_events_pb2.KvState) -> bool:
        """Applies a worker's ``GetKvState`` answer; False (not applied) when it is of an
        older process than the one the index follows."""
        if not self._admit(worker, state.started_at_ms):
            self._stale.discard(worker)  # asking again would get the same answer
            return False
        self.index.resync(worker, state.event_id, state_blocks(state))
        self._last_try.pop(worker, None)
        self._resync_fails.pop(worker, None)
        self._stale.discard(worker)
        self.stats.resyncs += 1
        return True

    async def close(self) -> None:
        """Stops following the stream and closes connections."""
        self._closing = True
        await self._follower.stop()
        await self._watcher.close()
        await self._pool.close()
        if self._follow_read is not None:
            await self._follow_read.close(broken=True)  # a read may have been cut short
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None
