"""Router replica sync on a real redis-server: two routers' cores see each other's
in-flight load, a leaving replica drops at once, a silent one expires, a malformed entry
is skipped and counted, and a Redis restart is survived (failures counted, then the sync
resumes by itself)."""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from services.common.config import load_config
from services.common.procs import Child, free_port, start_redis
from services.common.redis_acl import sync_stream
from services.router.core import RouterCore
from services.router.disagg import DisaggConfig
from services.router.main import RouterConfig, start_router
from services.router.peers import Share
from services.router.plan import WorkerRecord
from services.router.policies.base import RouteContext
from services.router.policy_setup import default_registry
from services.router.replica_sync import ReplicaSync, encode_load
from tests.integration.conftest import base_args
from tests.waiting import wait_for

WORKERS = [WorkerRecord(f"w{i}", f"addr-{i}", "m", "agg", 16, 4096) for i in range(2)]


def core() -> RouterCore:
    reg = default_registry()
    c = RouterCore(policy=reg.create("least_loaded", random.Random(0)),
                   prefill_policy=reg.create("least_loaded", random.Random(0)),
                   disagg=DisaggConfig(conditional=False), clock=time.monotonic)
    c.set_workers(WORKERS)
    return c


def ctx(rid: str) -> RouteContext:
    return RouteContext(rid, "m", tuple(range(64)))


async def pair(url: str, ns: str, timeout_s: float = 3.0
               ) -> tuple[ReplicaSync, ReplicaSync]:
    a, b = (ReplicaSync(core(), url, ns, replica_id=r, peer_timeout_s=timeout_s,
                        block_ms=200) for r in "AB")
    await a.start()
    await b.start()
    # each has heard the other (the first snapshot goes out at start)
    await wait_for(lambda: a.core.peers.replicas() == ["B"]
                   and b.core.peers.replicas() == ["A"], 10, "both replicas to meet")
    return a, b


@pytest.fixture
async def synced(redis_server: Child, request: pytest.FixtureRequest
                 ) -> AsyncIterator[tuple[ReplicaSync, ReplicaSync]]:
    a, b = await pair(f"redis://{redis_server.address}", f"sync-{request.node.name[:20]}")
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


async def test_a_route_and_its_release_on_one_replica_reach_the_other(
        synced: tuple[ReplicaSync, ReplicaSync]) -> None:
    a, b = synced
    wid = a.core.route(ctx("r1")).worker.instance_id
    await wait_for(lambda: b.core.in_flight() == {wid: 1}, 10,
                   lambda: f"B to count A's request on {wid} ({b.core.in_flight()})")
    assert b.core.active_blocks() == {wid: 4}
    # B now routes its own request to the other worker
    assert b.core.route(ctx("r2")).worker.instance_id != wid
    a.core.release("r1")
    b.core.release("r2")
    await wait_for(lambda: b.core.in_flight() == {} and a.core.in_flight() == {}, 10,
                   lambda: f"both releases to reach the peer (A {a.core.in_flight()}, "
                           f"B {b.core.in_flight()})")
    assert a.stats.read_failures == b.stats.publish_failures == 0


async def test_a_replica_that_joins_hears_the_live_peers_at_once(
        redis_server: Child) -> None:
    """A's first snapshot went out before B started; A's next heartbeat is 200 s away
    (peer timeout 600 s): B still counts A at once, from the stream's recent entries."""
    url = f"redis://{redis_server.address}"
    a = ReplicaSync(core(), url, "sync-join", replica_id="A", peer_timeout_s=600,
                    block_ms=200)
    await a.start()
    b = ReplicaSync(core(), url, "sync-join", replica_id="B", peer_timeout_s=600,
                    block_ms=200)
    try:
        await wait_for(lambda: a.stats.published >= 1, 10, "A's first snapshot")
        a.core.route(ctx("r1"))
        await wait_for(lambda: a.stats.published >= 2, 10, "A's snapshot with r1")
        await b.start()
        await wait_for(lambda: b.core.peers.replicas() == ["A"]
                       and sum(b.core.in_flight().values()) == 1, 10, "B to count A")
    finally:
        await a.close()
        await b.close()


