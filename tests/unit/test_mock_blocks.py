"""Mock engine block manager: invariants under random operations, events vs. the index."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from services.common.block_hash import block_hashes
from services.indexer.core import KvEvent, KvIndex
from workers.engines.mock.blocks import BlockManager
from workers.kv.event_translate import EventTranslator

BS = 4


class Mirror:
    """Replays a block manager's events through the relay's translator into an index."""

    def __init__(self) -> None:
        self.translator = EventTranslator(BS)
        self.index = KvIndex()
        self.next_id = 0

    def feed(self, events: list[dict[str, object]]) -> None:
        for raw in events:
            for ev in self.translator.translate(raw):
                assert self.index.apply(KvEvent("w", self.next_id, ev.kind, ev.block_hashes,
                                                ev.tier)) is None
                self.next_id += 1

    def held(self) -> set[int]:
        return set(self.index.dump().get("w", {}).get("device", frozenset()))


def prefill(bm: BlockManager, req: str, tokens: list[int]) -> bool:
    """Admits ``req`` with its prefix hits and computes the whole prompt."""
    limit = (len(tokens) - 1) // BS * BS
    hashes = bm.hash_blocks(tokens[:limit])
    hits = bm.lookup(hashes)
    if not bm.allocate(req, len(tokens), hashes[:hits]):
        return False
    bm.commit(req, tokens, len(tokens))
    return True


def test_allocate_is_all_or_nothing_and_free_returns_everything() -> None:
    bm = BlockManager(4, BS)
    assert bm.allocate("a", 9)  # 3 blocks
    assert not bm.allocate("b", 8)  # needs 2, 1 free
    assert bm.num_free == 1 and not bm.holds("b")
    bm.free("a")
    bm.check()
    assert bm.num_free == 4 and bm.usage == 0.0


def test_full_blocks_are_stored_with_parents_and_hit_later() -> None:
    bm = BlockManager(16, BS)
    toks = list(range(100, 111))  # 2 full blocks + 3
    assert prefill(bm, "a", toks)
    ev = bm.drain_events()
    assert ev == [{"type": "BlockStored", "block_hashes": block_hashes(toks, BS),
                   "parent_block_hash": None, "token_ids": toks[:8], "block_size": BS,
                   "medium": "GPU"}]
    toks.append(7)  # the 3rd block fills up
    assert bm.allocate("a", 12)
    bm.commit("a", toks, 12)
    (third,) = bm.drain_events()
    assert third["parent_block_hash"] == block_hashes(toks, BS)[1]
    bm.free("a")
    assert bm.lookup(block_hashes(toks, BS)) == 3  # still cached after free
    bm.check()


def test_eviction_takes_the_lru_block_and_a_requests_tail_first() -> None:
    bm = BlockManager(4, BS)
    old = list(range(8))
    assert prefill(bm, "old", old)
    bm.free("old")  # blocks go to the tail: [free, free, old#1, old#0]
    bm.drain_events()
    assert bm.allocate("x", 12)  # 3 blocks: two never-used, then old's last block
    (removed,) = bm.drain_events()
    assert removed == {"type": "BlockRemoved", "block_hashes": [block_hashes(old, BS)[1]],
                       "medium": "GPU"}
    assert bm.lookup(block_hashes(old, BS)) == 1
    bm.check()


def test_same_prefix_computed_twice_shares_one_cached_block() -> None:
    bm = BlockManager(8, BS)
    toks = list(range(8))
    assert bm.allocate("a", 8) and bm.allocate("b", 8)  # neither hits: computed at once
    bm.commit("a", toks, 8)
    bm.commit("b", toks, 8)  # b switches to a's blocks, gives its own back
    assert bm.blocks_of("a") == bm.blocks_of("b")
    assert bm.num_used == 2
    assert [e["type"] for e in bm.drain_events()] == ["BlockStored"]
    bm.check()


@pytest.mark.parametrize("salt", ["", "tenant"])
@pytest.mark.parametrize("n_known", [0, 1, 3, 5])
def test_commit_reuses_known_hashes_and_hashes_only_the_rest(salt: str, n_known: int) -> None:
    """``known`` (the admission's hashes of leading full blocks) changes nothing but the
    work: same hashes, same events as hashing everything; blocks past them are hashed."""
    toks = list(range(100, 118))  # 4 full blocks + 2 tokens
    plain, reuse = BlockManager(16, BS), BlockManager(16, BS)
    known = reuse.hash_blocks(toks[:n_known * BS], salt=salt)
    hashed: list[int] = []
    orig = reuse.hash_blocks

    def counting(token_ids: Sequence[int], parent: int | None = None,
                 salt: str = "") -> list[int]:
        out = orig(token_ids, parent, salt)
        hashed.extend(out)
        return out

    reuse.hash_blocks = counting  # type: ignore[method-assign]
    for bm in (plain, reuse):
        assert bm.allocate("a", len(toks))
    for computed in (6, 13, len(toks)):  # chunk by chunk: 1, 3, then 4 full blocks
        plain.commit("a", toks, computed, salt)
        reuse.commit("a", toks, computed, salt, known)
        assert reuse.drain_events() == plain.drain_events()
        assert reuse.cached_hashes() == plain.cached_hashes()
    assert plain.cached_hashes() == set(block_hashes(toks, BS, salt=salt))
    assert len(hashed) == 4 - min(n_known, 4)  # only the blocks past the known ones
    reuse.check()


def test_reset_only_when_nothing_is_in_use() -> None:
    bm = BlockManager(8, BS)
    assert prefill(bm, "a", list(range(9)))
    assert not bm.reset()
    bm.free("a")
    bm.drain_events()
    assert bm.reset()
    assert bm.drain_events() == [{"type": "AllBlocksCleared"}]
    assert bm.cached_hashes() == set()
    bm.check()


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_invariants_and_the_index_in_step(seed: int) -> None:
    rng = random.Random(seed)
    bm = BlockManager(rng.choice([6, 12, 24]), BS)
    mirror = Mirror()
    prefixes = [[rng.randrange(50) for _ in range(BS * rng.randint(1, 3))] for _ in range(4)]
    live: dict[str, list[int]] = {}
    for step in range(400):
        op = rng.random()
        if op < 0.35 or not live:  # admit a new request (shared prefix + own tail)
            toks = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 9))]
            rid = f"r{step}"
            if prefill(bm, rid, toks):
                live[rid] = toks
        elif op < 0.7:  # decode: append tokens one by one (may fill blocks)
            rid = rng.choice(sorted(live))
            toks = live[rid]
            for _ in range(rng.randint(1, 5)):
                toks.append(rng.randrange(50))
                if not bm.allocate(rid, len(toks)):
                    bm.free(rid)  # out of blocks: preempt (recompute later)
                    del live[rid]
                    break
                bm.commit(rid, toks, len(toks) - 1)
        elif op < 0.97:  # finish or abort
            rid = rng.choice(sorted(live))
            del live[rid]
            bm.free(rid)
        else:  # everything finishes, then the prefix cache is reset
            for rid in list(live):
                bm.free(rid)
            live.clear()
            assert bm.reset()
        bm.check()
        mirror.feed(bm.drain_events())
        assert mirror.held() == bm.cached_hashes()
        assert mirror.translator.orphans == 0
    for rid in list(live):
        bm.free(rid)
    bm.check()
    assert bm.num_free == bm.num_blocks
