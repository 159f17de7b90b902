"""The worker's KV event relay: engine ZMQ events → numbered kvmesh events → Redis Stream.

vLLM's ``ZmqEventPublisher`` sends frames ``[topic, seq (8-byte big-endian), msgpack]``
where the payload is ``[ts, [events], dp_rank]`` and keeps the last batches for a replay
socket (ROUTER: send ``[b"", start_seq]``, receive ``[b"", topic, seq, payload]`` until
seq -1). :func:`vllm_kv_events_config` makes vLLM bind both on private ``ipc://`` paths.

Contract of :class:`KvEventRelay`:

- ``start()`` connects the SUB and replay sockets and Redis and starts relaying. Start it
  before the engine, so it sees the engine's first batch (the replay covers a late join).
- Engine batches are processed in sequence order. When a batch's seq skips ahead, the
  relay asks the replay socket for the missing range first; when replay cannot cover it
  (buffer exceeded, timeout), it calls ``reset_cache`` (the engine's prefix-cache reset;
  vLLM then announces AllBlocksCleared) and publishes a full-state resync entry, so an
  index never keeps blocks the relay cannot account for. Duplicates (seq already seen)
  are ignored.
- Each kvmesh event (:mod:`workers.kv.event_translate`) gets the next per-worker event id
  (from 0, no holes; a new relay, i.e. a restarted worker, starts at 0 again) and events
  are appended to the stream in batches: everything that is ready when the socket runs
  dry, at most ``max_batch_events`` per entry, in one round trip (one XADD, or pipelined
  XADDs for several entries; approximate MAXLEN ``maxlen``), so the relay keeps up with
  the engine. With ``flush_delay_s`` (the worker's ``--kv-event-flush-ms``) the relay
  waits that long after the first event of a batch before publishing it, so the events
  of the engine steps meanwhile (other requests', the same request's next block) share
  its round trip: an index learns of a block at most that much later, and the engine,
  Redis and every index spend less per event.
- ``convert`` (optional): applied to each decoded engine event before translation, for
  engines whose events differ from vLLM's (:class:`workers.kv.sglang_events.
  SglangEventConverter`); an event it maps to None is dropped.
- ``submit(events)`` is the in-process entry for engines without a ZMQ publisher (the
  mock engine): a list of engine events in vLLM's decoded form (dicts with ``"type"``,
  see :mod:`workers.kv.event_translate`) is translated and numbered exactly like a ZMQ
  batch, and published by the relay's flush task. Start such a relay with
  ``start(zmq_input=False)``.
- ``state()`` is the worker's full state with the id of the last event it reflects: what
  ``Worker.GetKvState`` answers for an indexer that saw a gap.
- Incarnation: every entry (event batches, full states) and ``state()`` carry
  ``started_at_ms``, this process's start time (:attr:`KvEventRelay.started_at_ms`: the
  constructor's ``started_at_ms``, else the wall clock at construction, in ms). The
  worker puts the same value in its etcd record (``InstanceRecord.started_at_ms``), so an
  indexer tells a restarted worker's events, numbered from 0 again under the same worker
  id, from its previous process's (see :class:`services.indexer.core.Incarnations`). It
  is inside the serialized message, so the entry's MAC covers it.
- ``drop_next(n)`` is fault injection for tests: the next ``n`` events (replacing any
  count still pending; 0 stops dropping) get their ids but are not published, as if the
  bus lost them.
- ``stats`` counts events, entries, replays, unrecoverable gaps, orphans and drops.
- Redis being down never stops the worker or the relay: ``start()`` only warns, a failed
  XADD keeps its events (up to ``max_pending``; beyond that the oldest are dropped, which
  an indexer sees as a gap and repairs from ``state()``) and is retried with backoff. The
  relaying loop runs in a :class:`~services.common.periodic.Periodic`: a failed publish
  raises :class:`PublishFailed` out of it, and the Periodic waits 0.2 s, doubling up to
  :data:`RETRY_MAX_S`, before relaying again (in ZMQ mode from the next engine batch, in
  submit mode with an immediate retry). Every publish that succeeds calls the Periodic's
  ``note_progress()``, so the backoff starts again from zero while relaying goes on.
- ``close()`` stops relaying, flushes what is pending, closes sockets and Redis; a
  relaying run that goes on after its cancel was lost in a Redis call ends at its next
  loop turn.
- Signed events: with mesh TLS material (``tls``) every entry carries the worker's MAC
  (:mod:`services.common.event_bus`), made with its event key ``<stem>.evkey`` next to
  its certificate ``<stem>.pem`` (a missing key raises CertError at construction). The
  key is derived from the worker's certificate name, which is its worker id or, for a
  sub-id ``<name>.<suffix>`` (a mock fleet's worker), its owner ``<name>``; the entry
  then names its signer (field ``s``). An indexer drops entries of a worker id the
  certificate may not act as (:func:`services.common.worker_ids.may_act_as`; the relay
  logs one warning at construction for such a worker id). Redis is reached
  through :func:`services.common.redis_conn.redis_client` as the ACL user ``worker``
  (``rediss://``), which may only XADD to the event stream.
- A Redis restart (data wiped or kept) needs nothing from the relay: its next XADD
  reconnects and recreates the stream if it is gone; events an indexer missed are
  repaired from ``state()`` (the indexer resyncs every worker when it notices the
  restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import redis.asyncio as aioredis
import zmq
import zmq.asyncio
from redis.exceptions import RedisError

from protos import kv_events_pb2
from services.common.event_bus import encode_batch, encode_state
from services.common.periodic import Periodic
from services.common.redis_conn import PackedCommand, redis_client
from services.common.tls import EVENT_KEY_SUFFIX, MeshTls
from services.common.worker_ids import may_act_as
from workers.kv.event_translate import EventTranslator, TranslatedEvent, UnknownEvent

log = logging.getLogger(__name__)

KINDS = {
    "stored": kv_events_pb2.KV_EVENT_KIND_STORED,
    "removed": kv_events_pb2.KV_EVENT_KIND_REMOVED,
    "cleared": kv_events_pb2.KV_EVENT_KIND_CLEARED,
}
END_SEQ = -1
RETRY_BASE_S = 0.1  # the Periodic's interval; its first backoff after a failure is 2x
RETRY_MAX_S = 5.0


class PublishFailed(RuntimeError):
    """Publishing to Redis failed; the events stay pending (ends a relaying run)."""


@dataclass
class EventEndpoints:
    """Private ipc endpoints for one engine's publisher and replay sockets."""

    directory: Path
    events: str
    replay: str

    @classmethod
    def create(cls) -> EventEndpoints:
        d = Path(tempfile.mkdtemp(prefix="kvmesh-ev-"))
        return cls(d, f"ipc://{d}/events", f"ipc://{d}/replay")

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def vllm_kv_events_config(endpoints: EventEndpoints) -> dict[str, Any]:
    """vLLM ``kv_events_config``: ZMQ publisher bound on the ipc endpoints (vLLM binds
    ipc endpoints and connects tcp ones without ``*``)."""
    return {"enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": endpoints.events, "replay_endpoint": endpoints.replay,
            "topic": "kv", "buffer_steps": 10_000}


