"""Redis restarts under the indexer and the store master, on a real redis-server of this
test's own (restarted on the same port), both with its data wiped (no persistence) and
with its data kept (AOF, ``appendfsync everysec``; a SIGTERM fsyncs before it exits).

- The indexer follows a mock worker's KV events. Events the bus acknowledged and then
  lost (``drop_next``, as in a crash between an XADD and its fsync) with no later event to
  reveal the gap, and events the worker kept while Redis was down: after the restart the
  indexer recreates its group (wiped) or keeps it (AOF), resyncs every worker, and its
  Dump equals the worker's GetKvState, with a bounded number of log lines and no
  traceback.
- The store master notices the restart, rewrites its whole metadata, and a master
  restarted after that restores every object; a FLUSHALL (no restart) is noticed too.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis

from protos import (
    common_pb2,
    indexer_pb2,
    indexer_pb2_grpc,
    kv_events_pb2,
    store_pb2,
    store_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.block_hash import block_hashes
from services.common.config import load_config
from services.common.procs import Child, free_port, port_open, wait_until, which_or_raise
from services.indexer.main import IndexerApp, IndexerConfig, start_indexer
from services.indexer.service import MAX_QUERY_BLOCKS
from services.store_master.main import StoreMasterConfig, start_store_master
from services.store_master.persist import RedisMetadata
from tests.faults.table import FaultTable
from tests.integration.conftest import base_args
from tests.manual_clock import Clock
from tests.waiting import wait_for
from workers.fleet import Fleet, FleetConfig, FleetWorker, start_fleet

BLOCK = 16
MODES = ("wiped", "aof")


class OwnRedis:
    """A redis-server this test starts, stops (by PID) and starts again on one port."""

    def __init__(self, work: Path, mode: str) -> None:
        self.work, self.mode = work, mode
        self.port = free_port()
        self.child: Child | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        keep = (["--appendonly", "yes", "--appendfsync", "everysec"] if self.mode == "aof"
                else ["--appendonly", "no"])
        self.starts += 1
        log_path = self.work / f"redis-{self.mode}-{self.starts}.log"
        argv = [which_or_raise("redis-server"), "--bind", "127.0.0.1", "--port",
                str(self.port), "--save", "", "--dir", str(self.work), *keep]
        # A plain Popen (vfork, no preexec_fn): a fork() of this process, whose gRPC threads
        # run, can abort in gRPC's fork handler before the exec.
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        child = Child(f"redis-{self.mode}", proc, log_path)
        wait_until(lambda: port_open("127.0.0.1", self.port), child, 10, "redis to listen")
        self.child = child

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()
            self.child = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(params=MODES)
def redis_own(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OwnRedis]:
    r = OwnRedis(tmp_path, request.param)
    r.start()
    try:
        yield r
    finally:
        r.stop()


# -- the indexer ------------------------------------------------------------------------


@dataclass
class Mesh:
    fleet: Fleet
    indexer: IndexerApp
    channels: list[grpc.aio.Channel]

    @property
    def worker(self) -> FleetWorker:
        return self.fleet.workers[0]

    def stub(self, address: str) -> grpc.aio.Channel:
        ch = grpc.aio.insecure_channel(address)
        self.channels.append(ch)
        return ch


@pytest.fixture
async def mesh(etcd: Child, redis_own: OwnRedis) -> AsyncIterator[Mesh]:
    ns = f"rr-{redis_own.mode}-{redis_own.port}"
    args = [*base_args(etcd.address, ns), "--redis-url", redis_own.url]
    indexer = await start_indexer(load_config(IndexerConfig, [*args, "--group", "ix"], {}))
    fleet = await start_fleet(load_config(FleetConfig, [
        *args, "--workers", "1", "--block-size", str(BLOCK), "--num-blocks", "512",
        "--max-model-len", "2048", "--timing", "zero", "--worker-id", "rr-"], {}))
    m = Mesh(fleet, indexer, [])
    try:
        await wait_for(lambda: m.worker.worker_id in indexer.feed.live_workers(), 10,
                       "the indexer to see the worker in etcd")
        yield m
    finally:
        for ch in m.channels:
            await ch.close()
        await fleet.stop()
        await indexer.server.stop()


def prompt(seed: int, n_blocks: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 for i in range(n_blocks * BLOCK + 3)]


async def generate(m: Mesh, ids: list[int], tag: str) -> None:
    stub = worker_pb2_grpc.WorkerStub(m.stub(m.worker.address))
    req = worker_pb2.GenerateRequest(request_id=tag, token_ids=ids, model="mock",
                                     sampling=common_pb2.SamplingParams(max_tokens=2))
    async for _ in stub.Generate(req):
        pass


def as_sets(states: list[kv_events_pb2.KvState]) -> dict[str, dict[str, set[int]]]:
    return {s.worker_id: {t.tier: set(t.block_hashes) for t in s.tiers if t.block_hashes}
            for s in states if any(t.block_hashes for t in s.tiers)}


async def in_sync(m: Mesh) -> bool:
    """The indexer's Dump of the worker equals the worker's GetKvState (and is not empty)."""
    ix = indexer_pb2_grpc.IndexerStub(m.stub(m.indexer.server.address))
    dump = await ix.Dump(indexer_pb2.DumpRequest(worker_id=m.worker.worker_id))
    truth = await worker_pb2_grpc.WorkerStub(m.stub(m.worker.address)).GetKvState(
        kv_events_pb2.KvStateRequest())
    return bool(truth.tiers) and as_sets(list(dump.workers)) == as_sets([truth])


def holds(m: Mesh, ids: list[int]) -> bool:
    """The worker's own state holds every full block of ``ids``."""
    relay = m.worker.relay
    assert relay is not None
    held = {h for t in relay.state().tiers for h in t.block_hashes}
    return set(block_hashes(ids, BLOCK)) <= held


