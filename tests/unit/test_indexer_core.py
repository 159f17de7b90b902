import dataclasses
import random

import pytest

from services.common.block_hash import block_hashes
from services.indexer.core import TIERS, Gap, KvEvent, KvIndex, Overlap

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


# -- optimised internals keep the contract: randomized comparison with a brute-force model --


class Model:
    """The contract, written as plainly as possible: worker → tier → set of hashes."""

    def __init__(self) -> None:
        self.held: dict[str, dict[str, set[int]]] = {}
        self.next: dict[str, int] = {}

    def apply(self, e: KvEvent) -> Gap | None:
        exp = self.next.get(e.worker_id, 0)
        if e.event_id < exp:
            return None
        if e.event_id > exp:
            return Gap(e.worker_id, exp, e.event_id)
        self.next[e.worker_id] = exp + 1
        tiers = self.held.setdefault(e.worker_id, {t: set() for t in TIERS})
        if e.kind == "stored":
            tiers[e.tier].update(e.block_hashes)
        elif e.kind == "removed":
            tiers[e.tier].difference_update(e.block_hashes)
        else:
            for hs in tiers.values():
                hs.clear()
        return None

    def find_matches(self, hashes: list[int]) -> dict[str, Overlap]:
        def run(hs: set[int]) -> int:
            n = 0
            while n < len(hashes) and hashes[n] in hs:
                n += 1
            return n

        out = {}
        for w, tiers in self.held.items():
            n = run(set().union(*tiers.values()))
            if n:
                by = {t: run(tiers[t]) for t in TIERS}
                out[w] = Overlap(w, n, {t: k for t, k in by.items() if k})
        return out

    def dump(self) -> dict[str, dict[str, frozenset[int]]]:
        return {w: {t: frozenset(hs) for t, hs in tiers.items() if hs}
                for w, tiers in self.held.items() if any(tiers.values())}


def check_invariants(idx: KvIndex) -> None:
    """Interned holder sets: canonical, refcounted exactly, no leaks."""
    held_any: dict[int, set[str]] = {}
    for w, tiers in idx._by_worker.items():
        for hs in tiers.values():
            for h in hs:
                held_any.setdefault(h, set()).add(w)
    assert {h: set(s) for h, s in idx._any.items()} == held_any
    counts: dict[frozenset[str], int] = {}
    for s in idx._any.values():
        assert idx._canon[s] is s
        counts[s] = counts.get(s, 0) + 1
    assert idx._refs == counts and set(idx._canon) == set(counts)
    multi = {w for w, tiers in idx._by_worker.items()
             if any(hs for t, hs in tiers.items() if t != "device")}
    assert multi <= idx._multi_tier


@pytest.mark.parametrize("seed", range(12))
def test_randomized_against_a_brute_force_model(seed: int) -> None:
    rng = random.Random(seed)
    chains = [block_hashes([c * 1000 + i for i in range(32 * 10)], 32) for c in range(3)]
    # chain 2 shares chain 0's first 4 blocks, as prompts with a common prefix do
    chains[2] = chains[0][:4] + chains[2][4:]
    pool = sorted({h for c in chains for h in c})
    workers = ["a", "b", "c", "d"]
    idx, model = KvIndex(), Model()
    queries = [c[:k] for c in chains for k in (1, 3, 10)] + [[pool[0]] + chains[1]]
    for step in range(300):
        w = rng.choice(workers)
        r = rng.random()
        if r < 0.06:
            blocks = {t: rng.sample(pool, rng.randint(0, 6)) for t in rng.sample(TIERS, 2)}
            eid = idx.next_event_id(w) + rng.randint(0, 3)
            idx.resync(w, eid, dict(blocks.items()))
            model.held[w] = {t: set(blocks.get(t, ())) for t in TIERS}
            model.next[w] = eid + 1
        elif r < 0.09:
            idx.remove_worker(w)
            model.held.pop(w, None)
            model.next.pop(w, None)
        else:
            nxt = model.next.get(w, 0)
            eid = rng.choice([nxt] * 8 + [max(0, nxt - 1), nxt + 2])  # some redeliveries, gaps
            kind = rng.choices(["stored", "removed", "cleared"], [6, 3, 0.3])[0]
            c = rng.choice(chains)
            lo = rng.randint(0, 6) if rng.random() < 0.3 else 0  # sometimes a hole at the start
            hashes = tuple(c[lo:rng.randint(lo, len(c))]) if kind == "stored" else \
                tuple(rng.sample(pool, rng.randint(0, 5)))
            tier = rng.choices(TIERS, [6, 2, 1])[0]
            e = KvEvent(w, eid, kind, hashes if kind != "cleared" else (), tier)
            assert idx.apply(e) == model.apply(e), step
        for q in queries:
            assert idx.find_matches(q) == model.find_matches(q), (step, q)
        assert idx.dump() == model.dump()
        assert idx.workers() == set(model.dump())
        check_invariants(idx)
    st = idx.stats()
    assert st["workers"] == len(model.dump())
    assert st["blocks"] == len({h for t in model.dump().values() for hs in t.values() for h in hs})


