"""The store master over gRPC, in process, on real etcd and Redis: the main flows, the error
codes, leases, liveness, zombies, eviction, and a restart that keeps the metadata.

The master runs on a fake clock the tests advance (``start_store_master(clock=...)``), so
no test sleeps out a lease or TTL; its real ticker still does the periodic work, and
:func:`ticks` waits for it to have run after a clock change."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc
import pytest

from protos import store_pb2, store_pb2_grpc
from services.common.config import ConfigError, load_config
from services.common.discovery import InstanceWatcher
from services.common.procs import Child
from services.store_master.main import StoreMasterApp, StoreMasterConfig, start_store_master
from services.store_master.persist import RedisMetadata
from tests.integration.conftest import base_args
from tests.manual_clock import Clock
from tests.store_inproc import ticks
from workers.store_node import StoreNodeConfig, discover_master

_ns = itertools.count()


def ns() -> str:
    return f"store{next(_ns)}"


def config(etcd: Child, redis_server: Child | None, namespace: str,
           *extra: str) -> StoreMasterConfig:
    args = [*base_args(etcd.address, namespace), "--tick-interval-s", "0.05", *extra]
    if redis_server is not None:
        args += ["--redis-url", f"redis://{redis_server.address}"]
    return load_config(StoreMasterConfig, args, {})


Starter = Callable[..., Coroutine[Any, Any, tuple[StoreMasterApp, store_pb2_grpc.StoreMasterStub]]]


@pytest.fixture
async def start(etcd: Child, redis_server: Child) -> AsyncIterator[Starter]:
    apps: list[StoreMasterApp] = []
    channels: list[grpc.aio.Channel] = []

    async def go(namespace: str, *extra: str, redis: bool = True, clock: Clock | None = None
                 ) -> tuple[StoreMasterApp, store_pb2_grpc.StoreMasterStub]:
        app = await start_store_master(config(etcd, redis_server if redis else None,
                                              namespace, *extra), clock=clock or Clock())
        apps.append(app)
        ch = grpc.aio.insecure_channel(app.server.address)
        channels.append(ch)
        return app, store_pb2_grpc.StoreMasterStub(ch)

    yield go
    for ch in channels:
        await ch.close()
    for app in apps:
        await app.server.stop()


async def code_of(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code()


def key(k: str) -> store_pb2.KeyRequest:
    return store_pb2.KeyRequest(key=k)


async def mount(stub: store_pb2_grpc.StoreMasterStub, client: str, seg: str,
                size: int = 1000) -> None:
    await stub.MountSegment(store_pb2.MountSegmentRequest(
        client_id=client, segment_id=seg, base=1 << 30, size=size, endpoint=f"nixl-{client}"))


async def test_put_get_remove_flow_and_error_codes(start: Starter) -> None:
    clock = Clock()
    app, stub = await start(ns(), "--read-lease-ttl-s", "1.0", clock=clock)
    await mount(stub, "c0", "s0")
    await mount(stub, "c1", "s1")
    started = await stub.PutStart(store_pb2.PutStartRequest(key="k", size=100, replicas=2))
    assert sorted(r.segment_id for r in started.replicas) == ["s0", "s1"]
    assert {r.state for r in started.replicas} == {store_pb2.REPLICA_STATE_PROCESSING}
    r0 = started.replicas[0]
    assert r0.address == (1 << 30) + r0.offset and r0.endpoint == f"nixl-{r0.client_id}"

    # Not served before PutEnd.
    assert not (await stub.ExistKey(key("k"))).exists
    assert await code_of(stub.GetReplicaList(key("k"))) == grpc.StatusCode.FAILED_PRECONDITION
    assert await code_of(stub.Remove(key("k"))) == grpc.StatusCode.FAILED_PRECONDITION
    assert await code_of(stub.PutStart(store_pb2.PutStartRequest(key="k", size=1))) == \
        grpc.StatusCode.ALREADY_EXISTS

    ended = await stub.PutEnd(key("k"))
    assert {r.state for r in ended.replicas} == {store_pb2.REPLICA_STATE_COMPLETE}
    got = await stub.GetReplicaList(key("k"))
    assert got.size == 100 and len(got.replicas) == 2 and got.lease_until > 0
    assert list((await stub.BatchExistKey(
        store_pb2.BatchExistKeyRequest(keys=["k", "nope"]))).exists) == [True, False]

    # Leased: Remove refused until the lease runs out.
    assert await code_of(stub.Remove(key("k"))) == grpc.StatusCode.FAILED_PRECONDITION
    clock.advance(0.9)
    assert await code_of(stub.Remove(key("k"))) == grpc.StatusCode.FAILED_PRECONDITION
    clock.advance(0.2)
    await stub.Remove(key("k"))
    assert await code_of(stub.GetReplicaList(key("k"))) == grpc.StatusCode.NOT_FOUND

    # Revoke of a put in progress; of a complete object it is refused.
    await stub.PutStart(store_pb2.PutStartRequest(key="r", size=10))
    await stub.PutRevoke(key("r"))
    assert await code_of(stub.PutEnd(key("r"))) == grpc.StatusCode.NOT_FOUND
    await stub.PutStart(store_pb2.PutStartRequest(key="r", size=10))
    await stub.PutEnd(key("r"))
    assert await code_of(stub.PutRevoke(key("r"))) == grpc.StatusCode.FAILED_PRECONDITION
    await stub.SetPin(store_pb2.SetPinRequest(key="r", pin=store_pb2.PIN_HARD))
    assert app.master.get_object("r").pin.name == "HARD"  # type: ignore[union-attr]
    assert (await stub.RemoveAll(store_pb2.RemoveAllRequest())).removed == 1

    bad = [
        stub.PutStart(store_pb2.PutStartRequest(key="", size=1)),
        stub.PutStart(store_pb2.PutStartRequest(key="x", size=0)),
        stub.PutStart(store_pb2.PutStartRequest(key="x", size=1, replicas=-1)),
        stub.PutStart(store_pb2.PutStartRequest(key="x", size=1, replicas=99)),
        stub.PutStart(store_pb2.PutStartRequest(key="x", size=1, pin=7)),  # type: ignore[arg-type]
        stub.SetPin(store_pb2.SetPinRequest(key="r", pin=9)),  # type: ignore[arg-type]
        stub.ExistKey(key("")),
        stub.BatchExistKey(store_pb2.BatchExistKeyRequest(keys=["a", ""])),
        stub.Ping(store_pb2.PingRequest()),
        stub.MountSegment(store_pb2.MountSegmentRequest(client_id="c", segment_id="s",
                                                        size=0)),
        stub.MountSegment(store_pb2.MountSegmentRequest(segment_id="s", size=10)),
    ]
    for call in bad:
        assert await code_of(call) == grpc.StatusCode.INVALID_ARGUMENT
    assert await code_of(stub.PutStart(store_pb2.PutStartRequest(key="x", size=5000))) == \
        grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await code_of(stub.MountSegment(store_pb2.MountSegmentRequest(
        client_id="other", segment_id="s0", base=1 << 30, size=1000))) == \
        grpc.StatusCode.ALREADY_EXISTS
    assert await code_of(stub.UnmountSegment(store_pb2.UnmountSegmentRequest(
        client_id="other", segment_id="s0"))) == grpc.StatusCode.NOT_FOUND
    for rpc in (stub.PutEnd, stub.PutRevoke, stub.Remove, stub.GetReplicaList):
        assert await code_of(rpc(key("missing"))) == grpc.StatusCode.NOT_FOUND
    # Unparseable bytes → INVALID_ARGUMENT (the common server interceptor).
    raw = grpc.aio.insecure_channel(app.server.address)
    try:
        call = raw.unary_unary("/kvmesh.store.StoreMaster/PutStart")
        assert await code_of(call(b"\xff\xff\xff")) == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await raw.close()

    stats = await stub.Stats(store_pb2.StatsRequest())
    assert (stats.capacity, stats.segments, stats.clients, stats.objects) == (2000, 2, 2, 0)
    assert stats.puts_started == 3 and stats.puts_revoked == 1 and stats.objects_removed == 2
    assert stats.records_persisted > 0 and stats.persist_failures == 0


async def test_batch_rpcs_report_each_item_like_its_single_rpc(start: Starter) -> None:
    app, stub = await start(ns())
    await mount(stub, "c0", "s0")
    C = grpc.StatusCode

    def codes(results: Any) -> list[grpc.StatusCode]:
        by_value = {c.value[0]: c for c in grpc.StatusCode}
        return [by_value[r.code] for r in results]

    await stub.PutStart(store_pb2.PutStartRequest(key="old", size=10))
    started = await stub.BatchPutStart(store_pb2.BatchPutStartRequest(items=[
        store_pb2.PutStartRequest(key="a", size=100),
        store_pb2.PutStartRequest(key="old", size=10),  # being written already
        store_pb2.PutStartRequest(key="huge", size=5000),  # no segment has room
        store_pb2.PutStartRequest(key="", size=1),
        store_pb2.PutStartRequest(key="b", size=200)]))
    assert codes(r.status for r in started.results) == [
        C.OK, C.ALREADY_EXISTS, C.RESOURCE_EXHAUSTED, C.INVALID_ARGUMENT, C.OK]
    assert started.results[2].status.message  # says why
    assert [len(r.replicas) for r in started.results] == [1, 0, 0, 0, 1]
    assert started.results[4].replicas[0].size == 200

    got = await stub.BatchGetReplicaList(store_pb2.BatchKeysRequest(keys=["a", "zzz"]))
    assert codes(r.status for r in got.results) == [C.FAILED_PRECONDITION, C.NOT_FOUND]
    ended = await stub.BatchPutEnd(store_pb2.BatchKeysRequest(keys=["a", "b", "zzz"]))
    assert codes(ended.results) == [C.OK, C.OK, C.NOT_FOUND]
    revoked = await stub.BatchPutRevoke(store_pb2.BatchKeysRequest(keys=["old", "a"]))
    assert codes(revoked.results) == [C.OK, C.FAILED_PRECONDITION]  # "a" is complete

    got = await stub.BatchGetReplicaList(store_pb2.BatchKeysRequest(keys=["b", "a", "old"]))
    assert codes(r.status for r in got.results) == [C.OK, C.OK, C.NOT_FOUND]
    assert [r.list.size for r in got.results] == [200, 100, 0]
    assert all(r.list.lease_until > 0 for r in got.results[:2])  # leases granted
    assert await code_of(stub.Remove(key("a"))) == C.FAILED_PRECONDITION  # leased
    stats = await stub.Stats(store_pb2.StatsRequest())
    assert stats.puts_completed == 2 and stats.puts_revoked == 1 and stats.complete_objects == 2

    too_many = store_pb2.BatchKeysRequest(keys=[f"k{i}" for i in range(4097)])
    assert await code_of(stub.BatchPutEnd(too_many)) == C.INVALID_ARGUMENT
    assert await code_of(stub.BatchPutStart(store_pb2.BatchPutStartRequest(items=[
        store_pb2.PutStartRequest(key="p", size=1, pin=7)]))) == C.INVALID_ARGUMENT  # type: ignore[arg-type]
    assert app.master.get_object("p") is None  # a refused batch starts nothing


async def test_registers_in_etcd(start: Starter, etcd: Child) -> None:
    namespace = ns()
    app, _ = await start(namespace)
    watcher = InstanceWatcher(etcd.address, namespace, "store_master")
    await watcher.start()
    try:
        found = list(watcher.instances().values())
        assert [r.address for r in found] == [app.server.address]
        assert found[0].labels["persist"] == "redis"
    finally:
        await watcher.close()
    # What a store node started without --store-master connects to.
    node_cfg = StoreNodeConfig(etcd_endpoint=etcd.address, namespace=namespace)
    assert await discover_master(node_cfg, timeout_s=10) == app.server.address
    with pytest.raises(ConfigError, match="no store_master"):
        await discover_master(StoreNodeConfig(etcd_endpoint=etcd.address,
                                              namespace=ns()), timeout_s=0.3)


async def test_client_liveness_zombies_and_eviction(start: Starter) -> None:
    # Exact LRU: the default sampled LRU draws 8 of the 9 objects at random, so it would
    # miss "both" one time in nine.
    clock = Clock()
    app, stub = await start(ns(), "--client-ttl-s", "1.0", "--put-timeout-s", "0.4",
                            "--read-lease-ttl-s", "0.2", "--persist", "none",
                            "--eviction-policy", "lru", clock=clock)
    await mount(stub, "alive", "sa", size=100)
    await mount(stub, "dead", "sd", size=100)
    await stub.PutStart(store_pb2.PutStartRequest(key="both", size=10, replicas=2))
    await stub.PutEnd(key("both"))
    await stub.PutStart(store_pb2.PutStartRequest(key="zombie", size=10,
                                                  preferred_segment="sa"))
    for _ in range(15):  # "alive" pings, "dead" does not
        clock.advance(0.1)
        assert (await stub.Ping(store_pb2.PingRequest(client_id="alive"))).known
    await ticks(app)
    assert not (await stub.Ping(store_pb2.PingRequest(client_id="dead"))).known
    got = await stub.GetReplicaList(key("both"))
    assert [r.segment_id for r in got.replicas] == ["sa"]
    assert await code_of(stub.PutEnd(key("zombie"))) == grpc.StatusCode.NOT_FOUND
    stats = await stub.Stats(store_pb2.StatsRequest())
    assert (stats.clients_lost, stats.zombies_reclaimed, stats.segments) == (1, 1, 1)

    # Fill "sa" to the watermark once "both"'s lease is over: the next tick evicts the least
    # recently used object, "both".
    clock.advance(0.3)
    for i in range(8):
        await stub.PutStart(store_pb2.PutStartRequest(key=f"f{i}", size=10))
        await stub.PutEnd(key(f"f{i}"))
    await ticks(app)
    await stub.Ping(store_pb2.PingRequest(client_id="alive"))
    stats = await stub.Stats(store_pb2.StatsRequest())
    assert stats.objects_evicted == 1 and stats.used == 80
    assert await code_of(stub.GetReplicaList(key("both"))) == grpc.StatusCode.NOT_FOUND


async def test_restart_keeps_metadata(start: Starter, redis_server: Child) -> None:
    namespace = ns()
    clock = Clock()
    app, stub = await start(namespace, "--client-ttl-s", "30", clock=clock)
    await mount(stub, "c0", "s0")
    await mount(stub, "c1", "s1")
    await stub.PutStart(store_pb2.PutStartRequest(key="a", size=100, replicas=2,
                                                  pin=store_pb2.PIN_SOFT))
    await stub.PutEnd(key("a"))
    await stub.PutStart(store_pb2.PutStartRequest(key="b", size=50))
    await stub.PutEnd(key("b"))
    await stub.PutStart(store_pb2.PutStartRequest(key="pending", size=10))
    await stub.PutStart(store_pb2.PutStartRequest(key="gone", size=10))
    await stub.PutRevoke(key("gone"))
    before = {k: (await stub.GetReplicaList(key(k))).replicas for k in ("a", "b")}
    stats = await stub.Stats(store_pb2.StatsRequest())
    await app.server.stop()

    app2, stub2 = await start(namespace, "--client-ttl-s", "30", clock=clock)
    assert app2.restored is not None
    assert (app2.restored.segments, app2.restored.objects) == (2, 3)
    assert app2.master.keys() == ["a", "b", "pending"]
    for k, reps in before.items():
        assert (await stub2.GetReplicaList(key(k))).replicas == reps
    stats2 = await stub2.Stats(store_pb2.StatsRequest())
    assert (stats2.capacity, stats2.used, stats2.objects, stats2.complete_objects) == \
        (stats.capacity, stats.used, 3, 2)
    # The put in progress survives and can still complete.
    await stub2.PutEnd(key("pending"))
    # Clients remount idempotently and keep pinging.
    assert not (await stub2.MountSegment(store_pb2.MountSegmentRequest(
        client_id="c0", segment_id="s0", base=1 << 30, size=1000))).mounted
    assert (await stub2.Ping(store_pb2.PingRequest(client_id="c1"))).known
    # New allocations do not overlap restored ones.
    new = await stub2.PutStart(store_pb2.PutStartRequest(key="c", size=100,
                                                         preferred_segment="s0"))
    old = [r for r in before["a"] if r.segment_id == "s0"][0]
    assert new.replicas[0].offset >= old.offset + old.size or \
        new.replicas[0].offset + 100 <= old.offset

    # What Redis holds equals the master's snapshot (write-through).
    await app2.server.stop()
    store = RedisMetadata(f"redis://{redis_server.address}", namespace)
    try:
        segs, objs = await store.load()
        assert sorted(o["key"] for o in objs) == ["a", "b", "c", "pending"]
        assert sorted(s["segment_id"] for s in segs) == ["s0", "s1"]
        await store.clear()
        assert await store.load() == ([], [])
    finally:
        await store.close()


async def test_without_redis_metadata_is_not_kept(start: Starter) -> None:
    namespace = ns()
    app, stub = await start(namespace, redis=False)
    assert not app.persister.enabled
    await mount(stub, "c0", "s0")
    await app.server.stop()
    app2, stub2 = await start(namespace, redis=False)
    assert app2.restored is None
    assert (await stub2.Stats(store_pb2.StatsRequest())).segments == 0


async def test_limits_and_overflows_are_invalid_argument_naming_the_field(
        start: Starter) -> None:
    _, stub = await start(ns())
    await mount(stub, "c0", "s0")
    long = "k" * 4097  # the key limit is 4096 bytes (MasterParams.max_key_bytes)

    def mount_req(**kw: Any) -> store_pb2.MountSegmentRequest:
        return store_pb2.MountSegmentRequest(**{"client_id": "c", "segment_id": "s",
                                                "base": 0, "size": 10, **kw})

    cases: list[tuple[Any, str]] = [
        (stub.MountSegment(mount_req(base=(1 << 64) - 10, size=100)), "base + size"),
        (stub.MountSegment(mount_req(size=0)), "size"),
        (stub.MountSegment(mount_req(size=(1 << 64) - 1)), "capacity"),  # 1000 + that
        (stub.MountSegment(mount_req(client_id=long)), "client_id"),
        (stub.MountSegment(mount_req(segment_id="")), "segment_id"),
        (stub.MountSegment(mount_req(endpoint=long)), "endpoint"),
        (stub.BatchExistKey(store_pb2.BatchExistKeyRequest(
            keys=[f"k{i}" for i in range(100_000)])), "at most 4096"),
        (stub.BatchExistKey(store_pb2.BatchExistKeyRequest(keys=["a", long])), "keys[1]"),
        (stub.BatchExistKey(store_pb2.BatchExistKeyRequest(keys=["", "a"])), "keys[0]"),
        (stub.BatchGetReplicaList(store_pb2.BatchKeysRequest(
            keys=["k"] * 4097)), "keys: a batch holds at most 4096"),
        (stub.BatchPutStart(store_pb2.BatchPutStartRequest(
            items=[store_pb2.PutStartRequest(key="k", size=1)] * 4097)), "items"),
        (stub.ExistKey(key(long)), "4096 bytes"),
        (stub.PutStart(store_pb2.PutStartRequest(key=long, size=1)), "4096 bytes"),
        (stub.GetReplicaList(key("")), "key must not be empty"),
    ]
    for call, text in cases:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, text
        assert text in (info.value.details() or ""), (text, info.value.details())
    # At the limits: accepted.
    assert (await stub.MountSegment(mount_req(segment_id="top", base=(1 << 64) - 10,
                                              size=10))).mounted
    assert len((await stub.BatchExistKey(store_pb2.BatchExistKeyRequest(
        keys=["k" * 4096] * 4096))).exists) == 4096
    stats = await stub.Stats(store_pb2.StatsRequest())
    assert stats.capacity == 1010


def _extreme(cls: Any, variant: int, depth: int = 0) -> Any:
    """A request of ``cls`` with every field at an extreme (variant 0: maximal numbers and
    4097-long lists, 1: minimal numbers and empty strings, 2: 5000-byte strings)."""
    from google.protobuf.descriptor import FieldDescriptor as F

    msg = cls()
    ints = {F.TYPE_UINT64: ((1 << 64) - 1, 0), F.TYPE_INT64: ((1 << 63) - 1, -(1 << 63)),
            F.TYPE_INT32: ((1 << 31) - 1, -(1 << 31)), F.TYPE_ENUM: ((1 << 31) - 1, -1),
            F.TYPE_UINT32: ((1 << 32) - 1, 0)}
    for f in msg.DESCRIPTOR.fields:
        if f.type == F.TYPE_STRING:
            value: Any = ["", "", "x" * 5000][variant] if variant else "k"
        elif f.type in ints:
            value = ints[f.type][variant % 2]
        elif f.type == F.TYPE_BOOL:
            value = True
        elif f.type == F.TYPE_DOUBLE:
            value = float("nan")
        else:
            value = None
        repeated = f.is_repeated
        if f.type == F.TYPE_MESSAGE:
            if depth == 0:
                n = 4097 if variant == 0 else 3
                sub = _extreme(f.message_type._concrete_class, variant, depth + 1)
                if repeated:
                    getattr(msg, f.name).extend([sub] * n)
                else:
                    getattr(msg, f.name).CopyFrom(sub)
        elif value is not None:
            if repeated:
                getattr(msg, f.name).extend([value] * (4097 if variant == 0 else 3))
            else:
                setattr(msg, f.name, value)
    return msg


async def test_no_request_answers_unknown_or_internal(start: Starter) -> None:
    _, stub = await start(ns())
    await mount(stub, "c0", "s0")
    service = store_pb2.DESCRIPTOR.services_by_name["StoreMaster"]
    seen: dict[str, set[grpc.StatusCode]] = {}
    for method in service.methods:
        for variant in range(3):
            req = _extreme(method.input_type._concrete_class, variant)
            try:
                await getattr(stub, method.name)(req)
                code = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
            seen.setdefault(method.name, set()).add(code)
    bad = {m: c for m, c in seen.items()
           if c & {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}}
    assert not bad, bad
