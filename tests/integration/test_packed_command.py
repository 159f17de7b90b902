"""services.common.redis_conn.PackedCommand against a real redis-server: raw replies,
error replies, a connection killed under it (replaced, the call sent once more) or Redis
gone (raised), a cancel mid-call, and the connection's socket timeout bounding each call, its send
included (Redis stopped under a large command), without redis-py's timed-send task."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.common.procs import Child, free_port, start_redis
from services.common.redis_conn import PackedCommand
from tests.waiting import wait_for


def streams(reply: object) -> list[list[object]]:
    """A group read's reply as RESP2 lists (RESP3 answers a map of streams)."""
    return [[k, v] for k, v in reply.items()] if isinstance(reply, dict) else reply  # type: ignore[return-value]


@pytest.fixture
async def client(redis_server: Child) -> AsyncIterator[aioredis.Redis]:
    r = aioredis.Redis.from_url(f"redis://{redis_server.address}")
    yield r
    await r.aclose()


async def test_the_raw_reply_of_a_blocking_group_read(client: aioredis.Redis) -> None:
    await client.delete("pc-s")
    await client.xgroup_create("pc-s", "g", id="0", mkstream=True)
    entry = await client.xadd("pc-s", {b"k": b"v", b"k2": b"v2"})
    read = PackedCommand(client, "XREADGROUP", "GROUP", "g", "c", "COUNT", 10, "BLOCK", 50,
                         "NOACK", "STREAMS", "pc-s", ">")
    assert streams(await read()) == [[b"pc-s", [[entry, [b"k", b"v", b"k2", b"v2"]]]]]
    assert await read() is None  # nothing new within BLOCK
    await read.close()


async def test_an_error_reply_raises_and_keeps_the_connection(
        client: aioredis.Redis) -> None:
    read = PackedCommand(client, "XREADGROUP", "GROUP", "nogroup", "c", "STREAMS",
                         "pc-none", ">")
    with pytest.raises(ResponseError, match="NOGROUP"):
        await read()
    conn = read._conn
    with pytest.raises(ResponseError, match="NOGROUP"):
        await read()
    assert read._conn is conn and conn is not None
    await read.close()


async def test_a_killed_connection_is_replaced_and_the_call_goes_through(
        client: aioredis.Redis) -> None:
    """What a Redis restart or its idle timeout does to the held connection: the call
    is sent again on a new one (once)."""
    who = PackedCommand(client, "CLIENT", "ID")
    first = await who()
    await client.execute_command("CLIENT", "KILL", "ID", first)
    second = await who()  # no error: sent again on a new connection
    assert isinstance(second, int) and second != first
    await who.close()


async def test_with_redis_gone_the_call_raises(client: aioredis.Redis) -> None:
    """A connection that cannot be made again is no retry's business: the error."""
    ping = PackedCommand(client, "PING")
    assert await ping() == b"PONG"
    conn = ping._conn
    await client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    conn.port = free_port()  # its reconnect finds nobody there
    with pytest.raises((RedisConnectionError, OSError)):
        await ping()
    assert ping._conn is None
    await ping.close()


