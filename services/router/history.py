"""What the router believes each worker has cached, learned from its own decisions.

A worker that served a prompt keeps that prompt's full blocks in its prefix cache until
they are evicted. Without engine events (the indexer comes later) the router can still
estimate overlap from that history, as SGLang's approximate policy does.

Contract of :class:`PrefixHistory` (pure, no clock needed: order is recency):

- ``record(worker, hashes)`` marks the chained block hashes as recently cached on
  ``worker``; each worker keeps at most ``max_blocks_per_worker`` (LRU).
- ``overlap(worker, hashes)`` is the number of leading hashes the worker holds.
- ``drop(worker)`` forgets a worker (gone from discovery).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PrefixHistory:
    """Per-worker LRU sets of block hashes."""

    def __init__(self, max_blocks_per_worker: int = 65536) -> None:
        if max_blocks_per_worker < 1:
            raise ValueError("max_blocks_per_worker must be >= 1")
        self._cap = max_blocks_per_worker
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def record(self, worker: str, hashes: Sequence[int]) -> None:
        """Marks ``hashes`` as cached on ``worker`` (most recent last)."""
        lru = self._blocks.setdefault(worker, OrderedDict())
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self._cap:
            lru.popitem(last=False)

    def overlap(self, worker: str, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` cached on ``worker``."""
        lru = self._blocks.get(worker)
        if not lru:
            return 0
        n = 0
        for h in hashes:
            if h not in lru:
                break
            n += 1
        return n

    def drop(self, worker: str) -> None:
        """Forgets ``worker``."""
        self._blocks.pop(worker, None)

    def keep_only(self, workers: Iterable[str]) -> None:
        """Forgets every worker not in ``workers``."""
        alive = set(workers)
        for w in [w for w in self._blocks if w not in alive]:
            del self._blocks[w]

    def size(self, worker: str) -> int:
        """Blocks remembered for ``worker``."""
        return len(self._blocks.get(worker, ()))
