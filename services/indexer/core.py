"""The indexer's pure core: which worker holds which KV blocks, per tier.

No grpc, redis or asyncio. Blocks are identified by kvmesh's chained block hashes
(``services.common.block_hash``), which each identify a whole prefix, so the radix tree
collapses to one map ``hash → {worker: tiers}``; a prompt's overlap with a worker is the
length of the leading run of its hashes that the worker holds.

Contract of :class:`KvIndex`:

- ``apply(event)`` applies one :class:`KvEvent` of a worker. Events of a worker are
  numbered from 0 without holes; an event whose id is not the next one is not applied and
  a :class:`Gap` (expected, got) is returned, so the caller can ask for a resync. An event
  id already applied is ignored (redelivery). Returns None when applied.
- ``resync(worker, event_id, blocks)`` replaces a worker's whole state by a full dump
  taken at ``event_id`` (the next expected id becomes ``event_id + 1``).
- ``remove_worker(worker)`` drops all of a worker's blocks (its etcd lease went).
- ``find_matches(hashes)`` returns, per worker holding at least the first block, an
  :class:`Overlap`: the leading run in any tier and per tier.
- ``dump()`` is the exact state, for comparisons and debugging; ``stats()`` sizes;
  ``workers()`` the workers holding at least one block (cheaper than ``dump()``).

Contract of :class:`Incarnations` (which process of a worker id the index follows; a
worker id outlives its processes, and each process numbers its events from 0 again). An
incarnation is the process's ``started_at_ms`` (the KV messages' field, the same as its
etcd record's); a larger one is a later process; 0 means unknown (an older producer, or
a record without it) and never filters anything.

- ``admit(worker, incarnation)`` decides on one message (an event batch or a full state)
  of ``worker`` from ``incarnation``: :attr:`Admission.CURRENT` (the incarnation followed
  now, or 0: apply by event ids as usual); :attr:`Admission.FIRST` (no incarnation
  followed yet) and :attr:`Admission.NEWER` (a later process than the one followed): the
  caller drops the worker's blocks *and* its event-id state, then applies the message,
  and the incarnation becomes the followed one; :attr:`Admission.STALE` (older than the
  one followed, or than the live etcd record's): the caller ignores the message.
- ``record_seen(worker, incarnation, restarted)``: the live etcd record of ``worker``
  names ``incarnation`` (0: none); ``restarted`` says it replaced a record of another
  process (pid or start time changed). Returns True when the caller must drop the
  worker's index entry now: the record names a later process than the one the index
  follows, or it replaced another process's record and the index follows no incarnation
  (then, too, when the record names none: the behaviour without incarnations). A
  restarted record of the process the index already follows (its events can reach the
  stream before its record reaches etcd) or of an older one drops nothing. Messages of
  incarnations older than the record's are STALE from then on.
- ``forget(worker)``: the worker left etcd; what was known about it is dropped.
- ``current(worker)``: the incarnation followed (0: none); ``live(worker)``: the one its
  live record names (0: none).

Internals (for speed; ``bench/indexer`` measures them): each block maps to the *interned*
frozenset of workers holding it in any tier (one shared object per distinct set, refcounted
so sets of departed workers are freed). ``find_matches`` walks the prompt with one dict
lookup and one identity test per block while the holder set does not change, intersects
only when it does, and stops at the first block nobody alive holds. Per-tier runs are
computed only for workers that hold blocks outside the device tier; a device-only worker's
``by_tier`` is ``{"device": blocks}``. Semantics do not depend on any of this.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

TIERS = ("device", "host", "store")
DEVICE = TIERS[0]
_NON_DEVICE = TIERS[1:]


@dataclass(frozen=True)
class KvEvent:
    """One worker event. ``kind``: "stored", "removed" or "cleared" (all blocks)."""

    worker_id: str
    event_id: int
    kind: str
    block_hashes: tuple[int, ...] = ()
    tier: str = "device"


@dataclass(frozen=True)
class Gap:
    """Events ``expected`` .. ``got - 1`` of ``worker_id`` are missing."""

    worker_id: str
    expected: int
    got: int


@dataclass(frozen=True)
class Overlap:
    """Leading blocks of a prompt a worker holds: in any tier, and per tier."""

    worker_id: str
    blocks: int
    by_tier: dict[str, int] = field(default_factory=dict)


class KvIndex:
    """See the module docstring."""

    def __init__(self) -> None:
        # block → interned frozenset of the workers holding it in any tier
        self._any: dict[int, frozenset[str]] = {}
        # interning of those sets: canonical object and how many blocks map to it
        self._canon: dict[frozenset[str], frozenset[str]] = {}
        self._refs: dict[frozenset[str], int] = {}
        self._by_worker: dict[str, dict[str, set[int]]] = {}
        self._multi_tier: set[str] = set()  # workers with blocks outside the device tier
        self._next_event: dict[str, int] = {}

    def apply(self, event: KvEvent) -> Gap | None:
        """Applies ``event`` or reports the gap before it."""
        kind = event.kind
        if kind not in ("stored", "removed", "cleared"):
            raise ValueError(f"unknown event kind {kind!r}")
        if event.tier not in TIERS:
            raise ValueError(f"unknown tier {event.tier!r}")
        worker = event.worker_id
        expected = self._next_event.get(worker, 0)
        if event.event_id != expected:
            if event.event_id < expected:
                return None  # already applied (redelivery)
            return Gap(worker, expected, event.event_id)
        self._next_event[worker] = expected + 1
        if kind == "stored":
            self._add(worker, event.tier, event.block_hashes)
        elif kind == "removed":
            self._remove(worker, event.tier, event.block_hashes)
        else:
            self._clear(worker)
        return None

    def next_event_id(self, worker: str) -> int:
        """The event id the index expects next from ``worker``."""
        return self._next_event.get(worker, 0)

    def resync(self, worker: str, event_id: int,
               blocks: dict[str, Iterable[int]]) -> None:
        """Replaces ``worker``'s state by a dump taken at ``event_id``."""
        for tier in blocks:
            if tier not in TIERS:
                raise ValueError(f"unknown tier {tier!r}")
        self._clear(worker)
        for tier, hashes in blocks.items():
            self._add(worker, tier, tuple(hashes))
        self._next_event[worker] = event_id + 1

    def remove_worker(self, worker: str) -> None:
        """Forgets ``worker`` and its blocks."""
        self._clear(worker)
        self._by_worker.pop(worker, None)
        self._next_event.pop(worker, None)

    # -- interned holder sets ------------------------------------------------------------

    def _intern(self, workers: frozenset[str]) -> frozenset[str]:
        canon = self._canon.get(workers)
        if canon is None:
            canon = self._canon[workers] = workers
        return canon

    def _move(self, old: frozenset[str] | None, new: frozenset[str] | None, n: int) -> None:
        """``n`` blocks went from holder set ``old`` to ``new`` (None: no holder)."""
        refs = self._refs
        if new is not None:
            refs[new] = refs.get(new, 0) + n
        if old is not None:
            left = refs[old] - n
            if left:
                refs[old] = left
            else:
                del refs[old]
                del self._canon[old]

    # -- updates -----------------------------------------------------------------------

    def _add(self, worker: str, tier: str, hashes: Sequence[int]) -> None:
        tiers = self._by_worker.setdefault(worker, {})
        mine = tiers.get(tier)
        if mine is None:
            mine = tiers[tier] = set()
        if tier != DEVICE and hashes:
            self._multi_tier.add(worker)
        holders = self._any
        # consecutive blocks usually share their holder set: reuse the transition
        last_old: frozenset[str] | None = None
        last_new: frozenset[str] = frozenset()  # set before its first use (moved == 0)
        moved = 0
        for h in hashes:
            if h in mine:
                continue
            mine.add(h)
            old = holders.get(h)
            if old is not None and worker in old:
                continue  # already held in another tier
            if moved == 0 or old is not last_old:
                if moved:
                    self._move(last_old, last_new, moved)
                    moved = 0
                last_old = old
                last_new = self._intern(frozenset((worker,)) if old is None
                                        else old | {worker})
            holders[h] = last_new
            moved += 1
        if moved:
            self._move(last_old, last_new, moved)

    def _remove(self, worker: str, tier: str, hashes: Sequence[int]) -> None:
        tiers = self._by_worker.get(worker)
        mine = tiers.get(tier) if tiers else None
        if not mine:
            return
        assert tiers is not None
        others = [hs for t, hs in tiers.items() if t != tier and hs]
        holders = self._any
        last_old: frozenset[str] | None = None
        last_new: frozenset[str] | None = None
        moved = 0
        for h in hashes:
            if h not in mine:
                continue
            mine.discard(h)
            if others and any(h in hs for hs in others):
                continue  # still held in another tier
            old = holders[h]
            if moved == 0 or old is not last_old:
                if moved:
                    self._move(last_old, last_new, moved)
                    moved = 0
                last_old = old
                rest = old - {worker}
                last_new = self._intern(rest) if rest else None
            if last_new is None:
                del holders[h]
            else:
                holders[h] = last_new
            moved += 1
        if moved:
            self._move(last_old, last_new, moved)
        if tier != DEVICE and not any(tiers.get(t) for t in _NON_DEVICE):
            self._multi_tier.discard(worker)

    def _clear(self, worker: str) -> None:
        for tier, hashes in list(self._by_worker.get(worker, {}).items()):
            self._remove(worker, tier, tuple(hashes))
        self._by_worker[worker] = {}
        self._multi_tier.discard(worker)

    # -- queries -----------------------------------------------------------------------

    def find_matches(self, hashes: Sequence[int]) -> dict[str, Overlap]:
        """Per-worker leading overlap of ``hashes`` (workers without the first block are
        absent)."""
        if not hashes:
            return {}
        get = self._any.get
        alive = get(hashes[0])
        if alive is None:
            return {}
        # Overlaps are built as Overlap(w, n, {"device": n}) without the frozen dataclass
        # __init__ (2x faster); multi-tier workers get their by_tier at the end.
        new = object.__new__
        out: dict[str, Overlap] = {}
        end = len(hashes)
        for i, h in enumerate(hashes):
            held = get(h)
            if held is alive:
                continue  # the common case: the same holders as the block before
            if held is None:
                end = i
                break
            both = alive & held
            if len(both) == len(alive):
                continue  # everyone alive holds it (and some others too)
            for w in alive:
                if w not in both:  # w's run ends here
                    o = out[w] = new(Overlap)
                    d = o.__dict__
                    d["worker_id"], d["blocks"], d["by_tier"] = w, i, {DEVICE: i}
            if not both:
                end = i
                break
            alive = self._canon.get(both, both)
        for w in alive:  # never in out: alive only shrinks
            o = out[w] = new(Overlap)
            d = o.__dict__
            d["worker_id"], d["blocks"], d["by_tier"] = w, end, {DEVICE: end}
        if self._multi_tier:
            for w in self._multi_tier.intersection(out):
                o = out[w]
                o.__dict__["by_tier"] = self._tier_runs(w, hashes, o.blocks)
        return out

    def _tier_runs(self, worker: str, hashes: Sequence[int], limit: int) -> dict[str, int]:
        """Leading run of ``hashes[:limit]`` per non-empty tier of ``worker``."""
        tiers = self._by_worker[worker]
        out: dict[str, int] = {}
        for t in TIERS:
            hs = tiers.get(t)
            if not hs:
                continue
            n = 0
            while n < limit and hashes[n] in hs:
                n += 1
            if n:
                out[t] = n
        return out

    def workers(self) -> set[str]:
        """Workers holding at least one block, in any tier."""
        return {w for w, tiers in self._by_worker.items() if any(tiers.values())}

    def dump(self) -> dict[str, dict[str, frozenset[int]]]:
        """worker → tier → block hashes (non-empty tiers only)."""
        return {w: {t: frozenset(hs) for t, hs in tiers.items() if hs}
                for w, tiers in self._by_worker.items() if any(tiers.values())}

    def stats(self) -> dict[str, int]:
        """Sizes: distinct blocks, workers, (worker, tier, block) entries."""
        entries = sum(len(hs) for tiers in self._by_worker.values() for hs in tiers.values())
        return {"blocks": len(self._any), "workers": len(self.workers()), "entries": entries}