async def test_a_cancel_mid_call_drops_the_connection(client: aioredis.Redis,
                                                      redis_server: Child) -> None:
    await client.delete("pc-c")
    await client.xgroup_create("pc-c", "g", id="0", mkstream=True)
    # a socket timeout past the wait below: only the cancel ends the blocked read (with
    # the default 5 s a loaded machine's slow wait made it a TimeoutError instead)
    slow = aioredis.Redis.from_url(f"redis://{redis_server.address}", socket_timeout=60,
                                   client_name="pc-c-blocked")
    read = PackedCommand(slow, "XREADGROUP", "GROUP", "g", "c", "BLOCK", 0, "STREAMS",
                         "pc-c", ">")
    call = asyncio.ensure_future(read())

    async def blocked() -> bool:
        """This read's own connection blocks on the server (the pool's connections of
        earlier tests may show cmd=xreadgroup too: a cancel while ours still connects
        could be lost in Python 3.11's wait_for, which redis-py connects through)."""
        clients = (await client.execute_command("CLIENT", "LIST")).decode().splitlines()
        return any("name=pc-c-blocked " in c and "cmd=xreadgroup" in c for c in clients)

    await wait_for(blocked, 10, "the read to block on the server")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert read._conn is None
    entry = await client.xadd("pc-c", {b"a": b"1"})
    # the next call, on a new connection, reads the entry (the cut call never got it)
    again = PackedCommand(client, "XREADGROUP", "GROUP", "g", "c", "BLOCK", 1000,
                          "STREAMS", "pc-c", ">")
    assert streams(await again()) == [[b"pc-c", [[entry, [b"a", b"1"]]]]]
    await again.close()
    await slow.aclose()


async def test_the_socket_timeout_bounds_the_reply_and_goes_back_with_the_connection(
        redis_server: Child, monkeypatch: pytest.MonkeyPatch) -> None:
    client = aioredis.Redis.from_url(f"redis://{redis_server.address}", socket_timeout=0.3)
    await client.delete("pc-t")
    await client.xgroup_create("pc-t", "g", id="0", mkstream=True)
    read = PackedCommand(client, "XREADGROUP", "GROUP", "g", "c", "BLOCK", 0, "STREAMS",
                         "pc-t", ">")
    ping = PackedCommand(client, "PING")
    assert await ping() == b"PONG"  # connects first (that may time out its own way)

    def no_task(*_: object) -> None:
        raise AssertionError("a send went through asyncio.wait_for")

    monkeypatch.setattr(asyncio, "wait_for", no_task)  # redis-py's timed send
    assert await ping() == b"PONG"
    monkeypatch.undo()
    await ping.close()
    with pytest.raises(RedisTimeoutError):  # blocks forever on the server: 0.3 s, then out
        await read()
    assert read._conn is None  # dropped: the reply may still come
    conn = await client.connection_pool.get_connection()
    try:
        assert conn.socket_timeout == 0.3  # every connection went back with its timeout
    finally:
        await client.connection_pool.release(conn)
    await read.close()
    await client.aclose()


async def test_more_arguments_go_with_that_call_only(client: aioredis.Redis) -> None:
    await client.delete("pc-x")
    xadd = PackedCommand(client, "XADD", "pc-x", "MAXLEN", "~", 1000, "*")
    first = await xadd(b"k", b"1")
    second = await xadd(b"k", b"2", b"j", b"3")
    with pytest.raises(ResponseError):  # no fields: the bare command, which Redis refuses
        await xadd()
    entries = await client.xrange("pc-x")
    assert entries == [(first, {b"k": b"1"}), (second, {b"k": b"2", b"j": b"3"})]
    await xadd.close()


async def test_a_send_redis_does_not_take_is_bounded_by_the_timeout_too(
        tmp_path: Path) -> None:
    """Redis stopped (SIGSTOP, a Redis of this test's own) while a command larger than
    the socket buffers goes out: the send waits for room, and the socket timeout ends
    it (TimeoutError, connection dropped), as it ends a reply that does not come."""
    redis = start_redis(tmp_path)
    client = aioredis.Redis.from_url(f"redis://{redis.address}", socket_timeout=0.3)
    xadd = PackedCommand(client, "XADD", "pc-big", "*")
    try:
        assert await xadd(b"k", b"v")  # connected
        os.kill(redis.pid, signal.SIGSTOP)
        try:
            with pytest.raises(RedisTimeoutError):
                await xadd(b"k", b"x" * (64 << 20))
        finally:
            os.kill(redis.pid, signal.SIGCONT)
        assert xadd._conn is None
        assert await xadd(b"k", b"again")  # a new connection, Redis answering again
    finally:
        await xadd.close()
        await client.aclose()
        redis.stop()
