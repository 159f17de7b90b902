"""The store master's pure core: object metadata, replicas, leases, pins, eviction, clients.

No grpc, redis or asyncio; time comes from the injected ``clock`` (seconds, a callable), so
every lease, TTL, timeout and eviction rule is tested without sleeping, and random choices
from the injected ``rng`` (``deps.py``). The master never
touches object bytes: it hands out ranges in segments that store clients mounted, and the
clients move the bytes (over NIXL).

Contract of :class:`StoreMaster` (states and errors are in ``states.py``):

- ``StoreMaster(clock, rng, params=None, strategy=None, eviction=None)``: ``clock`` and
  ``rng`` are required; the allocation strategy and eviction policy default to ``random``
  and ``sampled_lru`` drawing from ``rng``. Invalid ``params`` raise ValueError.

Store clients and segments

- ``mount_segment(client_id, segment_id, base, size, endpoint, principal)``: adds a segment
  of ``size`` bytes at address ``base``, owned by ``client_id`` (which counts as alive from
  now on) and by ``principal``, the caller's certificate identity ("" without mTLS; it is
  durable, so a restarted master keeps it).
  InvalidInput (naming the field) for an empty id, an id or endpoint longer than
  ``max_key_bytes``, ``size <= 0``, ``base < 0``, ``base + size > 2^64``, a total
  capacity that would reach 2^64 (addresses and sizes are 64-bit on the wire), or more
  than ``max_client_bytes`` or ``max_client_segments`` mounted by one principal (the
  client id without one), so a client cannot attract puts with a fake huge segment nor
  with many small ones.
  Mounting the same segment again with the same owner, base and size is a no-op returning
  False (a client remounting after a master restart); a different owner or geometry is
  AlreadyExists; another principal than the recorded one is Forbidden (a segment recorded
  without a principal is claimed by the first principal that remounts it). Returns True
  when newly mounted. A remount trusts the bytes already recorded in that segment, so
  clients must use a fresh segment id per launch.
- ``unmount_segment(client_id, segment_id, principal)``: drops the segment; every replica
  on it goes to FAILED and is dropped; objects left without replicas are deleted (even
  leased ones: the bytes are gone). NotFound unless ``client_id`` owns that segment;
  Forbidden when it was mounted by another principal than ``principal``.
- ``ping(client_id)`` → True when the client is known (owns segments) and refreshes its
  liveness; False tells the client to remount. A client not pinging for ``client_ttl_s``
  is lost on the next ``tick``: as if it unmounted all its segments.

Writes (two-phase)

- ``put_start(key, size, replicas=n, pin, preferred_segment)`` → descriptors of the
  replicas the writer must fill, in PROCESSING. Best effort: up to ``n`` replicas, each on
  a different segment, in the allocation strategy's order (the preferred segment first
  when it fits); fewer when fewer segments have room. When none has room it runs one
  eviction round and retries; then NoSpace. AlreadyExists when the key exists (complete or
  still being written); InvalidInput for an empty key, a size <= 0 or ``n`` outside
  ``1..max_replicas``.
- ``put_end(key)``: PROCESSING → COMPLETE for every replica; the object becomes readable.
  Idempotent on a complete object; NotFound when the key is unknown (never started, revoked,
  reclaimed as a zombie, or every replica lost).
- ``put_revoke(key)``: abandons a put in progress (replicas REMOVED, space freed, key gone).
  WrongState for a complete object (use ``remove``), NotFound for an unknown key.
- Zombie puts: a put with no ``put_end`` within ``put_timeout_s`` of its ``put_start`` is
  revoked by ``tick``.

Reads (never before COMPLETE)

- ``get_replica_list(key)`` → the COMPLETE replicas' descriptors, and a read lease: the
  object cannot be removed or evicted until ``lease_ttl_s`` after the last read. NotReady
  while the put is in progress, NotFound for an unknown key. Refreshes the access time
  (LRU) and, for a soft-pinned object, its soft-pin TTL.
- ``exist_key(key)`` → True only for a complete object, granting the same lease; False for
  unknown keys and puts in progress.  Every key-taking method raises InvalidInput for an
  empty key or one longer than ``max_key_bytes`` (default 4096 bytes of UTF-8).
  ``batch_exist_key(keys)`` is the same per key (InvalidInput names the key's index).

Removal, pins, eviction

- ``remove(key)``: Leased while a read lease runs; NotReady for a put in progress (use
  ``put_revoke``); NotFound for an unknown key. Pins do not prevent it.
- ``remove_all()`` removes every complete, unleased object; returns how many.
- ``set_pin(key, pin)``: NONE, SOFT (TTL ``soft_pin_ttl_s``, refreshed by reads) or HARD.
  The pin may also be given to ``put_start``.
- Eviction (``tick``, and ``put_start`` when nothing fits): when ``used >= high_watermark ×
  capacity``, frees at least ``max(eviction_ratio × capacity, used − high_watermark ×
  capacity)`` bytes by deleting whole objects chosen by the eviction policy
  (``eviction.py``; default approximate LRU), first among unpinned objects, then among
  soft-pinned ones; never leased, hard-pinned or incomplete objects. Evicting fewer bytes
  than asked (nothing else is eligible) is not an error.

Periodic work and introspection

- ``tick(now=None)``: soft-pin expiry, zombie reclaim, client liveness, then eviction, in
  that order; returns a :class:`TickReport`. Lease expiry needs no work (a lease is a
  deadline compared with the clock).
- ``stats()`` → :class:`Stats`; ``get_object(key)`` → a copy of the metadata or None;
  ``lease_until(key)`` → the end of its read lease; ``keys()``; ``segment(id)``.

Persistence (``records.py``)

- ``drain_changes()`` returns the durable records written or deleted since the last drain;
  ``snapshot()`` all of them. ``restore(segments, objects)`` rebuilds a fresh master from
  persisted records: segments are remounted (their clients get a full ``client_ttl_s`` to
  ping), each replica's range is reserved again (a replica whose segment is gone or whose
  range overlaps another is dropped; an object left without replicas is deleted), every
  complete object gets a fresh read lease (reads granted before the restart were not
  persisted) and soft pins restart their TTL. Puts in progress keep their start time, so
  zombie reclaim still applies.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from services.common.injected import Clock, Rng
from services.store_master.core.allocator import AllocationStrategy, Segment, make_strategy
from services.store_master.core.eviction import (
    Candidate,
    EvictionPolicy,
    make_eviction_policy,
)
from services.store_master.core.records import (
    Changes,
    Record,
    object_from_record,
    object_record,
    segment_record,
)
from services.store_master.core.states import (
    AlreadyExists,
    Forbidden,
    InvalidInput,
    Leased,
    NoSpace,
    NotFound,
    NotReady,
    ObjectMeta,
    Pin,
    Replica,
    ReplicaDescriptor,
    ReplicaState,
    StoreError,
    WrongState,
)

ADDRESS_SPACE = 1 << 64  # segment addresses, sizes and the total capacity are 64-bit


@dataclass(frozen=True)
class MasterParams:
    """Tunables, with Mooncake Store's defaults."""

    lease_ttl_s: float = 10.0
    soft_pin_ttl_s: float = 30 * 60.0
    client_ttl_s: float = 10.0
    put_timeout_s: float = 30.0
    high_watermark: float = 0.90
    eviction_ratio: float = 0.05
    max_replicas: int = 8
    max_key_bytes: int = 4096
    # most bytes / segments one principal (certificate identity; the client id without
    # mTLS) mounts
    max_client_bytes: int = 4 << 40
    max_client_segments: int = 64

    def problems(self) -> list[str]:
        out = []
        for name in ("lease_ttl_s", "soft_pin_ttl_s", "client_ttl_s", "put_timeout_s"):
            if getattr(self, name) <= 0:
                out.append(f"{name} must be > 0")
        if not 0.0 < self.high_watermark <= 1.0:
            out.append("high_watermark must be in (0, 1]")
        if not 0.0 < self.eviction_ratio <= 1.0:
            out.append("eviction_ratio must be in (0, 1]")
        if self.max_replicas < 1:
            out.append("max_replicas must be >= 1")
        if self.max_key_bytes < 1:
            out.append("max_key_bytes must be >= 1")
        if self.max_client_bytes < 1:
            out.append("max_client_bytes must be >= 1")
        if self.max_client_segments < 1:
            out.append("max_client_segments must be >= 1")
        return out


