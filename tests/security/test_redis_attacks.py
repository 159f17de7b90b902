"""Forging KV events and damaging the stream or the store's keys in Redis (TLS only, client
certificates, ACL users per role: :mod:`services.common.redis_acl`; signed events:
:mod:`services.common.event_bus`):

- an outsider's XADD of a forged full-state entry: plaintext to the TLS port ends in a
  ConnectionError (connection reset), TLS without a client certificate in one with the
  server's ``certificate required`` alert, another CA's certificate (even with the worker
  user's password) with ``unknown ca``: no Redis reply to any; a mesh certificate
  without a password gets ``NOAUTH`` (the ``default`` user is off: redis-py's HELLO is
  refused), with a wrong one ``WRONGPASS``. The stream's length and the mesh are
  unchanged;
- the prefill worker (the ``worker`` user, which may XADD, and its own event key) adds a
  full-state entry and a batch claiming the decode worker, unsigned, signed with its own
  key under the decode worker's id, and signed as itself but carrying the decode
  worker's events: Redis takes them, the indexer drops all six (``unsigned_entries`` +2,
  ``forged_entries`` +4 in ``Indexer.Stats``), the index is unchanged, the decode worker's
  real events still apply afterwards, and after the indexer is killed and restarted (it
  replays the stream) it drops the same six and indexes exactly what the workers hold;
- the ``worker`` user reading, trimming or deleting the stream, touching the store
  master's keys, or running FLUSHALL / FLUSHDB / KEYS / CONFIG, and the ``indexer`` user
  writing to the stream (XADD, XDEL, XTRIM, DEL): ``NOPERM`` each; nothing changed.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, ConnectionError, NoPermissionError

from protos import indexer_pb2, indexer_pb2_grpc, kv_events_pb2
from services.common.event_bus import (
    BATCH,
    STATE,
    encode_batch,
    encode_state,
    mac_input,
    stream_name,
)
from services.common.grpc_client import channel
from services.common.redis_acl import store_key_pattern
from services.common.tls import redis_password_file
from tests.security.conftest import ALICE, BLOCK, MODEL, TIMEOUT_S, SecureMesh, Snapshot
from tests.waiting import wait_for

STATS = ("streamEntries", "unsignedEntries", "forgedEntries")  # what forged entries move


def rediss(mesh: SecureMesh, **kwargs: Any) -> aioredis.Redis:
    """A TLS client of the mesh's Redis trusting the mesh CA, with ``kwargs`` (a
    certificate, a user)."""
    host, _, port = mesh.redis_url.removeprefix("rediss://").rpartition(":")
    return aioredis.Redis(host=host, port=int(port), ssl=True, ssl_cert_reqs="required",
                          ssl_ca_data=mesh.tls("admin").ca.decode(),
                          ssl_check_hostname=False, socket_timeout=TIMEOUT_S, **kwargs)


async def stream_length(mesh: SecureMesh) -> int:
    """XLEN of the event stream, as the admin user."""
    admin = mesh.redis("admin")
    try:
        return int(await admin.xlen(stream_name(mesh.namespace)))
    finally:
        await admin.aclose()


def forged_state(mesh: SecureMesh, victim: str) -> kv_events_pb2.KvState:
    """A full state of ``victim`` far ahead of its events, with blocks it never had."""
    return kv_events_pb2.KvState(worker_id=victim, event_id=1 << 40, block_size=BLOCK,
                                 tiers=[kv_events_pb2.TierBlocks(tier="device",
                                                                 block_hashes=[1, 2, 3])])


def forged_batch(victim: str, next_id: int) -> kv_events_pb2.KvEventBatch:
    """The victim's next events: all its blocks cleared, a block it never had stored."""
    return kv_events_pb2.KvEventBatch(worker_id=victim, block_size=BLOCK, events=[
        kv_events_pb2.KvEvent(event_id=next_id, kind=kv_events_pb2.KV_EVENT_KIND_CLEARED),
        kv_events_pb2.KvEvent(event_id=next_id + 1, kind=kv_events_pb2.KV_EVENT_KIND_STORED,
                              block_hashes=[4], tier="device")])


def signed_as(sender: str, key: bytes, kind: bytes, data: bytes) -> dict[bytes, bytes]:
    """An entry ``sender`` really signed (its own key), whatever its message says."""
    w = sender.encode()
    mac = hmac.new(key, mac_input(w, kind, data), hashlib.sha256).digest()
    return {b"w": w, b"k": kind, b"d": data, b"m": mac}


async def indexer_stats(mesh: SecureMesh) -> indexer_pb2.StatsResponse:
    async with channel(mesh.address("indexer"), mesh.tls("admin")) as ch:
        return await indexer_pb2_grpc.IndexerStub(ch).Stats(indexer_pb2.StatsRequest(),
                                                            timeout=TIMEOUT_S)