@dataclass
class RelayStats:
    """Cumulative relay counters."""

    engine_batches: int = 0
    events: int = 0
    entries: int = 0
    replays: int = 0
    replayed_batches: int = 0
    unrecoverable_gaps: int = 0
    resyncs_published: int = 0
    dropped_on_purpose: int = 0
    bad_payloads: int = 0
    publish_failures: int = 0
    dropped_backlog: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class KvEventRelay:
    """See the module docstring."""

    def __init__(self, worker_id: str, block_size: int, redis_url: str, stream: str,
                 endpoints: EventEndpoints, *,
                 reset_cache: Callable[[], Awaitable[bool]] | None = None,
                 max_batch_events: int = 1024, maxlen: int = 1_000_000,
                 replay_timeout_s: float = 2.0, max_pending: int = 200_000,
                 tls: MeshTls | None = None, started_at_ms: int = 0,
                 convert: Callable[[Any], Any] | None = None,
                 flush_delay_s: float = 0.0,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        if flush_delay_s < 0:
            raise ValueError(f"flush_delay_s must be >= 0, got {flush_delay_s}")
        self.worker_id = worker_id
        self._flush_delay = flush_delay_s
        self._sleep = sleep  # the flush delay's (tests hold it)
        self._convert = convert
        self.started_at_ms = started_at_ms or int(time.time() * 1000)
        self._tls = tls
        self._key = tls.secret(f"{tls.stem}{EVENT_KEY_SUFFIX}") if tls is not None else None
        self._signer = tls.identity.name if tls is not None else ""
        if tls is not None and not may_act_as(self._signer, worker_id):
            log.warning("KV events of worker %r are signed by %s, which may not act as it: "
                        "indexers will drop them as forged (see services.common.worker_ids)",
                        worker_id, tls.identity)
        self.block_size = block_size
        self.stream = stream
        self.endpoints = endpoints
        self.stats = RelayStats()
        self._redis_url = redis_url
        self._reset_cache = reset_cache
        self._max_batch = max_batch_events
        self._maxlen = maxlen
        self._replay_timeout = replay_timeout_s
        self._translator = EventTranslator(block_size)
        self._next_seq = 0
        self._last_event_id = -1
        self._pending: list[kv_events_pb2.KvEvent] = []
        self._drop = 0
        self._ctx = zmq.asyncio.Context()
        self._sub: zmq.asyncio.Socket | None = None
        self._redis: aioredis.Redis | None = None
        self._xadd: PackedCommand | None = None
        self._pump: Periodic | None = None
        self._decoder = msgspec.msgpack.Decoder()
        self._wake = asyncio.Event()
        self._max_pending = max_pending
        self._closing = False

    @property
    def orphans(self) -> int:
        """Engine blocks skipped because their parent was never seen."""
        return self._translator.orphans

    async def start(self, zmq_input: bool = True) -> None:
        """Connects Redis (and the engine's sockets unless ``zmq_input`` is False) and
        starts the relay task."""
        self._redis = redis_client(self._redis_url, self._tls, "worker")
        # the usual flush's XADD, packed once (its fields appended per call)
        self._xadd = PackedCommand(self._redis, "XADD", self.stream, "MAXLEN", "~",
                                   self._maxlen, "*")
        try:
            await self._redis.ping()
        except (RedisError, OSError) as exc:
            log.warning("%s: KV event bus %s unreachable (%s); events are kept and retried",
                        self.worker_id, self._redis_url, exc)
        if zmq_input:
            self._sub = self._ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.SUBSCRIBE, b"")
            self._sub.setsockopt(zmq.RCVHWM, 100_000)
            self._sub.connect(self.endpoints.events)
        self._pump = Periodic(f"kv-relay-{self.worker_id}",
                              self._relay_frames if zmq_input else self._relay_submitted,
                              RETRY_BASE_S, max_backoff_s=RETRY_MAX_S)
        self._pump.start()

    def submit(self, events: list[dict[str, Any]]) -> None:
        """Translates and numbers engine events now; they are published shortly."""
        self.stats.engine_batches += 1
        self._translate_all(events)
        self._wake.set()

    async def _relay_submitted(self) -> None:
        """Publishes submitted events whenever woken (at once when events are still
        pending, i.e. when retrying); ends only by raising (see :meth:`_publish`)."""
        if self._pending:
            self._wake.set()
        while True:
            self._raise_if_closing()
            await self._wake.wait()
            if self._flush_delay:  # what comes meanwhile goes in the same XADD
                await self._sleep(self._flush_delay)
            self._wake.clear()
            await self._publish()

    async def _publish(self) -> None:
        """Flushes; raises PublishFailed when Redis failed, and notes progress to the
        Periodic (resetting its backoff) when it did not."""
        if not await self._flush():
            raise PublishFailed(f"{self.worker_id}: {len(self._pending)} KV events wait "
                                "for the event bus")
        if self._pump is not None:
            self._pump.note_progress()

    def _raise_if_closing(self) -> None:
        """Ends a relaying run once ``close()`` began, even if its cancel was lost in a Redis
        call (Python 3.11's ``asyncio.wait_for``, which redis-py sends through, drops a
        cancel that arrives as the send completes)."""
        if self._closing:
            raise asyncio.CancelledError

    def drop_next(self, n: int) -> None:
        """Fault injection: number but do not publish the next ``n`` events."""
        self._drop = n

    def state(self) -> kv_events_pb2.KvState:
        """The full state as of the last numbered event."""
        tiers = [kv_events_pb2.TierBlocks(tier=t, block_hashes=sorted(hs))
                 for t, hs in sorted(self._translator.state().items()) if hs]
        return kv_events_pb2.KvState(worker_id=self.worker_id, event_id=self._last_event_id,
                                     tiers=tiers, block_size=self.block_size,
                                     started_at_ms=self.started_at_ms)

    async def _relay_frames(self) -> None:
        """Relays engine batches as they arrive; ends only by raising (see
        :meth:`_publish`)."""
        assert self._sub is not None
        while True:
            self._raise_if_closing()
            frames = await self._sub.recv_multipart()
            await self._on_frames(frames)
            if self._flush_delay:  # what comes meanwhile goes in the same XADD
                await self._sleep(self._flush_delay)
            while await self._sub.poll(0):
                await self._on_frames(await self._sub.recv_multipart())
                if len(self._pending) >= self._max_batch and not await self._flush():
                    break  # Redis is down: back off below instead of retrying per frame
            await self._publish()

    async def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.stats.bad_payloads += 1
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq < self._next_seq:
            return
        if seq > self._next_seq:
            await self._replay(self._next_seq, seq)
            if seq < self._next_seq:
                return
        self._apply_payload(frames[2])
        self._next_seq = seq + 1

    async def _replay(self, start: int, upto: int) -> None:
        """Fetches batches ``start`` .. ``upto - 1`` from the replay socket and applies
        them; falls back to a reset + full-state resync when they are not all there."""
        self.stats.replays += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.endpoints.replay)
        covered = False
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(int(self._replay_timeout * 1000)):
                    break
                frames = await dealer.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    covered = self._next_seq >= upto
                    break
                if seq < self._next_seq or seq >= upto:
                    continue
                if seq > self._next_seq:
                    break  # the buffer no longer holds what we missed
                self._apply_payload(frames[3])
                self._next_seq = seq + 1
                self.stats.replayed_batches += 1
        finally:
            dealer.close(linger=0)
        if not covered and self._next_seq < upto:
            await self._unrecoverable(upto)

    async def _unrecoverable(self, upto: int) -> None:
        self.stats.unrecoverable_gaps += 1
        log.warning("%s: engine KV events %d..%d are lost; resetting the prefix cache and "
                    "publishing a full-state resync", self.worker_id, self._next_seq, upto - 1)
        reset = False
        if self._reset_cache is not None:
            with contextlib.suppress(Exception):
                reset = await self._reset_cache()
        if reset:
            self._translator.reset()
        self._next_seq = upto
        await self._flush()
        assert self._redis is not None
        try:
            entry = encode_state(self.state(), self._key, self._signer)
            await self._redis.xadd(self.stream, entry,  # type: ignore[arg-type]
                                   maxlen=self._maxlen, approximate=True)
            self.stats.resyncs_published += 1
        except (RedisError, OSError) as exc:  # the indexer will ask for state() on the gap
            log.warning("%s: could not publish the resync: %s", self.worker_id, exc)

    def _apply_payload(self, payload: bytes) -> None:
        try:
            batch = self._decoder.decode(payload)
            events = batch[1]
        except (msgspec.DecodeError, IndexError, TypeError):
            self.stats.bad_payloads += 1
            return
        self.stats.engine_batches += 1
        self._translate_all(events)

    def _translate_all(self, events: list[Any]) -> None:
        for raw in events:
            try:
                if self._convert is not None:  # another engine's events (e.g. SGLang's)
                    raw = self._convert(raw)
                    if raw is None:
                        continue
                translated = self._translator.translate(raw)
            except (UnknownEvent, AttributeError, TypeError, ValueError):
                self.stats.bad_payloads += 1
                continue
            for ev in translated:
                self._number(ev)

    def _number(self, ev: TranslatedEvent) -> None:
        self._last_event_id += 1
        self._pending.append(kv_events_pb2.KvEvent(
            event_id=self._last_event_id, kind=KINDS[ev.kind],
            block_hashes=ev.block_hashes, tier=ev.tier))

    async def _flush(self) -> bool:
        """Publishes pending events as stream entries (one round trip: an XADD, or
        pipelined XADDs); False when Redis failed (the events stay pending, see the module
        docstring)."""
        if not self._pending:
            return True
        pending, self._pending = self._pending, []
        if self._drop:
            n = min(self._drop, len(pending))
            self._drop -= n
            self.stats.dropped_on_purpose += n
            pending = pending[n:]
        if not pending:
            return True
        assert self._redis is not None
        entries = [encode_batch(kv_events_pb2.KvEventBatch(
            worker_id=self.worker_id, events=pending[i:i + self._max_batch],
            block_size=self.block_size, started_at_ms=self.started_at_ms),
            self._key, self._signer) for i in range(0, len(pending), self._max_batch)]
        try:
            if len(entries) == 1:  # the usual flush: one XADD, without a pipeline's cost
                assert self._xadd is not None
                await self._xadd(*itertools.chain.from_iterable(entries[0].items()))
            else:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for entry in entries:
                        pipe.xadd(self.stream, entry,  # type: ignore[arg-type]
                                  maxlen=self._maxlen, approximate=True)
                    await pipe.execute()
        except (RedisError, OSError) as exc:
            self.stats.publish_failures += 1
            if self.stats.publish_failures == 1 or self.stats.publish_failures % 100 == 0:
                log.warning("%s: publishing KV events failed (%s); retrying",
                            self.worker_id, exc)
            self._pending = pending + self._pending
            excess = len(self._pending) - self._max_pending
            if excess > 0:  # the indexer sees the hole and resyncs from state()
                del self._pending[:excess]
                self.stats.dropped_backlog += excess
            return False
        self.stats.entries += len(entries)
        self.stats.events += len(pending)
        return True

    async def close(self) -> None:
        """Stops relaying; flushes, closes sockets and Redis. Idempotent."""
        self._closing = True
        if self._pump is not None:
            await self._pump.stop()
            self._pump = None
            with contextlib.suppress(Exception):
                await self._flush()
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
        self._ctx.destroy(linger=0)
        if self._redis is not None:
            if self._xadd is not None:
                with contextlib.suppress(Exception):
                    await self._xadd.close()
            with contextlib.suppress(Exception):
                await self._redis.aclose()
            self._redis = None
