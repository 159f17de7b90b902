"""The one place that builds Redis clients: plaintext, or TLS with a mesh ACL user.

Contract of :func:`redis_client` (url, tls, role):

- ``redis://`` or ``unix://``: today's plaintext client, no user (``tls`` unused). When
  the process has mesh TLS material, one warning per process says that its Redis traffic
  is neither encrypted nor authenticated.
- ``rediss://`` (what ``kvmesh up`` gives its children when it runs with certificates):
  TLS that trusts only the mesh CA and presents the process's certificate
  (``<stem>.pem`` / ``<stem>-key.pem`` of ``tls.folder``), then AUTH as the ACL user
  ``role`` (default: the certificate's role) with the password in
  ``redis-<role>.pass`` (:func:`services.common.tls.redis_password_file`). Every
  connection of the client (:class:`MeshRedisConnection`) verifies the server's host
  name as :data:`REDIS_SERVER_NAME` (``redis.kvmesh.mesh``,
  :func:`services.common.tls.server_name` of the ``redis`` role), whatever host the URL
  names: only the redis role's certificate carries it, so a server with another mesh
  certificate (a worker's, say) fails the handshake and the client raises
  ``redis.exceptions.ConnectionError`` saying that the server at that address is not the
  mesh's redis, before any password is sent. Without ``tls`` (or with material that was
  not loaded from a folder) a ``rediss://`` URL raises
  :class:`~services.common.tls.CertError`, and so does a missing password file. Both
  name the file or the flag.

Contract of :class:`PackedCommand` (one command sent again and again, e.g. a consumer
group's blocking ``XREADGROUP``): the command is packed once, and each ``await cmd()``
sends it on a connection the object holds (taken from the client's pool on first use)
and returns the server's raw reply (RESP2: lists of bytes; no response callback);
``await cmd(*more)`` sends the command with ``more`` appended (packed for that call:
e.g. an ``XADD``'s fields). It
skips the client's per-call pool round, retry wrapper and argument encoding (~50 µs of
CPU per call here, 120 → 73 µs for an XREADGROUP). An error reply raises
``ResponseError`` and the connection stays; any other failure, or a cancel mid-call,
drops the connection (disconnected: a reply may still be on its way) and raises, and
the next call takes a new one; a held connection that turns out gone (a connection
error: Redis restarted, or closed it idle) is replaced and the call sent once more on
the new one, as redis-py's own retry does (a command the old connection may have
delivered can then run twice: the KV event indexes drop a repeated event id). ``close()``
gives the connection back to the pool. The connection's ``socket_timeout`` (redis-py's
default: 5 s) bounds each call, send and reply together (Redis that takes or answers
nothing in time raises redis ``TimeoutError`` and the connection is dropped), with
``asyncio.timeout`` in the caller's task instead of redis-py's ``asyncio.wait_for`` (a
task and a loop turn per send); the pool gets the connection back with its timeout.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import SSLConnection, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.common.tls import CertError, MeshTls, redis_password_file, server_name

log = logging.getLogger(__name__)
_warned_plain = False
REDIS_SERVER_NAME = server_name("redis")


class MeshRedisConnection(SSLConnection):
    """A TLS connection that accepts only the mesh's redis role as the server: the host
    name checked (and sent as SNI) is :data:`REDIS_SERVER_NAME`, not the URL's host."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{**kwargs, "ssl_check_hostname": True})

    def _connection_arguments(self) -> Mapping[str, Any]:
        return {**super()._connection_arguments(), "server_hostname": REDIS_SERVER_NAME}

    def _error_message(self, exception: BaseException) -> str:
        message = super()._error_message(exception)
        if isinstance(exception, ssl.SSLCertVerificationError):
            message += (f" (the server at {self.host}:{self.port} is not the mesh's redis: "
                        f"its certificate must be the mesh CA's and name {REDIS_SERVER_NAME})")
        return message


def redis_client(url: str, tls: MeshTls | None, role: str = "") -> aioredis.Redis:
    """A client for ``url``; see the module docstring."""
    global _warned_plain
    if not url.startswith("rediss://"):
        if tls is not None and not _warned_plain:
            _warned_plain = True
            log.warning("Redis at %s without TLS or an ACL user although --tls-dir is set "
                        "(use rediss:// for the mesh's Redis)", url)
        return aioredis.Redis.from_url(url)
    if tls is None:
        raise CertError(f"redis_url: {url} (rediss://) needs --tls-dir (the mesh "
                        "certificates and Redis passwords)")
    user = role or tls.identity.role
    password = tls.secret(redis_password_file(user)).decode().strip()
    options: dict[str, Any] = {
        "username": user, "password": password, "ssl_cert_reqs": "required",
        "ssl_ca_data": tls.ca.decode(), "ssl_certfile": str(tls.path(f"{tls.stem}.pem")),
        "ssl_keyfile": str(tls.path(f"{tls.stem}-key.pem")),
        **parse_url(url),  # as Redis.from_url: the URL's own options win
        "connection_class": MeshRedisConnection}
    return aioredis.Redis.from_pool(aioredis.ConnectionPool(**options))


class PackedCommand:
    """``args`` as one command, sent on a connection of its own; see the module
    docstring."""

    def __init__(self, client: aioredis.Redis, *args: Any) -> None:
        self._client = client
        self._args = args
        self._conn: Any = None
        self._packed: Any = None
        self._timeout: float | None = None  # the connection's socket_timeout

    async def __call__(self, *more: Any) -> Any:
        held = self._conn is not None
        try:
            return await self._once(more)
        except (RedisConnectionError, OSError):
            if not held:
                raise
        # the held connection was gone (a Redis restart, an idle timeout, CLIENT KILL):
        # once more on a new one, as redis-py's own retry would (see the module docstring)
        return await self._once(more)

    async def _once(self, more: tuple[Any, ...]) -> Any:
        conn = self._conn
        if conn is None:
            conn = await self._client.connection_pool.get_connection()
            try:
                packed = conn.pack_command(*self._args)
            except BaseException:
                await self._client.connection_pool.release(conn)
                raise
            # the call bounded by asyncio.timeout, not redis-py's wait_for (see above)
            self._timeout, conn.socket_timeout = conn.socket_timeout, None
            self._conn, self._packed = conn, packed
        try:
            packed = conn.pack_command(*self._args, *more) if more else self._packed
            try:
                async with asyncio.timeout(self._timeout):
                    await conn.send_packed_command(packed, check_health=False)
                    return await conn.read_response()
            except TimeoutError:
                raise RedisTimeoutError(f"Redis did not take the command or reply within "
                                        f"{self._timeout} s (socket_timeout)") from None
        except ResponseError:
            raise  # the server answered: the connection is in step
        except BaseException:
            await self.close(broken=True)
            raise

    async def close(self, broken: bool = False) -> None:
        """Gives the connection back (``broken``: disconnected first)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn.socket_timeout = self._timeout
        if broken:
            await conn.disconnect(nowait=True)
        await self._client.connection_pool.release(conn)