def without_stream_counters(snap: Snapshot) -> Snapshot:
    """``snap`` without the index counters that entries read (forged ones too) move."""
    stats = {k: v for k, v in snap.index["stats"].items() if k not in STATS}
    return replace(snap, index={**snap.index, "stats": stats})


def worker_entries(snap: Snapshot) -> dict[str, Any]:
    """The index's per-worker entries (event id, blocks), without its counters."""
    return {k: v for k, v in snap.index.items() if k != "stats"}


async def complete(mesh: SecureMesh, prompt: list[int]) -> None:
    async with httpx.AsyncClient(base_url=mesh.url, timeout=60) as client:
        resp = await client.post("/v1/completions", headers=ALICE, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "ignore_eos": True})
    assert resp.status_code == 200, resp.text


# how redis-py words a connection the server dropped (it varies with timing)
DROPPED = ("reset by peer", "Connection closed", "closed by server", "Error while reading",
           "EOF")


def _chain_text(exc: BaseException) -> str:
    """The messages of ``exc`` and of its causes and contexts."""
    parts, seen = [], set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        parts.append(f"{type(cur).__name__}: {cur}")
        cur = cur.__cause__ or cur.__context__
    return " | ".join(parts)


async def test_an_outsider_cannot_write_to_the_stream(secure: SecureMesh) -> None:
    before = await secure.settled()
    length = await stream_length(secure)
    entry: dict[Any, Any] = encode_state(forged_state(secure, secure.decode.instance_id))
    password = (secure.certs / redis_password_file("worker")).read_text().strip()
    rogue = secure.foreign("worker")
    rogue_files = secure.rogue / "worker.pem", secure.rogue / "worker-key.pem"
    cert = {"ssl_certfile": str(secure.certs / "worker-prefill-0.pem"),
            "ssl_keyfile": str(secure.certs / "worker-prefill-0-key.pem")}
    host, _, port = secure.redis_url.removeprefix("rediss://").rpartition(":")
    # (client, error, the words of one of its messages)
    attackers: dict[str, tuple[aioredis.Redis, type[Exception], tuple[str, ...]]] = {
        "plaintext": (aioredis.Redis(host=host, port=int(port), socket_timeout=TIMEOUT_S),
                      ConnectionError, DROPPED),
        # TLS 1.3: the server's alert may come after the client thinks the handshake done,
        # so the client sees the alert or the dropped connection
        "TLS without a client certificate": (rediss(secure), ConnectionError,
                                             ("CERTIFICATE_REQUIRED", *DROPPED)),
        "another CA's certificate with the worker password": (rediss(
            secure, ssl_certfile=str(rogue_files[0]), ssl_keyfile=str(rogue_files[1]),
            username="worker", password=password), ConnectionError,
            ("UNKNOWN_CA", *DROPPED)),  # the same TLS 1.3 race as above
        # NOAUTH and WRONGPASS (redis-py drops the code, keeps the words)
        "a mesh certificate, no password": (rediss(secure, **cert), AuthenticationError,
                                            ("must be called with the client already "
                                             "authenticated",)),
        "a mesh certificate, a wrong password": (rediss(
            secure, **cert, username="worker", password="guess"), AuthenticationError,
            ("invalid username-password pair",)),
    }
    assert rogue.identity.role == "worker"
    for what, (client, error, words) in attackers.items():
        try:
            with pytest.raises(error) as info:
                await client.xadd(stream_name(secure.namespace), entry)
        finally:
            await client.aclose()
        told = _chain_text(info.value)  # redis-py keeps the OS/SSL reason in the cause
        assert any(w in told for w in words), (what, told)
        if error is ConnectionError:  # no Redis reply: the TLS layer refused
            assert not isinstance(info.value, AuthenticationError), (what, info.value)
    assert await stream_length(secure) == length
    assert await secure.snapshot() == before


