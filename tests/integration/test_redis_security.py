"""Redis with TLS and ACL users per role, and signed KV events, on a real redis-server.

The fixture starts Debian's redis-server the way ``kvmesh up`` does with certificates
(:func:`services.common.procs.start_redis` with a tls folder: TLS only, client
certificates required, the ACL users of :mod:`services.common.redis_acl`) on a free
loopback port, stopped by PID. The client accepts only a server with the redis role's
certificate (one presenting the worker's is refused). The tests check each role's rights
with its own password, and then issue 13's attack: forged entries for worker B (a batch
and a full-state entry) written with the worker password, signed with A's key or
unsigned. The real indexer drops and counts them, indexes B's real signed events, and
still holds B's real state after a restart. A mock fleet's sub-identity: the relay of
``fleet-a.0`` on the fleet certificate ``fleet-a`` is indexed, while entries it signs for
``fleet-b.0``, and those the real worker ``wa`` (no fleet certificate) signs for ``wa.0``,
are dropped as forged.
"""

from __future__ import annotations

import hmac
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError

from protos import discovery_pb2, kv_events_pb2
from services.common.config import load_config
from services.common.discovery import Registration
from services.common.event_bus import STATE, encode_batch, encode_state, mac_input, stream_name
from services.common.procs import Child, start_redis
from services.common.redis_acl import sync_stream
from services.common.redis_conn import REDIS_SERVER_NAME, redis_client
from services.common.tls import ROLES, MeshTls, redis_password_file, write_mesh_certs
from services.indexer.main import IndexerApp, IndexerConfig, start_indexer
from services.store_master.core import Changes
from services.store_master.persist import RedisMetadata
from tests.integration.conftest import base_args
from tests.waiting import wait_for
from workers.kv.event_relay import EventEndpoints, KvEventRelay

NS = "rsec"
STREAM = stream_name(NS)
STORE_KEY = f"kvmesh:{NS}:store:objects"
BS = 4


@dataclass
class SecureRedis:
    certs: Path
    child: Child

    @property
    def url(self) -> str:
        return f"rediss://{self.child.address}"

    def tls(self, stem: str) -> MeshTls:
        return MeshTls.load(self.certs, stem)

    def client(self, role: str, stem: str = "") -> aioredis.Redis:
        return redis_client(self.url, self.tls(stem or role), role)


@pytest.fixture(scope="module")
def secure_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureRedis]:
    certs = tmp_path_factory.mktemp("certs")
    write_mesh_certs(certs, [*ROLES, "worker:wa", "worker:wb", "worker:fleet-a",
                             "worker:fleet-b"])
    child = start_redis(tmp_path_factory.mktemp("redis-logs"), tls_dir=certs, namespace=NS)
    try:
        yield SecureRedis(certs, child)
    finally:
        child.stop()


async def run(client: aioredis.Redis, *cmd: object) -> object:
    try:
        return await client.execute_command(*cmd)
    finally:
        await client.aclose()


async def refused(client: aioredis.Redis, *cmd: object) -> str:
    with pytest.raises(NoPermissionError) as info:
        await run(client, *cmd)
    return str(info.value)


async def test_no_password_the_default_user_and_a_wrong_password_are_refused(
        secure_redis: SecureRedis) -> None:
    tls = secure_redis.tls("worker")
    with pytest.raises(AuthenticationError, match="authenticated|NOAUTH"):
        await run(aioredis.Redis.from_url(
            secure_redis.url, ssl_ca_data=tls.ca.decode(), ssl_check_hostname=False,
            ssl_certfile=str(tls.path("worker.pem")),
            ssl_keyfile=str(tls.path("worker-key.pem"))), "PING")
    for user, password in (("default", "x"), ("default", ""), ("worker", "wrong"),
                           ("nobody", "x")):
        with pytest.raises(AuthenticationError):
            await run(aioredis.Redis.from_url(
                secure_redis.url, username=user, password=password,
                ssl_ca_data=tls.ca.decode(), ssl_check_hostname=False,
                ssl_certfile=str(tls.path("worker.pem")),
                ssl_keyfile=str(tls.path("worker-key.pem"))), "PING")


