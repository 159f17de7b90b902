"""Other router replicas' in-flight load (router replica sync), as a pure table.

Several routers (e.g. one embedded in each frontend replica) route to the same workers.
Each counts only its own in-flight requests; :mod:`services.router.replica_sync` carries
every replica's per-worker sums (:class:`Share`) to the others, which keep them here and
add them to their own counts (:class:`~services.router.core.RouterCore`), so two
replicas do not pile onto one worker. Dynamo's router replica sync does the same with
its active sequences.

Contract of :class:`PeerLoads` (no clock of its own: callers pass ``now``):

- ``update(replica_id, seq, shares, now)`` replaces that replica's shares (worker id →
  :class:`Share`; a worker absent from ``shares`` has none) when ``seq`` is newer than the
  last one applied for it, and returns True; an older or repeated ``seq`` changes nothing
  and returns False. Either way the replica counts as heard from at ``now``.
- ``drop(replica_id, seq=0)`` forgets a replica (it left; ``seq``: its leaving message's);
  False when unknown.
- ``expire(now, timeout_s)`` forgets every replica not heard from for more than
  ``timeout_s`` (it died or its sync broke) and returns their ids, sorted.
- A forgotten replica leaves a tombstone (its last ``seq``, the latest
  :data:`TOMBSTONES` replicas kept): a snapshot of it that arrives late, at or below that
  ``seq``, is ignored rather than bringing it back.
- ``totals()`` is the sum of every replica's shares per worker (a worker with no share
  is absent); ``replicas()`` the known replica ids, sorted; ``knows(replica_id)``
  whether one is known; ``count()`` how many (one ``len``: safe from another thread).
- ``keep_only(worker_ids)`` drops shares of workers that left discovery.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

TOMBSTONES = 1024


@dataclass(frozen=True)
class Share:
    """One replica's in-flight load on one worker (the fields of ``WorkerShare``)."""

    in_flight: int = 0
    active_blocks: int = 0
    pending_prefill_tokens: int = 0
    decoding_alone: int = 0

    def __add__(self, other: Share) -> Share:
        return Share(self.in_flight + other.in_flight,
                     self.active_blocks + other.active_blocks,
                     self.pending_prefill_tokens + other.pending_prefill_tokens,
                     self.decoding_alone + other.decoding_alone)


@dataclass
class _Peer:
    seq: int
    heard_at: float
    shares: dict[str, Share]


@dataclass
class PeerLoads:
    """The other replicas' shares; see the module docstring."""

    _peers: dict[str, _Peer] = field(default_factory=dict)
    _totals: dict[str, Share] | None = None
    _gone: dict[str, int] = field(default_factory=dict)  # replica id → its last seq

    def update(self, replica_id: str, seq: int, shares: Mapping[str, Share],
               now: float) -> bool:
        if seq <= self._gone.get(replica_id, -1):
            return False  # a late snapshot of a replica that left or expired
        peer = self._peers.get(replica_id)
        if peer is not None:
            peer.heard_at = now
            if seq <= peer.seq:
                return False
        self._peers[replica_id] = _Peer(seq, now, dict(shares))
        self._totals = None
        return True

    def drop(self, replica_id: str, seq: int = 0) -> bool:
        peer = self._peers.pop(replica_id, None)
        self._gone[replica_id] = max(seq, self._gone.get(replica_id, 0),
                                     peer.seq if peer is not None else 0)
        while len(self._gone) > TOMBSTONES:
            del self._gone[next(iter(self._gone))]
        if peer is None:
            return False
        self._totals = None
        return True

    def expire(self, now: float, timeout_s: float) -> list[str]:
        gone = sorted(r for r, p in self._peers.items() if now - p.heard_at > timeout_s)
        for r in gone:
            self.drop(r)
        return gone

    def keep_only(self, worker_ids: Collection[str]) -> None:
        for peer in self._peers.values():
            for wid in [w for w in peer.shares if w not in worker_ids]:
                del peer.shares[wid]
                self._totals = None

    def knows(self, replica_id: str) -> bool:
        return replica_id in self._peers

    def count(self) -> int:
        return len(self._peers)

    def replicas(self) -> list[str]:
        return sorted(self._peers)

    def totals(self) -> Mapping[str, Share]:
        if self._totals is None:
            out: dict[str, Share] = {}
            for peer in self._peers.values():
                for wid, share in peer.shares.items():
                    out[wid] = out.get(wid, Share()) + share
            self._totals = out
        return self._totals