def flushed(m: Mesh) -> bool:
    relay = m.worker.relay
    assert relay is not None
    s = relay.stats
    return s.events + s.dropped_on_purpose + s.dropped_backlog == relay.state().event_id + 1


async def test_indexer_recovers_from_a_redis_restart(mesh: Mesh, redis_own: OwnRedis,
                                                     fault_table: FaultTable,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    m = mesh
    relay = m.worker.relay
    assert relay is not None
    feed = m.indexer.feed
    await generate(m, prompt(1, 4), "before")
    await wait_for(lambda: in_sync(m), 10, "the index in sync before the restart")

    # Events the bus lost after acknowledging them, with no later event to show the gap.
    relay.drop_next(1_000_000)
    lost = prompt(2, 5)
    await generate(m, lost, "lost")
    await wait_for(lambda: holds(m, lost) and flushed(m), 10, "the lost events numbered")
    relay.drop_next(0)
    assert not await in_sync(m)

    caplog.set_level(logging.INFO)
    caplog.clear()
    redis_own.stop()
    failures = relay.stats.publish_failures
    during = prompt(3, 3)
    await generate(m, during, "during")  # the relay keeps these while Redis is down
    await wait_for(lambda: relay.stats.publish_failures > failures, 20,
                   "the relay to fail a publish while Redis is down")
    redis_own.start()

    await wait_for(lambda: in_sync(m), 30,
                   lambda: f"the index in sync after the {redis_own.mode} restart "
                           f"(feed {feed.stats})")
    assert feed.stats.bus_resets >= 1 and feed.stats.resyncs >= 1
    fault_table.record(f"Redis restart ({redis_own.mode}) under the indexer, events lost",
                       "the index matches the worker again", "the index matches the worker "
                       "again")  # else the wait above failed
    # Later events still flow into the index.
    after = prompt(4, 2)
    await generate(m, after, "after")
    await wait_for(lambda: holds(m, after) and flushed(m), 10, "the relay to publish `after`")
    await wait_for(lambda: in_sync(m), 10, "the index in sync with `after`")
    # One line per reset, a few per outage; never a traceback.
    feed_logs = [r for r in caplog.records if r.name == "services.indexer.feed"
                 or (r.name == "services.common.periodic" and "index-feed" in r.getMessage())]
    assert not [r for r in feed_logs if r.exc_info], [r.getMessage() for r in feed_logs]
    assert len(feed_logs) <= 12, [r.getMessage() for r in feed_logs]
    resets = [r.getMessage() for r in feed_logs if "resyncing" in r.getMessage()]
    assert resets and ("NOGROUP" in resets[0] or "restarted" in resets[0])


async def test_indexer_refuses_oversized_and_negative_queries(mesh: Mesh) -> None:
    ix = indexer_pb2_grpc.IndexerStub(mesh.stub(mesh.indexer.server.address))
    bad = [
        indexer_pb2.FindMatchesRequest(block_hashes=list(range(MAX_QUERY_BLOCKS + 1))),
        indexer_pb2.FindMatchesRequest(token_ids=[1, 2, -3, 4], block_size=2),
        indexer_pb2.FindMatchesRequest(token_ids=[1, 2], block_size=0),
        indexer_pb2.FindMatchesRequest(token_ids=[1, 2], block_size=1 << 30),
        indexer_pb2.FindMatchesRequest(),
    ]
    for req in bad:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await ix.FindMatches(req)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await ix.FindMatches(bad[1])
    assert "token_ids[2]" in (info.value.details() or "")
    ok = await ix.FindMatches(indexer_pb2.FindMatchesRequest(
        block_hashes=list(range(MAX_QUERY_BLOCKS))))
    assert ok.query_blocks == MAX_QUERY_BLOCKS
    assert not (await ix.Dump(indexer_pb2.DumpRequest(worker_id="x" * 100_000))).workers


# -- the store master -------------------------------------------------------------------


async def test_store_master_rewrites_its_metadata_after_a_redis_restart(
        etcd: Child, redis_own: OwnRedis, fault_table: FaultTable) -> None:
    ns = f"rrs-{redis_own.mode}-{redis_own.port}"
    cfg = load_config(StoreMasterConfig, [*base_args(etcd.address, ns), "--redis-url",
                                          redis_own.url, "--tick-interval-s", "0.05"], {})
    clock = Clock()  # never advanced: no lease, TTL or zombie deadline passes
    app = await start_store_master(cfg, clock=clock)
    channels: list[grpc.aio.Channel] = []
    try:
        ch = grpc.aio.insecure_channel(app.server.address)
        channels.append(ch)
        stub = store_pb2_grpc.StoreMasterStub(ch)
        for c in range(2):
            await stub.MountSegment(store_pb2.MountSegmentRequest(
                client_id=f"c{c}", segment_id=f"s{c}", base=1 << 30, size=1 << 20))
        keys = [f"obj-{i}" for i in range(40)]
        for k in keys:
            await stub.PutStart(store_pb2.PutStartRequest(key=k, size=1000, replicas=2))
            await stub.PutEnd(store_pb2.KeyRequest(key=k))
        await stub.PutStart(store_pb2.PutStartRequest(key="pending", size=10))

        redis_own.restart()
        await wait_for(lambda: app.persister.rewrites >= 1, 30,
                       "the master to notice the restart and rewrite its metadata")
        store = RedisMetadata(redis_own.url, ns)
        try:
            segs, objs = await store.load()
            assert sorted(o["key"] for o in objs) == sorted([*keys, "pending"])
            assert sorted(s["segment_id"] for s in segs) == ["s0", "s1"]
        finally:
            await store.close()

        # A FLUSHALL without a restart: the sentinel is gone, so it is noticed too.
        r = aioredis.Redis.from_url(redis_own.url)
        try:
            await r.flushall()
        finally:
            await r.aclose()
        await wait_for(lambda: app.persister.rewrites >= 2, 30,
                       "the master to notice the flushed metadata")

        await app.server.stop()
        app = await start_store_master(cfg, clock=clock)
        assert app.restored is not None
        restored = app.master.stats().complete_objects
        observed = f"{restored}/{len(keys)} complete objects restored by the next master"
        assert fault_table.record(
            f"Redis restart ({redis_own.mode}) under the store master, then a master restart",
            f"{len(keys)}/{len(keys)} complete objects restored by the next master", observed,
            count=len(keys)), observed
        assert (app.restored.segments, app.restored.objects) == (2, len(keys) + 1)
        ch2 = grpc.aio.insecure_channel(app.server.address)
        channels.append(ch2)
        got = await store_pb2_grpc.StoreMasterStub(ch2).GetReplicaList(
            store_pb2.KeyRequest(key=keys[-1]))
        assert got.size == 1000 and len(got.replicas) == 2
    finally:
        for c in channels:
            await c.close()
        await app.server.stop()