@dataclass
class Counters:
    puts_started: int = 0
    puts_completed: int = 0
    puts_revoked: int = 0
    zombies_reclaimed: int = 0
    objects_removed: int = 0
    objects_evicted: int = 0
    bytes_evicted: int = 0
    eviction_runs: int = 0
    allocation_failures: int = 0
    clients_lost: int = 0
    replicas_lost: int = 0
    objects_lost: int = 0
    leases_granted: int = 0


@dataclass(frozen=True)
class Stats:
    capacity: int
    used: int
    objects: int
    complete_objects: int
    segments: int
    clients: int
    counters: Counters


@dataclass(frozen=True)
class TickReport:
    soft_pins_expired: int = 0
    zombies_reclaimed: int = 0
    clients_lost: tuple[str, ...] = ()
    objects_evicted: int = 0
    bytes_evicted: int = 0


@dataclass(frozen=True)
class LossReport:
    """What dropping segments cost: replicas lost, and objects deleted for lack of any."""

    replicas_lost: int = 0
    objects_lost: tuple[str, ...] = ()


@dataclass(frozen=True)
class RestoreReport:
    segments: int
    objects: int
    replicas_dropped: int
    objects_dropped: int
    segments_dropped: int = 0  # malformed segment records


@dataclass
class _Client:
    last_seen: float
    segments: set[str] = field(default_factory=set)