async def test_plaintext_and_certificate_less_clients_are_refused(
        secure_redis: SecureRedis) -> None:
    password = (secure_redis.certs / redis_password_file("admin")).read_text()
    with pytest.raises((RedisError, OSError)):
        await run(aioredis.Redis.from_url(f"redis://{secure_redis.child.address}",
                                          username="admin", password=password,
                                          socket_timeout=5), "PING")
    with pytest.raises((RedisError, OSError)):  # TLS, but no client certificate
        await run(aioredis.Redis.from_url(
            secure_redis.url, username="admin", password=password, socket_timeout=5,
            ssl_ca_data=secure_redis.tls("admin").ca.decode(), ssl_check_hostname=False),
            "PING")
    assert await run(secure_redis.client("admin"), "PING") is True


async def test_the_client_accepts_only_the_redis_roles_certificate(
        secure_redis: SecureRedis, tmp_path: Path) -> None:
    """A Redis that presents another role's mesh certificate (the worker's, signed by the
    same CA) is refused by every role's client before AUTH; the real one is accepted."""
    impostor = tmp_path / "impostor"
    impostor.mkdir()
    for f in secure_redis.certs.iterdir():
        if f.is_file():
            shutil.copy2(f, impostor / f.name)
    shutil.copy2(impostor / "worker.pem", impostor / "redis.pem")
    shutil.copy2(impostor / "worker-key.pem", impostor / "redis-key.pem")
    child = start_redis(tmp_path / "logs", tls_dir=impostor, namespace=NS)
    try:
        url = f"rediss://{child.address}"
        for role, stem in (("admin", "admin"), ("worker", "worker-wa"), ("indexer", "indexer"),
                           ("store_master", "store_master")):
            with pytest.raises(RedisConnectionError) as info:
                await run(redis_client(url, secure_redis.tls(stem), role), "PING")
            message = str(info.value)
            assert f"server at {child.address} is not the mesh's redis" in message, message
            assert REDIS_SERVER_NAME in message and "Hostname mismatch" in message, message
    finally:
        child.stop()
    assert await run(secure_redis.client("admin"), "PING") is True
    assert await run(secure_redis.client("worker", "worker-wa"), "PING") is True


async def test_a_worker_may_only_xadd_to_the_event_stream(secure_redis: SecureRedis) -> None:
    r = secure_redis
    assert await run(r.client("worker", "worker-wa"), "XADD", STREAM, "*", "probe", "1")
    for cmd in (("XRANGE", STREAM, "-", "+"), ("XREADGROUP", "GROUP", "g", "c", "STREAMS",
                                               STREAM, ">"),
                ("DEL", STREAM), ("XTRIM", STREAM, "MAXLEN", "0"), ("FLUSHALL",),
                ("CONFIG", "GET", "*"), ("KEYS", "*"), ("HSET", STORE_KEY, "k", "v"),
                ("HGETALL", STORE_KEY), ("INFO",)):
        assert "no permissions" in await refused(r.client("worker", "worker-wa"), *cmd), cmd
    assert "keys" in await refused(r.client("worker", "worker-wa"), "XADD",
                                   stream_name("other"), "*", "a", "b")


@pytest.mark.parametrize("role", ["indexer", "router"])
async def test_the_indexer_may_only_read_the_stream(secure_redis: SecureRedis,
                                                    role: str) -> None:
    r = secure_redis
    await run(r.client("worker"), "XADD", STREAM, "*", "probe", "1")
    assert await run(r.client(role), "XRANGE", STREAM, "-", "+")
    assert await run(r.client(role), "XLEN", STREAM)
    info = await run(r.client(role), "INFO", "server")
    assert isinstance(info, dict) and info["run_id"]
    for cmd in (("XADD", STREAM, "*", "a", "b"), ("DEL", STREAM), ("XDEL", STREAM, "0-1"),
                ("XTRIM", STREAM, "MAXLEN", "0"), ("FLUSHALL",), ("CONFIG", "GET", "*"),
                ("KEYS", "*"), ("HGETALL", STORE_KEY), ("SET", "x", "1")):
        assert "no permissions" in await refused(r.client(role), *cmd), cmd
    assert "keys" in await refused(r.client(role), "XRANGE", stream_name("other"), "-", "+")


