from services.common.block_hash import block_hashes
from services.indexer.core import Gap, KvEvent, KvIndex

H = block_hashes(list(range(32 * 6)), 32)  # 6 chained hashes of one prompt


def stored(w: str, eid: int, hashes: list[int], tier: str = "device") -> KvEvent:
    return KvEvent(w, eid, "stored", tuple(hashes), tier)


def test_overlap_is_the_leading_run_per_worker() -> None:
    idx = KvIndex()
    assert idx.apply(stored("a", 0, H[:4])) is None
    assert idx.apply(stored("b", 0, H[:2])) is None
    assert idx.apply(stored("b", 1, H[3:5])) is None  # hole at H[2]
    m = idx.find_matches(H)
    assert m["a"].blocks == 4 and m["b"].blocks == 2
    assert idx.find_matches(block_hashes(list(range(1, 200)), 32)) == {}


def test_tiers_are_tracked_separately() -> None:
    idx = KvIndex()
    idx.apply(stored("a", 0, H[:2]))
    idx.apply(stored("a", 1, H[:5], tier="host"))
    m = idx.find_matches(H)["a"]
    assert m.blocks == 5 and m.by_tier == {"device": 2, "host": 5}
    idx.apply(KvEvent("a", 2, "removed", tuple(H[:2]), "device"))
    assert idx.find_matches(H)["a"].by_tier == {"host": 5}


def test_gaps_are_reported_not_applied_and_redeliveries_ignored() -> None:
    idx = KvIndex()
    idx.apply(stored("a", 0, H[:1]))
    assert idx.apply(stored("a", 3, H[1:2])) == Gap("a", 1, 3)
    assert idx.find_matches(H)["a"].blocks == 1
    assert idx.apply(stored("a", 0, H[:1])) is None  # redelivered
    assert idx.next_event_id("a") == 1
    idx.resync("a", 3, {"device": H[:3]})
    assert idx.next_event_id("a") == 4 and idx.find_matches(H)["a"].blocks == 3


def test_cleared_and_removed_worker() -> None:
    idx = KvIndex()
    idx.apply(stored("a", 0, H))
    idx.apply(stored("b", 0, H[:3]))
    idx.apply(KvEvent("a", 1, "cleared"))
    assert set(idx.find_matches(H)) == {"b"}
    idx.remove_worker("b")
    assert idx.find_matches(H) == {} and idx.stats() == {"blocks": 0, "workers": 0,
                                                          "entries": 0}


def test_replaying_the_same_events_gives_the_same_dump() -> None:
    events = [stored("a", 0, H[:4]), KvEvent("a", 1, "removed", tuple(H[2:4])),
              stored("b", 0, H[:6], "host"), stored("a", 2, H[:1], "store")]
    one, two = KvIndex(), KvIndex()
    for e in events:
        one.apply(e)
    for e in events:
        two.apply(e)
        two.apply(e)  # duplicates are harmless
    assert one.dump() == two.dump()
    assert one.dump()["a"] == {"device": frozenset(H[:2]), "store": frozenset(H[:1])}