class StoreMaster:
    """See the module docstring."""

    def __init__(self, clock: Clock, rng: Rng, params: MasterParams | None = None,
                 strategy: AllocationStrategy | None = None,
                 eviction: EvictionPolicy | None = None) -> None:
        self.params = params or MasterParams()
        found = self.params.problems()
        if found:
            raise ValueError("; ".join(found))
        self._clock = clock
        self.strategy = strategy or make_strategy("random", rng)
        self.eviction = eviction or make_eviction_policy("sampled_lru", rng)
        self._objects: dict[str, ObjectMeta] = {}
        self._segments: dict[str, Segment] = {}
        self._clients: dict[str, _Client] = {}
        self._by_segment: dict[str, set[str]] = {}  # segment → keys with a replica on it
        self.counters = Counters()
        self._dirty_objects: set[str] = set()
        self._dirty_segments: set[str] = set()

    # -- store clients and segments ----------------------------------------------------

    def mount_segment(self, client_id: str, segment_id: str, base: int, size: int,
                      endpoint: str = "", principal: str = "") -> bool:
        for name, value in (("client_id", client_id), ("segment_id", segment_id)):
            if not value:
                raise InvalidInput(f"{name} must not be empty")
        for name, value in (("client_id", client_id), ("segment_id", segment_id),
                            ("endpoint", endpoint)):
            if len(value.encode()) > self.params.max_key_bytes:
                raise InvalidInput(f"{name} longer than {self.params.max_key_bytes} bytes")
        if size <= 0:
            raise InvalidInput(f"size must be > 0, got {size}")
        if base < 0:
            raise InvalidInput(f"base must be >= 0, got {base}")
        if base + size > ADDRESS_SPACE:
            raise InvalidInput(f"base + size must be <= 2^64 (64-bit addresses), got base "
                               f"{base} + size {size}")
        now = self._clock()
        old = self._segments.get(segment_id)
        if old is not None:
            self._check_principal(old, principal)
            if (old.client_id, old.base, old.size) != (client_id, base, size):
                raise AlreadyExists(
                    f"segment {segment_id!r} is mounted by {old.client_id!r} at base "
                    f"{old.base} with size {old.size}")
            if not old.principal and principal:  # claimed only by a matching remount
                old.principal = principal
                self._dirty_segments.add(segment_id)
            self._clients[client_id].last_seen = now
            if endpoint and endpoint != old.endpoint:
                old.endpoint = endpoint
                self._dirty_segments.add(segment_id)
            return False
        if self.capacity() + size >= ADDRESS_SPACE:
            raise InvalidInput(f"size {size}: the total capacity would reach 2^64 bytes")
        owner = principal or client_id
        owned = [s.size for s in self._segments.values()
                 if (s.principal or s.client_id) == owner]
        if sum(owned) + size > self.params.max_client_bytes:
            raise InvalidInput(
                f"size: {owner} would mount {sum(owned) + size} bytes, over the limit of "
                f"{self.params.max_client_bytes} per client (max_client_bytes)")
        if len(owned) >= self.params.max_client_segments:
            raise InvalidInput(
                f"segment_id: {owner} has {len(owned)} segments mounted, the most one "
                f"client may (max_client_segments; many small segments would attract "
                f"puts as one huge one does)")
        self._segments[segment_id] = Segment(segment_id, client_id, base, size, endpoint,
                                             principal)
        self._by_segment[segment_id] = set()
        client = self._clients.setdefault(client_id, _Client(now))
        client.last_seen = now
        client.segments.add(segment_id)
        self._dirty_segments.add(segment_id)
        return True

    def unmount_segment(self, client_id: str, segment_id: str,
                        principal: str = "") -> LossReport:
        seg = self._segments.get(segment_id)
        if seg is None or seg.client_id != client_id:
            raise NotFound(f"segment {segment_id!r} is not mounted by {client_id!r}")
        self._check_principal(seg, principal)
        return self._drop_segments([segment_id])

    @staticmethod
    def _check_principal(seg: Segment, principal: str) -> None:
        if seg.principal and seg.principal != principal:
            raise Forbidden(f"segment_id: {seg.segment_id!r} belongs to {seg.principal}, "
                            f"not {principal or 'an unauthenticated caller'}")

    def ping(self, client_id: str) -> bool:
        if not client_id:
            raise InvalidInput("client_id must not be empty")
        client = self._clients.get(client_id)
        if client is None:
            return False
        client.last_seen = self._clock()
        return True

    def _drop_segments(self, segment_ids: Iterable[str]) -> LossReport:
        lost_replicas = 0
        lost_objects: list[str] = []
        for sid in segment_ids:
            seg = self._segments.pop(sid)
            self._dirty_segments.add(sid)
            client = self._clients.get(seg.client_id)
            if client is not None:
                client.segments.discard(sid)
                if not client.segments:
                    del self._clients[seg.client_id]
            for key in sorted(self._by_segment.pop(sid, ())):
                obj = self._objects[key]
                keep = []
                for r in obj.replicas:
                    if r.segment_id == sid:
                        r.move(ReplicaState.FAILED)
                        lost_replicas += 1
                    else:
                        keep.append(r)
                obj.replicas = keep
                self._dirty_objects.add(key)
                if not keep:
                    del self._objects[key]
                    lost_objects.append(key)
        self.counters.replicas_lost += lost_replicas
        self.counters.objects_lost += len(lost_objects)
        return LossReport(lost_replicas, tuple(lost_objects))

    # -- writes ---------------------------------------------------------------------------

    def put_start(self, key: str, size: int, replicas: int = 1, pin: Pin = Pin.NONE,
                  preferred_segment: str = "") -> list[ReplicaDescriptor]:
        self._check_key(key)
        if size <= 0:
            raise InvalidInput(f"size must be > 0, got {size}")
        if not 1 <= replicas <= self.params.max_replicas:
            raise InvalidInput(
                f"replicas must be in 1..{self.params.max_replicas}, got {replicas}")
        old = self._objects.get(key)
        if old is not None:
            what = "complete" if old.complete else "being written"
            raise AlreadyExists(f"key {key!r} exists ({what})")
        now = self._clock()
        if not any(s.size >= size for s in self._segments.values()):
            self.counters.allocation_failures += 1
            raise NoSpace(f"no mounted segment can hold {size} bytes "
                          f"({len(self._segments)} segments)")
        placed = self._place(size, replicas, preferred_segment)
        if not placed:
            self._evict(now, max(self._eviction_batch(), size))
            placed = self._place(size, replicas, preferred_segment)
        if not placed:
            self.counters.allocation_failures += 1
            raise NoSpace(f"no segment has {size} contiguous free bytes "
                          f"(used {self.used()} of {self.capacity()})")
        obj = ObjectMeta(key=key, size=size, replicas=placed, put_started_at=now,
                         last_access=now, replicas_wanted=replicas)
        self._apply_pin(obj, pin, now)
        self._objects[key] = obj
        for r in placed:
            self._by_segment[r.segment_id].add(key)
        self._dirty_objects.add(key)
        self.counters.puts_started += 1
        return [self._describe(r) for r in placed]

    def _place(self, size: int, count: int, preferred: str) -> list[Replica]:
        order = self.strategy.order(list(self._segments.values()), size)
        if preferred:
            order.sort(key=lambda s: s.segment_id != preferred)  # stable: preferred first
        placed: list[Replica] = []
        for seg in order:
            if len(placed) == count:
                break
            replica = Replica(seg.segment_id, 0, size)
            offset = seg.space.allocate(size)
            if offset is None:
                replica.move(ReplicaState.FAILED)
                continue
            replica.offset = offset
            replica.move(ReplicaState.PROCESSING)
            placed.append(replica)
        return placed

    def put_end(self, key: str) -> list[ReplicaDescriptor]:
        obj = self._get(key)
        if not obj.complete:
            now = self._clock()
            for r in obj.replicas:
                r.move(ReplicaState.COMPLETE)
            obj.completed_at = now
            obj.last_access = now
            if obj.pin is Pin.SOFT:
                obj.soft_pin_until = now + self.params.soft_pin_ttl_s
            self._dirty_objects.add(key)
            self.counters.puts_completed += 1
        return [self._describe(r) for r in obj.replicas]

    def put_revoke(self, key: str) -> None:
        obj = self._get(key)
        if obj.complete:
            raise WrongState(f"key {key!r} is complete; use remove")
        self._delete(obj)
        self.counters.puts_revoked += 1

    # -- reads ----------------------------------------------------------------------------

    def get_replica_list(self, key: str) -> list[ReplicaDescriptor]:
        obj = self._get(key)
        if not obj.complete:
            raise NotReady(f"key {key!r} is still being written")
        self._grant_lease(obj, self._clock())
        return [self._describe(r) for r in obj.replicas if r.state is ReplicaState.COMPLETE]

    def exist_key(self, key: str) -> bool:
        self._check_key(key)
        obj = self._objects.get(key)
        if obj is None or not obj.complete:
            return False
        self._grant_lease(obj, self._clock())
        return True

    def batch_exist_key(self, keys: Sequence[str]) -> list[bool]:
        for i, k in enumerate(keys):
            try:
                self._check_key(k)
            except InvalidInput as exc:
                raise InvalidInput(f"keys[{i}]: {exc}") from None
        return [self.exist_key(k) for k in keys]

    def _grant_lease(self, obj: ObjectMeta, now: float) -> None:
        obj.lease_until = max(obj.lease_until, now + self.params.lease_ttl_s)
        obj.last_access = now
        if obj.pin is Pin.SOFT:
            obj.soft_pin_until = max(obj.soft_pin_until, now + self.params.soft_pin_ttl_s)
        self.counters.leases_granted += 1

    # -- removal and pins -----------------------------------------------------------------

    def remove(self, key: str) -> None:
        obj = self._get(key)
        now = self._clock()
        if not obj.complete:
            raise NotReady(f"key {key!r} is still being written; use put_revoke")
        if obj.leased(now):
            raise Leased(f"key {key!r} is leased for another {obj.lease_until - now:.3f} s")
        self._delete(obj)
        self.counters.objects_removed += 1

    def remove_all(self) -> int:
        now = self._clock()
        victims = [o for o in self._objects.values() if o.complete and not o.leased(now)]
        for obj in victims:
            self._delete(obj)
        self.counters.objects_removed += len(victims)
        return len(victims)

    def set_pin(self, key: str, pin: Pin) -> None:
        obj = self._get(key)
        self._apply_pin(obj, pin, self._clock())
        self._dirty_objects.add(key)

    def _apply_pin(self, obj: ObjectMeta, pin: Pin, now: float) -> None:
        obj.pin = pin
        obj.soft_pin_until = now + self.params.soft_pin_ttl_s if pin is Pin.SOFT else 0.0

    # -- eviction -------------------------------------------------------------------------

    def _eviction_batch(self) -> int:
        return math.ceil(self.params.eviction_ratio * self.capacity())

    def _evict(self, now: float, need: int) -> tuple[int, int]:
        """Frees at least ``need`` bytes if eligible objects allow; (objects, bytes)."""
        plain: list[Candidate] = []
        soft: list[Candidate] = []
        for obj in self._objects.values():
            if not obj.complete or obj.leased(now) or obj.pin is Pin.HARD:
                continue
            c = Candidate(obj.key, obj.bytes_held(), obj.last_access)
            if obj.pin is Pin.SOFT and obj.soft_pin_until > now:
                soft.append(c)
            else:
                plain.append(c)
        self.counters.eviction_runs += 1
        freed = count = 0
        for group in (plain, soft):
            if freed >= need:
                break
            for key in self.eviction.select(group, need - freed):
                obj = self._objects[key]
                freed += obj.bytes_held()
                count += 1
                self._delete(obj)
        self.counters.objects_evicted += count
        self.counters.bytes_evicted += freed
        return count, freed

    # -- periodic work --------------------------------------------------------------------

    def tick(self, now: float | None = None) -> TickReport:
        if now is None:
            now = self._clock()
        expired = 0
        zombies = []
        for obj in self._objects.values():
            if obj.pin is Pin.SOFT and obj.soft_pin_until <= now:
                obj.pin, obj.soft_pin_until = Pin.NONE, 0.0
                self._dirty_objects.add(obj.key)
                expired += 1
            if not obj.complete and obj.put_started_at + self.params.put_timeout_s <= now:
                zombies.append(obj)
        for obj in zombies:
            self._delete(obj)
        self.counters.zombies_reclaimed += len(zombies)
        lost = sorted(c for c, st in self._clients.items()
                      if st.last_seen + self.params.client_ttl_s <= now)
        for client_id in lost:
            self._drop_segments(sorted(self._clients[client_id].segments))
        self.counters.clients_lost += len(lost)
        evicted = freed = 0
        capacity = self.capacity()
        used = self.used()
        if capacity and used >= self.params.high_watermark * capacity:
            need = max(self._eviction_batch(),
                       math.ceil(used - self.params.high_watermark * capacity))
            evicted, freed = self._evict(now, need)
        return TickReport(expired, len(zombies), tuple(lost), evicted, freed)

    # -- introspection --------------------------------------------------------------------

    def capacity(self) -> int:
        return sum(s.size for s in self._segments.values())

    def used(self) -> int:
        return sum(s.space.used for s in self._segments.values())

    def stats(self) -> Stats:
        complete = sum(1 for o in self._objects.values() if o.complete)
        return Stats(self.capacity(), self.used(), len(self._objects), complete,
                     len(self._segments), len(self._clients), copy.copy(self.counters))

    def get_object(self, key: str) -> ObjectMeta | None:
        obj = self._objects.get(key)
        return None if obj is None else copy.deepcopy(obj)

    def lease_until(self, key: str) -> float:
        """When ``key``'s read lease ends (0.0: never leased); NotFound for unknown keys."""
        return self._get(key).lease_until

    def keys(self) -> list[str]:
        return sorted(self._objects)

    def segment(self, segment_id: str) -> Segment | None:
        return self._segments.get(segment_id)

    # -- persistence ----------------------------------------------------------------------

    def drain_changes(self) -> Changes:
        out = Changes()
        for key in self._dirty_objects:
            obj = self._objects.get(key)
            out.objects[key] = None if obj is None else object_record(obj)
        for sid in self._dirty_segments:
            seg = self._segments.get(sid)
            out.segments[sid] = None if seg is None else segment_record(seg)
        self._dirty_objects.clear()
        self._dirty_segments.clear()
        return out

    def snapshot(self) -> Changes:
        return Changes({k: object_record(o) for k, o in self._objects.items()},
                       {s: segment_record(g) for s, g in self._segments.items()})

    def restore(self, segments: Iterable[Record], objects: Iterable[Record]) -> RestoreReport:
        if self._objects or self._segments:
            raise WrongState("restore needs an empty master")
        now = self._clock()
        segments_dropped = 0
        bad_segments: set[str] = set()
        for rec in segments:
            try:
                self.mount_segment(str(rec["client_id"]), str(rec["segment_id"]),
                                   int(rec["base"]), int(rec["size"]),
                                   str(rec.get("endpoint", "")),
                                   str(rec.get("principal", "")))
            except (StoreError, KeyError, TypeError, ValueError):
                segments_dropped += 1
                bad_segments.add(str(rec.get("segment_id", "")))
        n_objects = replicas_dropped = objects_dropped = 0
        for rec in objects:
            try:
                obj = object_from_record(rec)
            except ValueError:
                objects_dropped += 1
                self._dirty_objects.add(str(rec.get("key", "")))
                continue
            keep = []
            for r in obj.replicas:
                seg = self._segments.get(r.segment_id)
                ok = (r.state in (ReplicaState.PROCESSING, ReplicaState.COMPLETE)
                      and seg is not None and r.size == obj.size
                      and seg.space.reserve(r.offset, r.size))
                if ok:
                    keep.append(r)
                else:
                    replicas_dropped += 1
            if not keep or obj.key in self._objects:
                for r in keep:
                    self._segments[r.segment_id].space.free(r.offset, r.size)
                objects_dropped += 1
                self._dirty_objects.add(obj.key)
                continue
            if len(keep) != len(obj.replicas):
                self._dirty_objects.add(obj.key)
            obj.replicas = keep
            if obj.complete:
                obj.lease_until = now + self.params.lease_ttl_s
            if obj.pin is Pin.SOFT:
                obj.soft_pin_until = max(obj.soft_pin_until, now + self.params.soft_pin_ttl_s)
            self._objects[obj.key] = obj
            for r in keep:
                self._by_segment[r.segment_id].add(obj.key)
            n_objects += 1
        self._dirty_segments = {sid for sid in bad_segments
                                if sid and sid not in self._segments}  # delete those
        self._dirty_objects.discard("")
        return RestoreReport(len(self._segments), n_objects, replicas_dropped, objects_dropped,
                             segments_dropped)

    # -- helpers --------------------------------------------------------------------------

    def _check_key(self, key: str) -> None:
        if not key:
            raise InvalidInput("key must not be empty")
        if len(key.encode()) > self.params.max_key_bytes:
            raise InvalidInput(f"key longer than {self.params.max_key_bytes} bytes")

    def _get(self, key: str) -> ObjectMeta:
        self._check_key(key)
        obj = self._objects.get(key)
        if obj is None:
            raise NotFound(f"key {key!r} not found")
        return obj

    def _delete(self, obj: ObjectMeta) -> None:
        """Releases every replica (→ REMOVED) and forgets the object."""
        for r in obj.replicas:
            r.move(ReplicaState.REMOVED)
            self._segments[r.segment_id].space.free(r.offset, r.size)
            self._by_segment[r.segment_id].discard(obj.key)
        obj.replicas = []
        del self._objects[obj.key]
        self._dirty_objects.add(obj.key)

    def _describe(self, r: Replica) -> ReplicaDescriptor:
        seg = self._segments[r.segment_id]
        return ReplicaDescriptor(seg.segment_id, seg.client_id, seg.endpoint, r.offset,
                                 seg.base + r.offset, r.size, r.state)