async def test_a_router_may_publish_and_read_the_replica_sync_stream_only(
        secure_redis: SecureRedis) -> None:
    r, sync = secure_redis, sync_stream(NS)
    assert await run(r.client("router"), "XADD", sync, "*", "r", "x", "d", "")
    assert await run(r.client("router"), "XREAD", "COUNT", "1", "STREAMS", sync, "0")
    assert await run(r.client("router"), "TIME")  # where a replica starts reading
    # its embedded index still sets up its consumer group on the event stream
    assert await run(r.client("router"), "XGROUP", "CREATE", STREAM, "g-router", "0",
                     "MKSTREAM")
    assert await run(r.client("router"), "XGROUP", "SETID", STREAM, "g-router", "0")
    for cmd in (("XADD", STREAM, "*", "a", "b"), ("DEL", sync), ("XTRIM", sync, "MAXLEN", "0"),
                ("XDEL", sync, "0-1"), ("XGROUP", "CREATE", sync, "g", "0"),
                ("XRANGE", sync, "-", "+"), ("SET", sync, "x")):
        assert "no permissions" in await refused(r.client("router"), *cmd), cmd
    for role in ("indexer", "worker"):
        assert "no permissions" in await refused(r.client(role), "XADD", sync, "*", "a", "b")
    assert "keys" in await refused(r.client("router"), "XADD", sync_stream("other"), "*",
                                   "a", "b")


async def test_the_store_master_owns_its_keys_only(secure_redis: SecureRedis) -> None:
    r = secure_redis
    store = RedisMetadata(r.url, NS, r.tls("store_master"))  # the real persistence class
    try:
        await store.rewrite(Changes())
        run_id, marked = await store.epoch()
        assert run_id and marked
        assert await store.load() == ([], [])
        await store.clear()
        assert (await store.epoch())[1] is False
    finally:
        await store.close()
    assert await run(r.client("store_master"), "HSET", STORE_KEY, "k", "v") == 1
    assert await run(r.client("store_master"), "HGETALL", STORE_KEY) == {b"k": b"v"}
    for cmd in (("XADD", STREAM, "*", "a", "b"), ("XRANGE", STREAM, "-", "+"),
                ("DEL", STREAM), ("SET", "kvmesh:other:store:x", "1")):
        assert "keys" in await refused(r.client("store_master"), *cmd), cmd
    for cmd in (("FLUSHALL",), ("FLUSHDB",), ("KEYS", "*"), ("SCAN", "0"),
                ("CONFIG", "GET", "*"), ("SWAPDB", "0", "1"), ("ACL", "LIST")):
        assert "no permissions" in await refused(r.client("store_master"), *cmd), cmd


# --- issue 13's attack: forged entries for worker B ---------------------------------

def stored(i: int) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": [i], "parent_block_hash": None,
            "token_ids": [i, i + 1, i + 2, i + 3], "block_size": BS, "medium": "GPU"}


def relay_blocks(relay: KvEventRelay) -> dict[str, set[int]]:
    return {t.tier: set(t.block_hashes) for t in relay.state().tiers}


def indexed(app: IndexerApp, worker: str) -> dict[str, set[int]]:
    return {t: set(hs) for t, hs in app.index.dump().get(worker, {}).items() if hs}


@dataclass
class Attack:
    redis: SecureRedis
    relay_b: KvEventRelay
    args: list[str]


