"""Space inside segments, and where replicas go.

Contract of :class:`RangeAllocator` (one per mounted segment; offsets are relative to the
segment's start, sizes in bytes):

- ``allocate(size)`` → the lowest offset of a free run of at least ``size`` bytes (first
  fit over a free list sorted by offset), or None when no run is large enough.
- ``free(offset, size)`` returns a range given out before; it is merged with free
  neighbours (coalescing), so freeing everything gives back one run of the whole segment.
  Freeing a range that is (partly) free already raises ValueError.
- ``reserve(offset, size)`` takes exactly that range (used when rebuilding from persisted
  metadata); returns False when any byte of it is not free.
- ``used``, ``free_bytes``, ``largest_free`` and ``free_ratio`` describe the segment.

Contract of an :class:`AllocationStrategy`: ``order(segments, size)`` returns the segments
that could hold ``size`` bytes (``largest_free >= size``), best candidate first. The master
walks that order and puts each replica of an object on a different segment. Strategies:

- ``random``: a uniformly random order (the rng is a required argument, so a seeded one
  makes placement reproducible);
- ``free_ratio_first``: highest free ratio first (ties: more free bytes, then segment id),
  which spreads load evenly across segments of different sizes.

:func:`make_strategy` is the registry (names in :data:`STRATEGIES`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.common.injected import Rng


class RangeAllocator:
    """First-fit free list with coalescing over ``[0, capacity)``."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        self.capacity = capacity
        # Free runs, sorted by offset, never adjacent (always coalesced).
        self._starts: list[int] = [0]
        self._sizes: list[int] = [capacity]
        self.used = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    @property
    def free_ratio(self) -> float:
        return self.free_bytes / self.capacity

    @property
    def largest_free(self) -> int:
        return max(self._sizes, default=0)

    def free_runs(self) -> list[tuple[int, int]]:
        """(offset, size) of each free run, by offset."""
        return list(zip(self._starts, self._sizes, strict=True))

    def allocate(self, size: int) -> int | None:
        if size <= 0:
            raise ValueError("size must be > 0")
        for i, run in enumerate(self._sizes):
            if run >= size:
                offset = self._starts[i]
                if run == size:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += size
                    self._sizes[i] -= size
                self.used += size
                return offset
        return None

    def reserve(self, offset: int, size: int) -> bool:
        if size <= 0 or offset < 0:
            return False
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0:
            return False
        start, run = self._starts[i], self._sizes[i]
        if offset + size > start + run:
            return False
        head, tail = offset - start, start + run - (offset + size)
        del self._starts[i], self._sizes[i]
        if tail:
            self._starts.insert(i, offset + size)
            self._sizes.insert(i, tail)
        if head:
            self._starts.insert(i, start)
            self._sizes.insert(i, head)
        self.used += size
        return True

    def free(self, offset: int, size: int) -> None:
        if size <= 0 or offset < 0 or offset + size > self.capacity:
            raise ValueError(f"bad range [{offset}, {offset + size})")
        i = bisect.bisect_left(self._starts, offset)
        if i < len(self._starts) and self._starts[i] < offset + size:
            raise ValueError(f"range [{offset}, {offset + size}) is partly free already")
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] > offset:
            raise ValueError(f"range [{offset}, {offset + size}) is partly free already")
        merge_left = i > 0 and self._starts[i - 1] + self._sizes[i - 1] == offset
        merge_right = i < len(self._starts) and self._starts[i] == offset + size
        if merge_left and merge_right:
            self._sizes[i - 1] += size + self._sizes[i]
            del self._starts[i], self._sizes[i]
        elif merge_left:
            self._sizes[i - 1] += size
        elif merge_right:
            self._starts[i] = offset
            self._sizes[i] += size
        else:
            self._starts.insert(i, offset)
            self._sizes.insert(i, size)
        self.used -= size


@dataclass
class Segment:
    """A memory region a store client contributed: ``size`` bytes at address ``base``."""

    segment_id: str
    client_id: str
    base: int
    size: int
    endpoint: str = ""
    principal: str = ""  # the certificate identity that mounted it ("" without mTLS)
    space: RangeAllocator = field(init=False)

    def __post_init__(self) -> None:
        self.space = RangeAllocator(self.size)


class AllocationStrategy(Protocol):
    name: str

    def order(self, segments: Sequence[Segment], size: int) -> list[Segment]:
        """Segments able to hold ``size`` bytes, best candidate first."""
        ...


class RandomStrategy:
    name = "random"

    def __init__(self, rng: Rng) -> None:
        self._rng = rng

    def order(self, segments: Sequence[Segment], size: int) -> list[Segment]:
        fit = sorted((s for s in segments if s.space.largest_free >= size),
                     key=lambda s: s.segment_id)
        self._rng.shuffle(fit)
        return fit


class FreeRatioFirstStrategy:
    name = "free_ratio_first"

    def order(self, segments: Sequence[Segment], size: int) -> list[Segment]:
        fit = [s for s in segments if s.space.largest_free >= size]
        fit.sort(key=lambda s: (-s.space.free_ratio, -s.space.free_bytes, s.segment_id))
        return fit


STRATEGIES: dict[str, Callable[[Rng], AllocationStrategy]] = {
    RandomStrategy.name: RandomStrategy,
    FreeRatioFirstStrategy.name: lambda _rng: FreeRatioFirstStrategy(),
}


def make_strategy(name: str, rng: Rng) -> AllocationStrategy:
    """The strategy called ``name`` drawing from ``rng``; ValueError for an unknown name."""
    try:
        factory = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown allocation strategy {name!r}; "
                         f"known: {', '.join(sorted(STRATEGIES))}") from None
    return factory(rng)