async def test_a_leaving_replica_is_dropped_at_once(redis_server: Child) -> None:
    a, b = await pair(f"redis://{redis_server.address}", "sync-leave", timeout_s=600)
    try:
        a.core.route(ctx("r1"))
        await wait_for(lambda: sum(b.core.in_flight().values()) == 1, 10, "B to count A")
        await a.close()
        # the peer timeout is 10 minutes: only A's leaving snapshot can drop it
        await wait_for(lambda: b.core.peers.count() == 0 and b.core.in_flight() == {}, 10,
                       "B to drop A on its leaving snapshot")
    finally:
        await a.close()
        await b.close()


async def test_a_silent_replica_expires_and_a_malformed_entry_is_skipped(
        redis_server: Child) -> None:
    url, ns = f"redis://{redis_server.address}", "sync-silent"
    b = ReplicaSync(core(), url, ns, replica_id="B", peer_timeout_s=1.0, block_ms=200)
    await b.start()
    raw = aioredis.Redis.from_url(url)
    try:
        await wait_for(lambda: b.stats.published >= 1, 10, "B's first snapshot")
        await raw.xadd(sync_stream(ns), {b"r": b"junk", b"d": b"\xff\xff not a proto"})
        ghost = encode_load("ghost", 1, {"w0": Share(3, 3, 0, 0)})
        await raw.xadd(sync_stream(ns), {b"r": b"ghost", b"d": ghost.SerializeToString()})
        await wait_for(lambda: b.core.in_flight() == {"w0": 3}, 10, "B to count the ghost")
        assert b.stats.bad_entries == 1
        # the ghost never speaks again: it expires after the 1 s peer timeout
        await wait_for(lambda: b.core.peers.count() == 0, 10, "the silent ghost to expire")
        assert b.core.in_flight() == {} and b.stats.expired_peers == 1
    finally:
        await raw.aclose()
        await b.close()


async def test_a_redis_restart_is_counted_and_the_sync_resumes(log_dir: Path) -> None:
    port = free_port()
    redis = start_redis(log_dir, port)
    url = f"redis://127.0.0.1:{port}"
    a, b = await pair(url, "sync-restart", timeout_s=1.5)
    try:
        redis.stop()
        await wait_for(lambda: a.stats.read_failures >= 1 and b.stats.read_failures >= 1,
                       20, lambda: f"both readers to fail (A {a.stats}, B {b.stats})")
        a.core.route(ctx("r1"))  # a change while Redis is down: published once it is back
        await wait_for(lambda: a.stats.publish_failures >= 1, 20,
                       lambda: f"A's publish to fail ({a.stats})")
        # with no word from each other, both drop their peer
        await wait_for(lambda: a.core.peers.count() == 0 and b.core.peers.count() == 0, 20,
                       "the peers to expire during the outage")
        redis = start_redis(log_dir, port)  # empty: no persistence
        await wait_for(lambda: sum(b.core.in_flight().values()) == 1, 30,
                       lambda: f"B to hear A's request after the restart ({b.stats})")
        await wait_for(lambda: a.core.peers.replicas() == ["B"], 30,
                       lambda: f"A to hear B after the restart ({a.stats})")
    finally:
        await a.close()
        await b.close()
        redis.stop()


async def test_a_router_process_with_replica_sync_joins_and_leaves_after_its_calls(
        etcd: Child, redis_server: Child) -> None:
    """``--replica-sync`` on a router: a peer meets it, and its leaving snapshot goes out
    once its gRPC server has stopped (an after_stop hook: calls in flight during the grace
    period still publish their releases)."""
    url, ns = f"redis://{redis_server.address}", "sync-router"
    app = await start_router(load_config(RouterConfig, [
        *base_args(etcd.address, ns), "--redis-url", url, "--replica-sync",
        "--replica-peer-timeout-s", "600"], {}))
    peer = ReplicaSync(core(), url, ns, replica_id="peer", peer_timeout_s=600, block_ms=200)
    await peer.start()
    try:
        assert app.sync is not None and app.sync.close in app.server.after_stop
        assert app.sync.close not in app.server.on_stop
        rid = app.sync.replica_id
        await wait_for(lambda: peer.core.peers.replicas() == [rid], 10, "the peer to meet it")
        await app.server.stop()
        await wait_for(lambda: peer.core.peers.count() == 0, 10,
                       "the peer to drop the stopped router on its leaving snapshot")
    finally:
        await app.server.stop()
        await peer.close()