@pytest.fixture
async def attack(secure_redis: SecureRedis, etcd: Child,
                 tmp_path: Path) -> AsyncIterator[Attack]:
    regs = [Registration(etcd.address, NS, discovery_pb2.InstanceRecord(
        instance_id=w, component="worker", address="127.0.0.1:1", pid=1,
        capabilities=["kv_events"]), ttl=30) for w in ("wa", "wb")]
    for reg in regs:
        await reg.start()
    relay_b = KvEventRelay("wb", BS, secure_redis.url, STREAM,
                           EventEndpoints(tmp_path, "", ""), tls=secure_redis.tls("worker-wb"))
    await relay_b.start(zmq_input=False)
    args = [*base_args(etcd.address, NS), "--tls-dir", str(secure_redis.certs),
            "--redis-url", secure_redis.url, "--group", "ix-sec"]
    try:
        yield Attack(secure_redis, relay_b, args)
    finally:
        await relay_b.close()
        for reg in regs:
            await reg.close()


async def indexer_caught_up(app: IndexerApp, relay: KvEventRelay) -> None:
    await wait_for(lambda: indexed(app, "wb") == relay_blocks(relay), 15,
                   lambda: f"B's real blocks in the index ({indexed(app, 'wb')} vs "
                           f"{relay_blocks(relay)}; stats {app.feed.stats})")


async def test_forged_entries_for_another_worker_are_dropped_and_counted(
        attack: Attack) -> None:
    r, relay_b = attack.redis, attack.relay_b
    app = await start_indexer(load_config(IndexerConfig, attack.args, {}))
    try:
        relay_b.submit([stored(i) for i in range(0, 12, 4)])
        await indexer_caught_up(app, relay_b)
        real = relay_blocks(relay_b)
        key_a = r.tls("worker-wa").secret("worker-wa.evkey")
        fake_state = kv_events_pb2.KvState(worker_id="wb", event_id=1_000_000, tiers=[
            kv_events_pb2.TierBlocks(tier="device", block_hashes=[666, 667])])
        fake_batch = kv_events_pb2.KvEventBatch(worker_id="wb", block_size=BS, events=[
            kv_events_pb2.KvEvent(event_id=3, kind=kv_events_pb2.KV_EVENT_KIND_CLEARED)])
        state_bytes = fake_state.SerializeToString()
        as_a = {b"w": b"wa", b"k": STATE, b"d": state_bytes,  # A, signing as A, for B
                b"m": hmac.new(key_a, mac_input(b"wa", STATE, state_bytes),
                               "sha256").digest()}
        forged = [encode_state(fake_state, key_a), encode_batch(fake_batch, key_a), as_a]
        unsigned = [encode_state(fake_state), encode_batch(fake_batch)]
        attacker = r.client("worker", "worker-wa")  # the shared worker password
        try:
            for fields in forged + unsigned:
                await attacker.xadd(STREAM, fields)  # type: ignore[arg-type]
        finally:
            await attacker.aclose()
        await wait_for(lambda: app.feed.stats.forged_entries + app.feed.stats.unsigned_entries
                       == 5, 15, lambda: f"5 forged entries dropped ({app.feed.stats})")
        assert (app.feed.stats.forged_entries, app.feed.stats.unsigned_entries) == (3, 2)
        assert indexed(app, "wb") == real  # neither cleared nor replaced
        assert app.index.next_event_id("wb") == relay_b.state().event_id + 1
        relay_b.submit([stored(i) for i in range(100, 108, 4)])  # B's real events go on
        await indexer_caught_up(app, relay_b)
        assert indexed(app, "wb") != real and not {666, 667} & indexed(app, "wb")["device"]
    finally:
        await app.server.stop()
    again = await start_indexer(load_config(IndexerConfig, attack.args, {}))  # a restart
    try:
        assert again.feed.ready.is_set()
        await indexer_caught_up(again, relay_b)
        assert (again.feed.stats.forged_entries, again.feed.stats.unsigned_entries) == (3, 2)
        assert again.index.next_event_id("wb") == relay_b.state().event_id + 1
    finally:
        await again.server.stop()


# --- a mock fleet's sub-identities: fleet-a signs for fleet-a.0, never for another's id --