class Admission(Enum):
    """What to do with a message of some incarnation (see :class:`Incarnations`)."""

    CURRENT = "current"  # apply by event ids
    FIRST = "first"  # forget the worker's blocks and event ids, then apply
    NEWER = "newer"  # a new process: forget the worker's blocks and event ids, then apply
    STALE = "stale"  # an older process: ignore


class Incarnations:
    """See the module docstring."""

    def __init__(self) -> None:
        self._current: dict[str, int] = {}  # worker → incarnation the index follows
        self._live: dict[str, int] = {}  # worker → incarnation of its live etcd record

    def current(self, worker: str) -> int:
        """The incarnation the index follows for ``worker`` (0: none)."""
        return self._current.get(worker, 0)

    def live(self, worker: str) -> int:
        """The incarnation the live etcd record of ``worker`` names (0: none)."""
        return self._live.get(worker, 0)

    def admit(self, worker: str, incarnation: int) -> Admission:
        """The decision on one message of ``worker`` sent by ``incarnation``."""
        if incarnation <= 0:
            return Admission.CURRENT
        followed = self._current.get(worker, 0)
        if incarnation == followed:
            return Admission.CURRENT
        if incarnation < followed or incarnation < self._live.get(worker, 0):
            return Admission.STALE
        self._current[worker] = incarnation
        return Admission.NEWER if followed else Admission.FIRST

    def record_seen(self, worker: str, incarnation: int, restarted: bool) -> bool:
        """Notes ``worker``'s live record; True when its index entry must be dropped."""
        followed = self._current.get(worker, 0)
        if incarnation > 0:
            self._live[worker] = incarnation
        else:
            self._live.pop(worker, None)
        if incarnation <= 0:
            drop = restarted  # no incarnation to go by: the record change decides
        else:  # drop what the index follows of an older process (or of none, on a restart)
            drop = followed < incarnation and (restarted or followed > 0)
        if drop:
            self._current.pop(worker, None)
        return drop

    def forget(self, worker: str) -> None:
        """Drops what is known about ``worker`` (it left etcd)."""
        self._current.pop(worker, None)
        self._live.pop(worker, None)
