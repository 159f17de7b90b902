"""A worker id that outlives its processes, on real etcd and Redis: a restarted worker keeps
its id (its certificate's name; ``kvmesh up`` restarts a child under the same id) and
numbers its KV events from 0 again. Every entry names its process (``started_at_ms``),
so an indexer that replays the stream follows the latest process, not the first one's
event ids (which would hide the later one's events as redeliveries).

- A mock worker (incarnation A) indexes several prompts and stops; the same worker id
  comes back (incarnation B) with fewer, other blocks. A live indexer and a fresh one
  that replays the whole stream both hold exactly B's ``GetKvState``; the fresh one
  skipped A's entries as stale (the live etcd record names B).
- The record still names A (a crash within its lease) while B's relay publishes before
  B registers: the replay switches to B at B's first entry, A's late entries (a zombie)
  are ignored and counted, and B's record replacing A's then drops nothing.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from protos import (
    common_pb2,
    discovery_pb2,
    indexer_pb2,
    indexer_pb2_grpc,
    kv_events_pb2,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.block_hash import block_hashes
from services.common.config import load_config
from services.common.discovery import Registration
from services.common.event_bus import stream_name
from services.common.procs import Child
from services.indexer.core import KvIndex
from services.indexer.feed import IndexFeed
from services.indexer.main import IndexerApp, IndexerConfig, start_indexer
from tests.integration.conftest import base_args
from tests.manual_clock import Clock
from tests.waiting import wait_for
from workers.fleet import Fleet, FleetConfig, FleetWorker, start_fleet
from workers.kv.event_relay import EventEndpoints, KvEventRelay

BLOCK = 16


def prompt(seed: int, n_blocks: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 for i in range(n_blocks * BLOCK + 3)]


def as_sets(states: list[kv_events_pb2.KvState]) -> dict[str, dict[str, set[int]]]:
    return {s.worker_id: {t.tier: set(t.block_hashes) for t in s.tiers if t.block_hashes}
            for s in states if any(t.block_hashes for t in s.tiers)}


def relay_of(w: FleetWorker) -> KvEventRelay:
    assert w.relay is not None
    return w.relay


def flushed(relay: KvEventRelay) -> bool:
    return relay.stats.events == relay.state().event_id + 1


async def generate(w: FleetWorker, ids: list[int], tag: str) -> None:
    async with grpc.aio.insecure_channel(w.address) as ch:
        req = worker_pb2.GenerateRequest(request_id=tag, token_ids=ids, model="mock",
                                         sampling=common_pb2.SamplingParams(max_tokens=2))
        async for _ in worker_pb2_grpc.WorkerStub(ch).Generate(req):
            pass


async def indexed(app: IndexerApp, worker_id: str) -> dict[str, dict[str, set[int]]]:
    async with grpc.aio.insecure_channel(app.server.address) as ch:
        dump = await indexer_pb2_grpc.IndexerStub(ch).Dump(
            indexer_pb2.DumpRequest(worker_id=worker_id))
    return as_sets(list(dump.workers))


async def in_step(app: IndexerApp, worker_id: str,
                  want: dict[str, dict[str, set[int]]]) -> bool:
    return await indexed(app, worker_id) == want


async def truth(w: FleetWorker) -> dict[str, dict[str, set[int]]]:
    async with grpc.aio.insecure_channel(w.address) as ch:
        return as_sets([await worker_pb2_grpc.WorkerStub(ch).GetKvState(
            kv_events_pb2.KvStateRequest())])


async def test_a_replay_indexes_the_restarted_worker_not_its_previous_process(
        etcd: Child, redis_server: Child) -> None:
    args = [*base_args(etcd.address, "incarn"), "--redis-url", f"redis://{redis_server.address}"]
    fleet_args = [*args, "--workers", "1", "--block-size", str(BLOCK), "--num-blocks", "512",
                  "--max-model-len", "2048", "--timing", "zero", "--worker-id", "inc-"]
    live = await start_indexer(load_config(IndexerConfig, [*args, "--group", "live"], {}))
    fleets: list[Fleet] = []
    apps = [live]
    try:
        a = await start_fleet(load_config(FleetConfig, fleet_args, {}))
        fleets.append(a)
        wa = a.workers[0]
        wid, relay_a = wa.worker_id, relay_of(wa)
        for i in range(4):
            await generate(wa, prompt(i, 6), f"a{i}")
        await wait_for(lambda: flushed(relay_a), 10, "incarnation A's events published")
        a_state = await truth(wa)
        await wait_for(lambda: indexed(live, wid), 10, "the live index to hold A's blocks")
        assert await indexed(live, wid) == a_state
        await a.stop()  # the process ends; the same worker id comes back below
        await wait_for(lambda: wid not in live.feed.live_workers(), 10, "A gone from etcd")

        b = await start_fleet(load_config(FleetConfig, fleet_args, {}))
        fleets.append(b)
        wb = b.workers[0]
        relay_b = relay_of(wb)
        assert wb.worker_id == wid and relay_b.started_at_ms > relay_a.started_at_ms
        ids = prompt(99, 2)  # fewer, other blocks, numbered from 0 again
        await generate(wb, ids, "b0")
        await wait_for(lambda: flushed(relay_b), 10, "incarnation B's events published")
        b_state = await truth(wb)
        assert set(block_hashes(ids, BLOCK)) <= b_state[wid]["device"]
        assert relay_b.state().event_id < relay_a.state().event_id  # A's ids would hide B's
        assert not b_state[wid]["device"] & a_state[wid]["device"]

        await wait_for(lambda: in_step(live, wid, b_state), 10,
                       lambda: f"the live index to follow B (feed {live.feed.stats})")
        fresh = await start_indexer(load_config(IndexerConfig, [*args, "--group", "fresh"],
                                                {}))
        apps.append(fresh)
        assert await indexed(fresh, wid) == b_state, fresh.feed.stats  # replayed at start
        assert fresh.feed.stats.stale_entries == relay_a.stats.entries, fresh.feed.stats
        assert fresh.feed.stats.gaps == 0
        # B's later events go on into both indexes.
        more = prompt(100, 3)
        await generate(wb, more, "b1")
        await wait_for(lambda: flushed(relay_b), 10, "B's later events published")
        b_state = await truth(wb)
        for app in apps:
            await wait_for(lambda: in_step(app, wid, b_state), 10,  # noqa: B023 (awaited here)
                           lambda: f"index in step with B ({app.feed.stats})")  # noqa: B023
    finally:
        for f in fleets:
            await f.stop()
        for app in apps:
            await app.server.stop()


def stored(i: int) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": [i], "parent_block_hash": None,
            "token_ids": [i, i + 1, i + 2, i + 3], "block_size": 4, "medium": "GPU"}


async def test_a_new_process_publishing_before_its_record_replaces_the_old_one(
        etcd: Child, redis_server: Child, tmp_path: Path) -> None:
    ns, wid = "incarn2", "inc-w"
    url = f"redis://{redis_server.address}"
    a_ms, b_ms = 1_700_000_000_000, 1_700_000_060_000
    rec = discovery_pb2.InstanceRecord(instance_id=wid, component="worker",
                                       address="127.0.0.1:1", pid=101, started_at_ms=a_ms,
                                       capabilities=["kv_events"])
    reg = Registration(etcd.address, ns, rec, 2)
    await reg.start()  # A's record, still in etcd (A crashed within its lease)

    def relay(ms: int) -> KvEventRelay:
        return KvEventRelay(wid, 4, url, stream_name(ns), EventEndpoints(tmp_path, "", ""),
                            started_at_ms=ms)

    relay_a, relay_b = relay(a_ms), relay(b_ms)
    feed: IndexFeed | None = None
    try:
        await relay_a.start(zmq_input=False)
        await relay_b.start(zmq_input=False)
        relay_a.submit([stored(i) for i in range(6)])
        await wait_for(lambda: relay_a.stats.events == 6, 10, "A's events published")
        relay_b.submit([stored(i) for i in (50, 51)])  # B numbers from 0 again
        await wait_for(lambda: relay_b.stats.events == 2, 10, "B's events published")
        b_blocks = {h for t in relay_b.state().tiers for h in t.block_hashes}

        feed = IndexFeed(KvIndex(), url, etcd.address, ns, "ix", clock=Clock())
        await feed.start()  # replays A's entries, then B's
        assert feed.index.dump() == {wid: {"device": frozenset(b_blocks)}}, feed.stats
        assert (feed.stats.incarnation_restarts, feed.stats.stale_entries) == (1, 0)
        assert feed.index.next_event_id(wid) == 2

        relay_a.submit([stored(i) for i in (60, 61)])  # a zombie A's late events
        await wait_for(lambda: feed is not None and feed.stats.stale_entries == 1, 10,
                       lambda: f"A's late entry ignored and counted ({feed and feed.stats})")
        assert feed.index.dump() == {wid: {"device": frozenset(b_blocks)}}

        removed = feed.stats.workers_removed
        await reg.update(discovery_pb2.InstanceRecord(
            instance_id=wid, component="worker", address="127.0.0.1:2", pid=202,
            started_at_ms=b_ms, capabilities=["kv_events"]))  # B registers
        await wait_for(lambda: feed is not None and feed._incarnations.live(wid) == b_ms, 10,
                       "the feed to see B's record")
        assert feed.stats.workers_removed == removed  # the index already followed B
        assert feed.index.dump() == {wid: {"device": frozenset(b_blocks)}}
        relay_b.submit([stored(70)])
        await wait_for(lambda: feed is not None and feed.index.next_event_id(wid) == 3, 10,
                       "B's next event applied")
        assert feed.stats.gaps == 0
    finally:
        if feed is not None:
            await feed.close()
        await relay_a.close()
        await relay_b.close()
        await reg.close()