async def test_forged_events_are_dropped_also_after_an_indexer_restart(
        secure: SecureMesh) -> None:
    victim, sender = secure.decode.instance_id, secure.prefill.instance_id
    before = await secure.settled()
    if victim not in before.index:  # give the victim blocks to lose
        await complete(secure, list(range(9500, 9500 + 3 * BLOCK)))
        before = await secure.settled()
    assert victim in before.index, before.index
    next_id = before.index[victim][0] + 1
    own_key = secure.tls(f"worker-{sender}").secret(f"worker-{sender}.evkey")
    state, batch = forged_state(secure, victim), forged_batch(victim, next_id)
    entries: dict[str, dict[Any, Any]] = {
        "an unsigned full state": encode_state(state),
        "an unsigned batch": encode_batch(batch),
        "a full state under the victim's id, the sender's MAC": encode_state(state, own_key),
        "a batch under the victim's id, the sender's MAC": encode_batch(batch, own_key),
        "a full state of the victim, signed as the sender": signed_as(
            sender, own_key, STATE, state.SerializeToString()),
        "a batch of the victim, signed as the sender": signed_as(
            sender, own_key, BATCH, batch.SerializeToString()),
    }
    worker = secure.redis(f"worker-{sender}")  # the worker ACL user: it may XADD
    try:
        for fields in entries.values():
            await worker.xadd(stream_name(secure.namespace), fields)
    finally:
        await worker.aclose()
    start = before.index["stats"]
    want = {"streamEntries": int(start.get("streamEntries", 0)) + len(entries),
            "unsignedEntries": int(start.get("unsignedEntries", 0)) + 2,
            "forgedEntries": int(start.get("forgedEntries", 0)) + 4}
    got: dict[str, int] = {}

    async def dropped() -> bool:
        nonlocal got
        stats = await indexer_stats(secure)
        got = {"streamEntries": stats.stream_entries, "unsignedEntries": stats.unsigned_entries,
               "forgedEntries": stats.forged_entries}
        return got == want
    await wait_for(dropped, 30, lambda: f"the indexer to drop them: {want}, got {got}")
    after = await secure.settled()
    assert without_stream_counters(after) == without_stream_counters(before)
    # the victim's real events still count ...
    await complete(secure, list(range(9700, 9700 + 3 * BLOCK)))
    moved = await secure.settled()  # the index matches every worker's own KV state
    assert moved.index[victim][0] > before.index[victim][0], (moved.index, before.index)
    # ... and a restarted indexer, replaying the stream, drops the forged entries again
    await secure.restart("indexer", "indexer")
    replayed = await secure.settled()
    assert worker_entries(replayed) == worker_entries(moved)
    stats = await indexer_stats(secure)
    assert (stats.unsigned_entries, stats.forged_entries) == (2, 4), stats
    assert replayed.routing == moved.routing and replayed.etcd == moved.etcd


Command = Callable[[aioredis.Redis], Awaitable[object]]


def refused_commands(stream: str, store_key: str) -> dict[str, dict[str, Command]]:
    """By ACL user: what it may not run (each on a key that exists or matters)."""
    entry: dict[Any, Any] = {b"w": b"x", b"k": STATE, b"d": b""}
    return {
        "worker": {
            "XRANGE": lambda r: r.xrange(stream),
            "XREAD": lambda r: r.xread({stream: "0"}, count=1),
            "XLEN": lambda r: r.xlen(stream),
            "DEL": lambda r: r.delete(stream),
            "XTRIM": lambda r: r.xtrim(stream, maxlen=0),
            "XDEL": lambda r: r.xdel(stream, "0-1"),
            "XGROUP DESTROY": lambda r: r.xgroup_destroy(stream, "indexer"),
            "FLUSHALL": lambda r: r.flushall(),
            "FLUSHDB": lambda r: r.flushdb(),
            "KEYS": lambda r: r.keys("*"),
            "CONFIG GET": lambda r: r.config_get("requirepass"),
            "SET a store key": lambda r: r.set(store_key, b"x"),
            "GET a store key": lambda r: r.get(store_key),
            "DEL a store key": lambda r: r.delete(store_key),
            "XADD to a store key": lambda r: r.xadd(store_key, entry),
        },
        "indexer": {
            "XADD": lambda r: r.xadd(stream, entry),
            "XDEL": lambda r: r.xdel(stream, "0-1"),
            "XTRIM": lambda r: r.xtrim(stream, maxlen=0),
            "DEL": lambda r: r.delete(stream),
            "FLUSHALL": lambda r: r.flushall(),
            "SET a store key": lambda r: r.set(store_key, b"x"),
        },
    }


async def test_what_a_worker_or_the_indexer_may_not_run_is_noperm(secure: SecureMesh) -> None:
    before = await secure.settled()
    length = await stream_length(secure)
    stream = stream_name(secure.namespace)
    store_key = store_key_pattern(secure.namespace).replace("*", "objects")
    users = {"worker": "worker-prefill-0", "indexer": "indexer"}
    for user, commands in refused_commands(stream, store_key).items():
        client = secure.redis(users[user])
        try:
            assert await client.ping()  # logged in: the refusals below are the ACL's
            for what, command in commands.items():
                with pytest.raises(NoPermissionError) as info:
                    await command(client)
                assert "NOPERM" in str(info.value) or "permission" in str(info.value), (
                    user, what, info.value)
        finally:
            await client.aclose()
    assert await stream_length(secure) == length
    assert await secure.snapshot() == before
