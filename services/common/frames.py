"""Length-prefixed messages on a plain TCP (or TLS) connection: the carrier of the TCP
request plane (the worker's half: :mod:`workers.request_plane`; the frontend's:
:mod:`services.frontend.request_plane`).

Why: a message through ``grpc.aio`` costs ~90 µs of CPU on each side on this machine
(HTTP/2 framing, the C core's completion queue and its thread hop), a message through an
``asyncio.Protocol`` on uvloop ~10 µs (``bench/results/mesh_floors.json``: ``grpc-mux``
against ``tcp-mux``). Dynamo's request plane is plain TCP for the same reason.

Contract of :class:`FramedProtocol`:

- The wire: the caller first sends :data:`PREAMBLE` (``KVMESH-RP/1`` and a newline), then
  both sides send messages, each a 4-byte little-endian length and that many bytes (a
  serialized protobuf). A length of 0 is the sender's **end of messages** (it sends no
  more; the connection stays open for the other side's: TLS has no half-close). A length
  over ``max_bytes`` (64 MiB, the mesh's gRPC limit), data after the end of messages, or
  (``expect_preamble``) first bytes other than the preamble are a protocol error: the
  connection is dropped (nothing more is sent on it) and :meth:`read` raises
  :class:`FrameError` naming it; so does a connection closed in the middle of a message.
- :meth:`read` returns the next message's bytes in order; None after the peer's end of
  messages, or when the connection closed cleanly; ConnectionError when it was lost
  (reset, or closed by a protocol error). Messages are queued as they arrive; above
  ``READ_PAUSE_BYTES`` unread bytes the transport stops reading until they are read.
- :meth:`write` sends one message (:meth:`end` the end of messages); ConnectionError once
  the connection is closing. :meth:`drain` waits while the transport's send buffer is
  above its high-water mark (raises ConnectionError when the connection is lost).
- :attr:`lost` resolves when the connection is gone. :attr:`ready` resolves when the
  preamble came (``expect_preamble``; at once otherwise),
  or fails with the protocol error or the connection's loss.
- ``on_connect(protocol)`` (optional) is called from ``connection_made``. TCP
  keep-alive is on, so a peer whose host vanished is found out by the kernel.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections import deque
from collections.abc import Callable
from typing import cast

PREAMBLE = b"KVMESH-RP/1\n"
MAX_FRAME_BYTES = 64 * 1024 * 1024
READ_PAUSE_BYTES = 8 * 1024 * 1024
_LEN = struct.Struct("<I")


class FrameError(ConnectionError):
    """The peer broke the framing (see the module docstring)."""


class FramedProtocol(asyncio.Protocol):
    """One framed connection (see the module docstring)."""

    def __init__(self, expect_preamble: bool = False, max_bytes: int = MAX_FRAME_BYTES,
                 on_connect: Callable[[FramedProtocol], None] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._need_preamble = expect_preamble
        self._max = max_bytes
        self._on_connect = on_connect
        self._buf = bytearray()
        self._queue: deque[bytes] = deque()
        self._queued = 0
        self._read_paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._peer_done = False  # the peer's end of messages came
        self._closed = False
        self._error: ConnectionError | None = None
        self._write_paused = False
        self._drainers: list[asyncio.Future[None]] = []
        self.transport: asyncio.Transport | None = None
        self.ready: asyncio.Future[None] = self._loop.create_future()
        self.lost: asyncio.Future[None] = self._loop.create_future()  # connection_lost ran
        if not expect_preamble:
            self.ready.set_result(None)

    # asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if self._on_connect is not None:
            self._on_connect(self)

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        buf = self._buf
        buf += data
        if self._need_preamble:
            if len(buf) < len(PREAMBLE):
                if not PREAMBLE.startswith(buf):
                    self._broken("not a kvmesh request-plane connection (bad preamble)")
                return
            if buf[:len(PREAMBLE)] != PREAMBLE:
                self._broken("not a kvmesh request-plane connection (bad preamble)")
                return
            del buf[:len(PREAMBLE)]
            self._need_preamble = False
            if not self.ready.done():
                self.ready.set_result(None)
        pos, n, got = 0, len(buf), False
        while n - pos >= 4:
            (size,) = _LEN.unpack_from(buf, pos)
            if self._peer_done:
                self._broken("a message after the end of messages")
                return
            if size > self._max:
                self._broken(f"a message of {size} bytes (the limit is {self._max})")
                return
            end = pos + 4 + size
            if end > n:
                break
            if size:
                self._queue.append(bytes(buf[pos + 4:end]))
                self._queued += size
            else:
                self._peer_done = True
            got = True
            pos = end
        if pos:
            del buf[:pos]
        if got:
            self._wake()
            if self._queued > READ_PAUSE_BYTES and not self._read_paused:
                self._read_paused = True
                assert self.transport is not None
                self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        return None  # close: the end of messages is a message of its own

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        if exc is not None and self._error is None:
            self._error = ConnectionError(f"connection lost: {exc}")
        elif self._buf and self._error is None and not self._need_preamble:
            self._error = FrameError(f"the connection closed in the middle of a message "
                                     f"({len(self._buf)} bytes of it came)")
        if not self.ready.done():
            self.ready.set_exception(self._error or ConnectionError(
                "the connection closed before it was ready"))
            self.ready.exception()  # retrieved: nobody may wait on it
        self._wake()
        self._wake_drainers()
        if not self.lost.done():
            self.lost.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_drainers()

    # the API ------------------------------------------------------------------------

    async def read(self) -> bytes | None:
        """The next message (see the module docstring)."""
        while True:
            if self._queue:
                data = self._queue.popleft()
                self._queued -= len(data)
                if self._read_paused and self._queued <= READ_PAUSE_BYTES // 2:
                    self._read_paused = False
                    if self.transport is not None and not self._closed:
                        self.transport.resume_reading()
                return data
            if self._error is not None:
                raise self._error
            if self._peer_done or self._closed:
                return None
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def write(self, payload: bytes) -> None:
        """Sends one message (not an empty one: that is :meth:`end`)."""
        if not payload:
            raise ValueError("an empty message is the end of messages: use end()")
        self._send(_LEN.pack(len(payload)) + payload)

    def write_raw(self, data: bytes) -> None:
        """Sends ``data`` as it is (the preamble)."""
        self._send(data)

    def end(self) -> None:
        """Sends the end of messages."""
        self._send(_LEN.pack(0))

    async def drain(self) -> None:
        """Waits while the send buffer is full (see the module docstring)."""
        while self._write_paused and not self._closed:
            fut = self._loop.create_future()
            self._drainers.append(fut)
            await fut
        if self._closed:
            raise self._error or ConnectionError("the connection closed")

    def close(self, grace_s: float | None = None) -> None:
        """Closes the connection: what is buffered is still sent; with ``grace_s``, the
        connection is dropped if that has not happened within it (a peer that stopped
        reading)."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
            if grace_s is not None:
                self._loop.call_later(grace_s, self.abort)

    def stop_reading(self) -> None:
        """Reads nothing more (a refused caller's messages are not even buffered)."""
        if self.transport is not None and not self._closed:
            self.transport.pause_reading()

    def abort(self) -> None:
        """Drops the connection at once."""
        if self.transport is not None:
            self.transport.abort()

    @property
    def write_paused(self) -> bool:
        """Whether the send buffer is over its high-water mark (:meth:`drain` would wait)."""
        return self._write_paused

    @property
    def closing(self) -> bool:
        return self._closed or self.transport is None or self.transport.is_closing()

    # internals ----------------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        if self.closing:
            raise self._error or ConnectionError("the connection is closed")
        assert self.transport is not None
        self.transport.write(data)

    def _broken(self, why: str) -> None:
        self._error = FrameError(why)
        self._buf.clear()
        self._closed = True
        if not self.ready.done():
            self.ready.set_exception(self._error)
            self.ready.exception()
        if self.transport is not None:
            self.transport.abort()  # a peer that stopped reading cannot hold it open
        self._wake()
        self._wake_drainers()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _wake_drainers(self) -> None:
        drainers, self._drainers = self._drainers, []
        for fut in drainers:
            if not fut.done():
                fut.set_result(None)