async def test_a_sub_identitys_events_are_indexed_and_another_id_is_refused(
        secure_redis: SecureRedis, etcd: Child, tmp_path: Path) -> None:
    """A relay for ``fleet-a.0`` on the fleet certificate ``fleet-a`` (as a fleet runs) is
    indexed; entries for ``fleet-b.0`` signed by fleet-a (naming fleet-a or fleet-b as
    signer), fleet-a's entry stripped of its signer, and an entry the real worker ``wa``
    (no fleet certificate) signs for ``wa.0`` are dropped as forged, and neither
    ``fleet-b.0`` nor ``wa.0`` gets anything in the index."""
    r = secure_redis
    regs = [Registration(etcd.address, NS, discovery_pb2.InstanceRecord(
        instance_id=w, component="worker", address="127.0.0.1:1", pid=1,
        capabilities=["kv_events"]), ttl=30) for w in ("fleet-a.0", "fleet-b.0", "wa.0")]
    for reg in regs:
        await reg.start()
    relay = KvEventRelay("fleet-a.0", BS, r.url, STREAM, EventEndpoints(tmp_path, "", ""),
                         tls=r.tls("worker-fleet-a"))
    await relay.start(zmq_input=False)
    app = await start_indexer(load_config(IndexerConfig, [
        *base_args(etcd.address, NS), "--tls-dir", str(r.certs), "--redis-url", r.url,
        "--group", "ix-sub"], {}))
    try:
        forged_before = app.feed.stats.forged_entries  # the stream may hold older attacks
        relay.submit([stored(i) for i in range(200, 212, 4)])
        await wait_for(lambda: indexed(app, "fleet-a.0") == relay_blocks(relay), 15,
                       lambda: f"fleet-a.0's blocks in the index "
                               f"({indexed(app, 'fleet-a.0')}; "
                               f"stats {app.feed.stats})")
        assert app.feed.stats.forged_entries == forged_before
        real = relay_blocks(relay)
        key_a = r.tls("worker-fleet-a").secret("worker-fleet-a.evkey")
        key_wa = r.tls("worker-wa").secret("worker-wa.evkey")
        state_b = kv_events_pb2.KvState(worker_id="fleet-b.0", event_id=1_000, tiers=[
            kv_events_pb2.TierBlocks(tier="device", block_hashes=[666])])
        batch_b = kv_events_pb2.KvEventBatch(worker_id="fleet-b.0", block_size=BS, events=[
            kv_events_pb2.KvEvent(event_id=0, kind=kv_events_pb2.KV_EVENT_KIND_STORED,
                                  block_hashes=[667])])
        state_a = kv_events_pb2.KvState(worker_id="fleet-a.0", event_id=1_000, tiers=[
            kv_events_pb2.TierBlocks(tier="device", block_hashes=[668])])
        stripped = {k: v for k, v in encode_state(state_a, key_a, "fleet-a").items()
                    if k != b"s"}
        # a compromised real worker wa claims a prefix for a record wa.0 of its making
        state_wa = kv_events_pb2.KvState(worker_id="wa.0", event_id=1_000, tiers=[
            kv_events_pb2.TierBlocks(tier="device", block_hashes=[669])])
        forged = [encode_state(state_b, key_a, "fleet-a"),
                  encode_batch(batch_b, key_a, "fleet-a"),
                  encode_state(state_b, key_a, "fleet-b"), stripped,
                  encode_state(state_wa, key_wa, "wa")]
        attacker = r.client("worker", "worker-wa")
        try:
            for fields in forged:
                await attacker.xadd(STREAM, fields)  # type: ignore[arg-type]
        finally:
            await attacker.aclose()
        await wait_for(lambda: app.feed.stats.forged_entries == forged_before + 5, 15,
                       lambda: f"5 forged entries dropped ({app.feed.stats})")
        assert indexed(app, "fleet-b.0") == {} and indexed(app, "wa.0") == {}
        assert indexed(app, "fleet-a.0") == real
        relay.submit([stored(300)])  # fleet-a.0 goes on
        await wait_for(lambda: indexed(app, "fleet-a.0") == relay_blocks(relay) != real, 15,
                       lambda: f"fleet-a.0's next block ({app.feed.stats})")
    finally:
        await app.server.stop()
        await relay.close()
        for reg in regs:
            await reg.close()
