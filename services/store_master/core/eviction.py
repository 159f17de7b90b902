"""Which objects to evict: policies behind one small interface.

When eviction runs and how much it frees is the master's business (``master.py``): above
the high watermark it asks to free ``max(eviction_ratio × capacity, used − high_watermark ×
capacity)`` bytes, first from unpinned candidates, then from soft-pinned ones. Candidates
are only objects that are COMPLETE, not leased and not hard-pinned.

Contract of an :class:`EvictionPolicy`: ``select(candidates, need_bytes)`` returns keys of
distinct candidates, in eviction order, whose bytes add up to at least ``need_bytes`` (or
all candidates when they hold less). It never returns anything not among the candidates.

- ``lru``: exact LRU, oldest ``last_access`` first (ties by key).
- ``sampled_lru`` (default; approximate LRU as Mooncake and Redis do it): repeatedly draw
  ``sample`` candidates at random and evict the least recently used of the draw. With
  ``sample >= len(candidates)`` it is exact LRU; smaller samples cost O(sample) per victim
  instead of a full sort, and still pick among the older objects with high probability.

:func:`make_eviction_policy` is the registry (names in :data:`POLICIES`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from services.common.injected import Rng


@dataclass(frozen=True)
class Candidate:
    key: str
    size: int  # bytes freed by evicting it (all its replicas)
    last_access: float


class EvictionPolicy(Protocol):
    name: str

    def select(self, candidates: Sequence[Candidate], need_bytes: int) -> list[str]:
        ...


class LruPolicy:
    name = "lru"

    def select(self, candidates: Sequence[Candidate], need_bytes: int) -> list[str]:
        out: list[str] = []
        freed = 0
        for c in sorted(candidates, key=lambda c: (c.last_access, c.key)):
            if freed >= need_bytes:
                break
            out.append(c.key)
            freed += c.size
        return out


class SampledLruPolicy:
    name = "sampled_lru"

    def __init__(self, rng: Rng, sample: int = 8) -> None:
        if sample < 1:
            raise ValueError("sample must be >= 1")
        self._rng = rng
        self.sample = sample

    def select(self, candidates: Sequence[Candidate], need_bytes: int) -> list[str]:
        pool = sorted(candidates, key=lambda c: c.key)  # deterministic for a seeded rng
        out: list[str] = []
        freed = 0
        while pool and freed < need_bytes:
            idx: Sequence[int] = range(len(pool))
            if len(pool) > self.sample:
                idx = self._rng.sample(idx, self.sample)
            best = min(idx, key=lambda i: (pool[i].last_access, pool[i].key))
            victim = pool[best]
            pool[best] = pool[-1]
            pool.pop()
            out.append(victim.key)
            freed += victim.size
        return out


POLICIES: dict[str, Callable[[Rng, int], EvictionPolicy]] = {
    LruPolicy.name: lambda _rng, _sample: LruPolicy(),
    SampledLruPolicy.name: SampledLruPolicy,
}


def make_eviction_policy(name: str, rng: Rng, sample: int = 8) -> EvictionPolicy:
    """The policy called ``name`` drawing from ``rng``; ValueError for an unknown name."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; "
                         f"known: {', '.join(sorted(POLICIES))}") from None
    return factory(rng, sample)
