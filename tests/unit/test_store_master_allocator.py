"""Store master: the per-segment allocator, allocation strategies and eviction policies."""

from __future__ import annotations

import random

import pytest

from services.store_master.core import (
    Candidate,
    FreeRatioFirstStrategy,
    LruPolicy,
    RandomStrategy,
    RangeAllocator,
    SampledLruPolicy,
    Segment,
    make_eviction_policy,
    make_strategy,
)


def test_first_fit_takes_the_lowest_offset_that_fits() -> None:
    a = RangeAllocator(100)
    assert [a.allocate(10), a.allocate(20), a.allocate(30)] == [0, 10, 30]
    a.free(10, 20)
    assert a.allocate(25) == 60  # the hole at 10 is too small
    assert a.allocate(15) == 10  # first fit
    assert a.used == 10 + 15 + 30 + 25 and a.free_bytes == 20
    assert a.allocate(21) is None


def test_free_coalesces_neighbours_back_into_one_run() -> None:
    a = RangeAllocator(100)
    offs = [a.allocate(10) for _ in range(10)]
    assert a.allocate(1) is None and a.largest_free == 0
    for off in offs[1::2]:
        a.free(off, 10)  # 5 separate holes
    assert len(a.free_runs()) == 5 and a.largest_free == 10
    for off in offs[0::2]:
        a.free(off, 10)
    assert a.free_runs() == [(0, 100)] and a.used == 0


def test_free_rejects_double_free_and_bad_ranges() -> None:
    a = RangeAllocator(100)
    off = a.allocate(10)
    assert off == 0
    a.free(0, 10)
    with pytest.raises(ValueError):
        a.free(0, 10)
    a.allocate(50)
    with pytest.raises(ValueError):
        a.free(40, 20)  # overlaps the free tail
    with pytest.raises(ValueError):
        a.free(90, 20)  # past the end
    with pytest.raises(ValueError):
        a.allocate(0)


def test_reserve_takes_an_exact_range_only_when_free() -> None:
    a = RangeAllocator(100)
    assert a.reserve(40, 20)
    assert a.free_runs() == [(0, 40), (60, 40)]
    assert not a.reserve(50, 20) and not a.reserve(95, 10) and not a.reserve(-1, 2)
    assert a.reserve(0, 40) and a.reserve(60, 40)
    assert a.free_runs() == [] and a.used == 100


def test_random_allocator_model_never_overlaps_and_conserves_bytes() -> None:
    rng = random.Random(7)
    a = RangeAllocator(1000)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off = rng.choice(sorted(live))
            a.free(off, live.pop(off))
        else:
            size = rng.randint(1, 60)
            off = a.allocate(size)
            if off is not None:
                live[off] = size
        spans = sorted(live.items()) + [(s, n) for s, n in a.free_runs()]
        spans.sort()
        pos = 0
        for s, n in spans:  # used and free runs tile [0, capacity) exactly
            assert s == pos
            pos += n
        assert pos == 1000 and a.used == sum(live.values())
        runs = a.free_runs()
        assert all(s1 + n1 < s2 for (s1, n1), (s2, _) in zip(runs, runs[1:], strict=False))


def _segments(*free: tuple[str, int, int]) -> list[Segment]:
    out = []
    for sid, size, used in free:
        seg = Segment(sid, "c", 0, size)
        if used:
            seg.space.allocate(used)
        out.append(seg)
    return out


def test_free_ratio_first_orders_by_free_ratio_and_skips_full_segments() -> None:
    segs = _segments(("a", 100, 50), ("b", 1000, 100), ("c", 100, 95), ("d", 100, 0))
    order = FreeRatioFirstStrategy().order(segs, 10)
    assert [s.segment_id for s in order] == ["d", "b", "a"]  # c has only 5 bytes left


def test_random_strategy_is_seeded_and_covers_all_orders() -> None:
    segs = _segments(("a", 100, 0), ("b", 100, 0), ("c", 100, 0))
    s1, s2 = RandomStrategy(random.Random(1)), RandomStrategy(random.Random(1))
    orders = [tuple(x.segment_id for x in s1.order(segs, 10)) for _ in range(60)]
    assert orders == [tuple(x.segment_id for x in s2.order(segs, 10)) for _ in range(60)]
    assert len(set(orders)) == 6
    assert RandomStrategy(random.Random(1)).order(segs, 101) == []


def test_registries_know_their_names() -> None:
    rng = random.Random(0)
    assert make_strategy("random", rng).name == "random"
    assert make_strategy("free_ratio_first", rng).name == "free_ratio_first"
    assert make_eviction_policy("lru", rng).name == "lru"
    assert make_eviction_policy("sampled_lru", rng).name == "sampled_lru"
    with pytest.raises(ValueError, match="known"):
        make_strategy("nope", rng)
    with pytest.raises(ValueError, match="known"):
        make_eviction_policy("nope", rng)


CANDS = [Candidate(f"k{i}", 10, float(t)) for i, t in enumerate([5, 1, 9, 3, 7, 2, 8])]


def test_lru_evicts_oldest_until_enough_bytes() -> None:
    assert LruPolicy().select(CANDS, 25) == ["k1", "k5", "k3"]
    assert LruPolicy().select(CANDS, 0) == []
    assert len(LruPolicy().select(CANDS, 10_000)) == len(CANDS)


def test_sampled_lru_is_exact_with_a_large_sample_and_approximate_otherwise() -> None:
    assert SampledLruPolicy(random.Random(0), sample=16).select(CANDS, 25) == \
        LruPolicy().select(CANDS, 25)
    cands = [Candidate(f"k{i}", 1, float(i)) for i in range(1000)]
    picked = SampledLruPolicy(random.Random(3), sample=8).select(cands, 50)
    assert len(picked) == 50 and len(set(picked)) == 50
    ages = sorted(int(k[1:]) for k in picked)
    # Each pick is the oldest of 8 random draws: its expected rank is ~1/9 of the pool.
    assert sum(ages) / len(ages) < 250
    assert SampledLruPolicy(random.Random(3), sample=8).select(cands, 50) == picked