def test_fast_built_overlaps_are_ordinary_overlaps() -> None:
    idx = KvIndex()
    idx.apply(stored("a", 0, H[:4]))
    idx.apply(stored("b", 0, H[:2]))
    idx.apply(stored("b", 1, H[:3], tier="host"))
    m = idx.find_matches(H)
    assert m == {"a": Overlap("a", 4, {"device": 4}), "b": Overlap("b", 3, {"device": 2,
                                                                            "host": 3})}
    assert repr(m["a"]) == "Overlap(worker_id='a', blocks=4, by_tier={'device': 4})"
    assert dataclasses.asdict(m["b"]) == {"worker_id": "b", "blocks": 3,
                                          "by_tier": {"device": 2, "host": 3}}
    with pytest.raises(dataclasses.FrozenInstanceError):
        m["a"].blocks = 1  # type: ignore[misc]
    m["a"].by_tier["device"] = 99  # each answer owns its dicts: mutation does not leak
    assert idx.find_matches(H)["a"].by_tier == {"device": 4}


def test_holder_sets_are_shared_and_freed() -> None:
    idx = KvIndex()
    for w in ("a", "b"):
        idx.apply(stored(w, 0, H))
    assert len({id(s) for s in idx._any.values()}) == 1  # one object for {"a", "b"}
    idx.apply(KvEvent("a", 1, "removed", tuple(H[3:])))
    assert sorted(map(sorted, idx._canon)) == [["a", "b"], ["b"]]
    idx.remove_worker("a")
    idx.remove_worker("b")
    assert idx._any == {} and idx._canon == {} and idx._refs == {}


def test_resync_with_an_unknown_tier_changes_nothing() -> None:
    idx = KvIndex()
    idx.apply(stored("a", 0, H[:2]))
    with pytest.raises(ValueError):
        idx.resync("a", 5, {"device": H, "nvme": H})
    assert idx.find_matches(H)["a"].blocks == 2 and idx.next_event_id("a") == 1


def test_workers_lists_only_workers_with_blocks() -> None:
    idx = KvIndex()
    idx.apply(stored("a", 0, H[:1]))
    idx.apply(stored("b", 0, H[:1], tier="store"))
    idx.apply(KvEvent("c", 0, "cleared"))
    assert idx.workers() == {"a", "b"}
    idx.apply(KvEvent("b", 1, "removed", tuple(H[:1]), "store"))
    assert idx.workers() == {"a"} and idx._multi_tier == set()


def test_find_matches_requests_are_bounded_and_name_the_field() -> None:
    from protos import indexer_pb2
    from services.indexer.service import (
        MAX_BLOCK_SIZE,
        MAX_QUERY_BLOCKS,
        MAX_QUERY_TOKENS,
        query_problem,
    )

    req = indexer_pb2.FindMatchesRequest
    assert query_problem(req(token_ids=[1, 2], block_size=2)) is None
    assert query_problem(req(block_hashes=[1] * MAX_QUERY_BLOCKS)) is None
    refused = {
        "exactly one": req(),
        "block_hashes: at most": req(block_hashes=[1] * (MAX_QUERY_BLOCKS + 1)),
        "token_ids: at most": req(token_ids=[1] * (MAX_QUERY_TOKENS + 1), block_size=16),
        "block_size in 1..": req(token_ids=[1], block_size=MAX_BLOCK_SIZE + 1),
        "token_ids[1] must be >= 0": req(token_ids=[1, -5], block_size=1),
        "cache_salt applies to token_ids only": req(block_hashes=[1], cache_salt="t"),
    }
    for text, r in refused.items():
        problem = query_problem(r)
        assert problem is not None and text in problem, (text, problem)
