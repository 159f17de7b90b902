"""The frontend's half of the TCP request plane (the worker's:
:mod:`workers.request_plane`): a worker's Generate calls multiplexed on one TCP (mTLS
with ``tls``) connection, ``GenerateMux``'s protocol in length-prefixed messages
(:mod:`services.common.frames`).

Contract of :class:`PlaneCall`: the carrier a :class:`~.worker_stream.WorkerStream`
uses in place of its gRPC stream-stream call, with the same surface: ``await
write(GenerateFrames)`` (and ``write_nowait``: the same at once, or False when it would
have to wait), ``await done_writing()`` (the end of messages), ``async for``
over the worker's ``GenerateReplies`` (ending when the worker closes the connection
cleanly), ``cancel()`` (drops the connection; reading then raises CancelledError, as a
cancelled gRPC call does). The connection is opened at construction, in the background:
connecting (within ``connect_timeout_s``; TLS: its handshake too) and sending the
preamble; a failure to connect is raised by the first read as :class:`PlaneUnreachable`
(nothing was sent: the stream goes on over gRPC, see :mod:`.worker_stream`). A
connection the worker ends with a status (its one last message holding a single
``call_id`` 0 reply with ``end``: a broken caller, an unauthorized one) raises it as
``grpc.aio.AioRpcError`` with that code and details; a lost connection raises
ConnectionError naming how. A TLS context is built once per certificate.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl

import grpc

from protos import worker_pb2
from services.common.frames import PREAMBLE, FramedProtocol
from services.common.tls import MeshTls, server_name
from services.router.embedded import rpc_error

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
_CODES = {c.value[0]: c for c in grpc.StatusCode}


class PlaneUnreachable(ConnectionError):
    """The plane could not be connected to (refused, timed out, TLS handshake failed)."""


@functools.lru_cache(maxsize=8)
def _client_context(tls: MeshTls) -> ssl.SSLContext:
    return tls.ssl_context(server=False)


class PlaneCall:
    """One connection to a worker's request plane (see the module docstring)."""

    def __init__(self, address: str, tls: MeshTls | None = None,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.address = address
        self._tls = tls
        self._timeout_s = connect_timeout_s
        self._proto: FramedProtocol | None = None
        self._cancelled = False
        self._connecting = asyncio.ensure_future(self._connect())

    async def _connect(self) -> FramedProtocol:
        host, _, port = self.address.rpartition(":")
        loop = asyncio.get_running_loop()
        ssl_ctx = _client_context(self._tls) if self._tls is not None else None
        try:
            async with asyncio.timeout(self._timeout_s):
                _, proto = await loop.create_connection(
                    FramedProtocol, host.strip("[]"), int(port), ssl=ssl_ctx,
                    server_hostname=server_name("worker") if ssl_ctx is not None else None)
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            raise PlaneUnreachable(f"{type(exc).__name__}: {exc}") from exc
        proto.write_raw(PREAMBLE)
        self._proto = proto
        return proto

    async def _connected(self) -> FramedProtocol:
        return self._proto if self._proto is not None else await self._connecting

    async def write(self, message: worker_pb2.GenerateFrames) -> None:
        proto = await self._connected()
        proto.write(message.SerializeToString())
        await proto.drain()

    def write_nowait(self, message: worker_pb2.GenerateFrames) -> bool:
        """Sends ``message`` now and True when the connection is up, open and not under
        back-pressure; else False, having sent nothing (then ``await write``)."""
        proto = self._proto
        if proto is None or proto.closing or proto.write_paused:
            return False
        proto.write(message.SerializeToString())
        return True

    async def done_writing(self) -> None:
        (await self._connected()).end()

    def __aiter__(self) -> PlaneCall:
        return self

    async def __anext__(self) -> worker_pb2.GenerateReplies:
        proto = await self._connected()
        data = await proto.read()
        if self._cancelled:
            raise asyncio.CancelledError()
        if data is None:
            raise StopAsyncIteration
        message = worker_pb2.GenerateReplies.FromString(data)
        replies = message.replies
        if len(replies) == 1 and not replies[0].call_id and replies[0].HasField("end"):
            status = replies[0].end
            raise rpc_error(_CODES.get(status.code, grpc.StatusCode.UNKNOWN), status.details)
        return message

    def cancel(self) -> bool:
        self._cancelled = True
        if self._proto is not None:
            self._proto.abort()
        self._connecting.cancel()  # a connection still being made is dropped
        if not self._connecting.cancelled() and self._connecting.done():
            self._connecting.exception()  # retrieved: the reader saw it or never will
        return True
