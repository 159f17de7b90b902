"""The worker-side translation of engine KV events into kvmesh's chained-hash events."""

from __future__ import annotations

import random

import pytest

from protos import kv_events_pb2
from services.common.block_hash import block_hashes
from services.common.event_bus import BadEntry, decode_entry, encode_batch, encode_state
from services.indexer.core import KvEvent, KvIndex
from workers.engines.mock.blocks import BlockManager
from workers.kv.event_translate import EventTranslator, UnknownEvent, event_salt, tier_of

BS = 4


def stored(hashes: list[object], tokens: list[int], parent: object = None,
           medium: str | None = "GPU") -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS, "medium": medium}


def removed(hashes: list[object], medium: str | None = "GPU") -> dict[str, object]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def test_parent_continues_the_chain() -> None:
    toks = list(range(10, 22))  # three blocks
    assert block_hashes(toks, BS) == (block_hashes(toks[:4], BS)
                                      + block_hashes(toks[4:], BS, parent=block_hashes(
                                          toks[:4], BS)[-1]))


def test_stored_events_chain_through_engine_parents() -> None:
    t = EventTranslator(BS)
    toks = list(range(100, 112))
    ours = block_hashes(toks, BS)
    first = t.translate(stored([b"e0"], toks[:4]))
    rest = t.translate(stored([b"e1", b"e2"], toks[4:], parent=b"e0"))
    assert [e.block_hashes for e in first + rest] == [tuple(ours[:1]), tuple(ours[1:])]
    assert t.state() == {"device": set(ours)}


def test_orphans_are_skipped_and_counted() -> None:
    t = EventTranslator(BS)
    assert t.translate(stored([7, 8], list(range(8)), parent=99)) == []
    assert t.orphans == 2 and t.state() == {}


def test_equal_tokens_under_two_engine_hashes_are_refcounted() -> None:
    t = EventTranslator(BS)
    toks = [5, 6, 7, 8]
    assert len(t.translate(stored([1], toks))) == 1
    assert t.translate(stored([2], toks)) == []  # e.g. same tokens, other LoRA
    assert t.translate(removed([1])) == []
    (ev,) = t.translate(removed([2]))
    assert ev.kind == "removed" and ev.block_hashes == tuple(block_hashes(toks, BS))


def test_tiers_and_clear() -> None:
    t = EventTranslator(BS)
    toks = [1, 2, 3, 4]
    t.translate(stored([1], toks, medium="GPU"))
    (host,) = t.translate(stored([1], toks, medium="CPU"))
    assert host.tier == "host"
    assert t.state() == {"device": set(block_hashes(toks, BS)), "host": set(block_hashes(
        toks, BS))}
    assert t.translate(removed([9])) == []  # never stored: nothing to say
    (clr,) = t.translate({"type": "AllBlocksCleared"})
    assert clr.kind == "cleared" and t.state() == {}
    with pytest.raises(UnknownEvent):
        t.translate({"type": "Nope"})
    assert [tier_of(m) for m in (None, "GPU", "CPU", "STORAGE")] == [
        "device", "device", "host", "store"]


def test_random_event_streams_leave_the_index_equal_to_the_state() -> None:
    rng = random.Random(7)
    t = EventTranslator(BS)
    index = KvIndex()
    live: list[tuple[int, list[int]]] = []  # (engine hash, tokens so far) of stored blocks
    next_hash, event_id = 0, 0
    for _ in range(500):
        op = rng.random()
        if op < 0.6 or not live:
            parent = rng.choice(live) if live and rng.random() < 0.7 else None
            n = rng.randint(1, 3)
            toks = [rng.randrange(50) for _ in range(n * BS)]
            hashes = list(range(next_hash, next_hash + n))
            next_hash += n
            raw = stored(hashes, toks, parent=parent[0] if parent else None)
            prefix = parent[1] if parent else []
            for i, h in enumerate(hashes):
                live.append((h, prefix + toks[:(i + 1) * BS]))
        elif op < 0.95:
            victim = live.pop(rng.randrange(len(live)))
            raw = removed([victim[0]])
        else:
            live.clear()
            raw = {"type": "AllBlocksCleared"}
        for ev in t.translate(raw):
            assert index.apply(KvEvent("w", event_id, ev.kind, ev.block_hashes, ev.tier)) is None
            event_id += 1
    got = index.dump().get("w", {})
    assert {k: set(v) for k, v in got.items()} == t.state()
    # Every live engine block maps to the chained hash of its whole prefix.
    expected = {block_hashes(toks, BS)[-1] for _, toks in live}
    assert t.state().get("device", set()) == expected


