"""The KV event relay when Redis goes away: the worker keeps running, events are kept and
published once Redis is back; an overflowing backlog drops the oldest events, which an
indexer sees as a gap and repairs from the relay's state."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from services.common.block_hash import block_hashes
from services.common.event_bus import decode_entry
from services.common.procs import start_redis
from services.indexer.core import KvEvent, KvIndex
from tests.waiting import wait_for
from workers.kv.event_relay import EventEndpoints, KvEventRelay

BS = 4
STREAM = "kvmesh:outage:kv-events"


def stored(i: int) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": [i], "parent_block_hash": None,
            "token_ids": [i, i + 1, i + 2, i + 3], "block_size": BS, "medium": "GPU"}


async def read_all(url: str) -> list[KvEvent]:
    r = aioredis.Redis.from_url(url)
    try:
        entries = await r.xrange(STREAM)
    finally:
        await r.aclose()
    out = []
    for _, fields in entries:
        batch = decode_entry(fields)
        out += [KvEvent(batch.worker_id, e.event_id, "stored", tuple(e.block_hashes))
                for e in batch.events]  # type: ignore[union-attr]
    return out


async def test_events_survive_a_redis_restart(tmp_path: Path) -> None:
    red = start_redis(tmp_path)
    port = int(red.address.rsplit(":", 1)[1])
    url = f"redis://{red.address}"
    relay = KvEventRelay("w-out", BS, url, STREAM, EventEndpoints(tmp_path, "", ""),
                         max_pending=5)
    await relay.start(zmq_input=False)
    try:
        relay.submit([stored(i) for i in range(3)])

        async def published(n: int) -> bool:
            return len(await read_all(url)) == n
        await wait_for(lambda: published(3), 10, "the first 3 events in the stream")
        red.stop()
        relay.submit([stored(i) for i in range(10, 18)])  # 8 events, backlog holds 5
        await wait_for(lambda: relay.stats.publish_failures > 0, 10,
                       "a publish failure while Redis is down")
        assert relay.stats.dropped_backlog == 3
        red = start_redis(tmp_path, port)  # empty: no persistence
        events: list[KvEvent] = []

        async def caught_up() -> bool:
            nonlocal events
            events = await read_all(url)
            return len(events) == 5
        await wait_for(caught_up, 10, lambda: f"5 events after the restart, got {events}")
        # Ids 3..5 were dropped from the backlog; 6..10 were published after the restart.
        assert [e.event_id for e in events] == [6, 7, 8, 9, 10]
        index = KvIndex()
        gap = index.apply(events[0])
        assert gap is not None and (gap.expected, gap.got) == (0, 6)
        state = relay.state()  # what GetKvState answers
        index.resync("w-out", state.event_id, {t.tier: t.block_hashes for t in state.tiers})
        assert index.dump()["w-out"]["device"] == {
            block_hashes([i, i + 1, i + 2, i + 3], BS)[0] for i in [*range(3), *range(10, 18)]}
    finally:
        await relay.close()
        red.stop()


async def test_a_flush_larger_than_one_entry_goes_out_in_order(tmp_path: Path) -> None:
    """Events beyond ``max_batch_events`` go in further entries of the same flush
    (pipelined); a flush of one entry is a plain XADD. Both keep every event, in order."""
    red = start_redis(tmp_path)
    url = f"redis://{red.address}"
    relay = KvEventRelay("w-big", BS, url, STREAM, EventEndpoints(tmp_path, "", ""),
                         max_batch_events=3)
    await relay.start(zmq_input=False)
    try:
        relay.submit([stored(i) for i in range(2)])  # one entry
        await wait_for(lambda: relay.stats.entries == 1, 10, "the first entry")
        relay.submit([stored(i) for i in range(10, 18)])  # 8 events: 3 entries

        async def published() -> bool:
            return relay.stats.entries == 4 and len(await read_all(url)) == 10
        await wait_for(published, 10, lambda: f"4 entries, got {relay.stats.entries}")
        events = await read_all(url)
        assert [e.event_id for e in events] == list(range(10))
        assert [e.block_hashes for e in events] == [
            (block_hashes([i, i + 1, i + 2, i + 3], BS)[0],)
            for i in [*range(2), *range(10, 18)]]
        assert relay.stats.events == 10 and relay.stats.publish_failures == 0
    finally:
        await relay.close()
        red.stop()


async def test_events_submitted_within_the_flush_delay_share_one_entry(
        tmp_path: Path) -> None:
    """With a flush delay, the relay waits that long after a batch's first event, and
    what is submitted meanwhile goes in the same entry (one XADD); the next batch waits
    again. Without one (0), nothing waits. The delay's sleep is held by the test."""
    red = start_redis(tmp_path)
    url = f"redis://{red.address}"
    waits: list[float] = []
    gate = asyncio.Event()

    async def held(seconds: float) -> None:
        waits.append(seconds)
        await gate.wait()
        gate.clear()

    relay = KvEventRelay("w-delay", BS, url, STREAM, EventEndpoints(tmp_path, "", ""),
                         flush_delay_s=0.002, sleep=held)
    plain = KvEventRelay("w-plain", BS, url, STREAM, EventEndpoints(tmp_path, "", ""),
                         sleep=held)
    await relay.start(zmq_input=False)
    await plain.start(zmq_input=False)
    try:
        relay.submit([stored(0)])
        await wait_for(lambda: len(waits) == 1, 10, "the relay to wait its flush delay")
        relay.submit([stored(1), stored(2)])  # meanwhile: the same entry
        relay.submit([stored(3)])
        assert relay.stats.entries == 0
        gate.set()
        await wait_for(lambda: relay.stats.entries == 1, 10, "the first entry")
        relay.submit([stored(4)])  # a later batch waits again, and is its own entry
        await wait_for(lambda: len(waits) == 2, 10, "the second flush delay")
        gate.set()
        await wait_for(lambda: relay.stats.entries == 2, 10, "the second entry")
        assert waits == [0.002, 0.002]
        events = [e for e in await read_all(url) if e.worker_id == "w-delay"]
        assert [e.event_id for e in events] == list(range(5))

        plain.submit([stored(9)])
        await wait_for(lambda: plain.stats.entries == 1, 10, "the plain relay's entry")
        assert len(waits) == 2  # no delay: it never waited
    finally:
        await relay.close()
        await plain.close()
        red.stop()


def test_the_flush_delay_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="flush_delay_s must be >= 0"):
        KvEventRelay("w", BS, "redis://127.0.0.1:1", STREAM,
                     EventEndpoints(tmp_path, "", ""), flush_delay_s=-1)
