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
- ``dump()`` is the exact state, for comparisons and debugging; ``stats()`` sizes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

TIERS = ("device", "host", "store")


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
        self._holders: dict[int, dict[str, set[str]]] = {}
        self._by_worker: dict[str, dict[str, set[int]]] = {}
        self._next_event: dict[str, int] = {}

    def apply(self, event: KvEvent) -> Gap | None:
        """Applies ``event`` or reports the gap before it."""
        if event.kind not in ("stored", "removed", "cleared"):
            raise ValueError(f"unknown event kind {event.kind!r}")
        if event.tier not in TIERS:
            raise ValueError(f"unknown tier {event.tier!r}")
        expected = self._next_event.get(event.worker_id, 0)
        if event.event_id < expected:
            return None  # already applied (redelivery)
        if event.event_id > expected:
            return Gap(event.worker_id, expected, event.event_id)
        self._next_event[event.worker_id] = expected + 1
        if event.kind == "stored":
            self._add(event.worker_id, event.tier, event.block_hashes)
        elif event.kind == "removed":
            self._remove(event.worker_id, event.tier, event.block_hashes)
        else:
            self._clear(event.worker_id)
        return None

    def next_event_id(self, worker: str) -> int:
        """The event id the index expects next from ``worker``."""
        return self._next_event.get(worker, 0)

    def resync(self, worker: str, event_id: int,
               blocks: dict[str, Iterable[int]]) -> None:
        """Replaces ``worker``'s state by a dump taken at ``event_id``."""
        self._clear(worker)
        for tier, hashes in blocks.items():
            if tier not in TIERS:
                raise ValueError(f"unknown tier {tier!r}")
            self._add(worker, tier, tuple(hashes))
        self._next_event[worker] = event_id + 1

    def remove_worker(self, worker: str) -> None:
        """Forgets ``worker`` and its blocks."""
        self._clear(worker)
        self._by_worker.pop(worker, None)
        self._next_event.pop(worker, None)

    def _add(self, worker: str, tier: str, hashes: Sequence[int]) -> None:
        mine = self._by_worker.setdefault(worker, {}).setdefault(tier, set())
        for h in hashes:
            mine.add(h)
            self._holders.setdefault(h, {}).setdefault(worker, set()).add(tier)

    def _remove(self, worker: str, tier: str, hashes: Sequence[int]) -> None:
        mine = self._by_worker.get(worker, {}).get(tier)
        for h in hashes:
            if mine is not None:
                mine.discard(h)
            holders = self._holders.get(h)
            if holders is None or worker not in holders:
                continue
            holders[worker].discard(tier)
            if not holders[worker]:
                del holders[worker]
            if not holders:
                del self._holders[h]

    def _clear(self, worker: str) -> None:
        for tier, hashes in list(self._by_worker.get(worker, {}).items()):
            self._remove(worker, tier, tuple(hashes))
        self._by_worker[worker] = {}

    def find_matches(self, hashes: Sequence[int]) -> dict[str, Overlap]:
        """Per-worker leading overlap of ``hashes`` (workers without the first block are
        absent)."""
        if not hashes:
            return {}
        first = self._holders.get(hashes[0])
        if not first:
            return {}
        any_run = {w: 0 for w in first}
        tier_run = {w: {t: 0 for t in TIERS} for w in first}
        alive_any = set(first)
        alive_tier = {w: set(TIERS) for w in first}
        for h in hashes:
            holders = self._holders.get(h, {})
            alive_any &= holders.keys()
            for w in list(alive_tier):
                tiers = holders.get(w, set())
                alive_tier[w] &= tiers
                for t in alive_tier[w]:
                    tier_run[w][t] += 1
                if not alive_tier[w]:
                    del alive_tier[w]
            for w in alive_any:
                any_run[w] += 1
            if not alive_any:
                break
        return {w: Overlap(w, any_run[w], {t: n for t, n in tier_run[w].items() if n})
                for w in first}

    def dump(self) -> dict[str, dict[str, frozenset[int]]]:
        """worker → tier → block hashes (non-empty tiers only)."""
        return {w: {t: frozenset(hs) for t, hs in tiers.items() if hs}
                for w, tiers in self._by_worker.items() if any(tiers.values())}

    def stats(self) -> dict[str, int]:
        """Sizes: distinct blocks, workers, (worker, tier, block) entries."""
        entries = sum(len(hs) for tiers in self._by_worker.values() for hs in tiers.values())
        return {"blocks": len(self._holders), "workers": len(self.dump()), "entries": entries}