def test_event_bus_entries_round_trip_and_reject_garbage() -> None:
    batch = kv_events_pb2.KvEventBatch(worker_id="w1", block_size=32, events=[
        kv_events_pb2.KvEvent(event_id=0, kind=kv_events_pb2.KV_EVENT_KIND_STORED,
                              block_hashes=[1, 2], tier="device")])
    assert decode_entry(encode_batch(batch)) == batch
    state = kv_events_pb2.KvState(worker_id="w1", event_id=4)
    assert decode_entry(encode_state(state)) == state
    for bad in ({b"k": b"b", b"d": b"\xff\xff"}, {b"x": b"1"}, {b"k": b"z", b"d": b""},
                {b"k": b"b", b"d": b""}):
        with pytest.raises(BadEntry):
            decode_entry(bad)


def test_salted_events_give_the_salted_hashes_the_router_computes() -> None:
    toks = list(range(200, 212))
    salted = block_hashes(toks, BS, salt="tenant-a")
    t = EventTranslator(BS)
    # vLLM's form: extra_keys per block, the salt on the first block only
    first = t.translate({**stored([b"s0", b"s1"], toks[:8]), "extra_keys": [["tenant-a"], None]})
    rest = t.translate(stored([b"s2"], toks[8:], parent=b"s1"))
    assert [e.block_hashes for e in first + rest] == [tuple(salted[:2]), tuple(salted[2:])]
    # the same tokens unsalted (another engine hash) are other kvmesh blocks
    (plain,) = t.translate(stored([b"p0"], toks[:4]))
    assert plain.block_hashes == tuple(block_hashes(toks[:4], BS))
    assert plain.block_hashes[0] not in salted


@pytest.mark.parametrize(("extra", "lora", "salt"), [
    (None, None, ""),
    ([None], None, ""),
    ([["s"]], None, "s"),
    ([("lora-x", "s")], "lora-x", "s"),  # LoRA name first, then the salt
    ([("lora-x",)], "lora-x", ""),  # a LoRA name alone is no salt
    ([[["mm-hash", 0], "s", b"digest"]], None, "s"),  # mm pairs, salt, embeds digest
    ([[["mm-hash", 0], b"digest"]], None, ""),
])
def test_event_salt_reads_vllms_untagged_extra_keys(extra: object, lora: str | None,
                                                    salt: str) -> None:
    raw = {**stored([1], [1, 2, 3, 4]), "extra_keys": extra, "lora_name": lora}
    assert event_salt(raw) == salt


def test_mock_engine_salted_blocks_translate_to_the_routers_hashes() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    toks = list(range(300, 312))
    for req, salt in (("a", "salt-a"), ("b", "salt-b"), ("c", "")):
        hashes = bm.hash_blocks(toks, salt=salt)
        assert bm.lookup(hashes) == 0  # nothing another salt computed is a hit
        assert bm.allocate(req, len(toks))
        bm.commit(req, toks, 8, salt)  # two blocks, then the third (parent = second)
        bm.commit(req, toks, len(toks), salt)
        assert bm.lookup(hashes) == 3
    t = EventTranslator(BS)
    out = [h for raw in bm.drain_events() for ev in t.translate(raw) for h in ev.block_hashes]
    expected = [h for salt in ("salt-a", "salt-b", "") for h in block_hashes(toks, BS, salt=salt)]
    assert out == expected and len(set(out)) == 9
    bm.check()
