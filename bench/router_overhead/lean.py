"""Minimal clients for ``bench.router_overhead``'s lean streams: what a request costs the
mesh, with as little as possible of the client's own cost in it.

httpx and grpc.aio cost this client several hundred µs of CPU per request each, and not
the same: an added latency taken as (HTTP through the mesh) − (gRPC to a worker) holds
their difference. The lean pair calls both sides with a few µs of client:

- :class:`LeanHttp`: HTTP/1.1 POSTs of JSON over keep-alive connections (one request in
  flight per connection; a pool grows to the concurrency), on an ``asyncio.Protocol``.
  Contract: ``await post(path, obj)`` returns the response body of a 200 answer with a
  ``content-length`` (what the frontend answers a non-streamed request) or sent
  ``transfer-encoding: chunked`` (Dynamo's frontend answers so: the chunks joined); any
  other status raises :class:`LeanHttpError` with the status and body; a connection lost
  before the whole answer raises ConnectionError (closed connections leave the pool);
  no answer within :data:`CALL_TIMEOUT_S` raises TimeoutError (that connection is
  closed). ``close()`` closes every connection.
- :class:`PlaneClient`: one connection to a worker's TCP request plane (the frontend's
  own carrier to a worker, :mod:`services.frontend.request_plane`), calls multiplexed on
  it by ``call_id``. Contract: ``await connect()`` (TLS with ``tls``: the client
  certificate of ``tls``'s role); ``await generate(request)`` starts one call and returns
  once the worker ends it OK (the replies are read, not kept); an end with another
  status raises RuntimeError naming it; a lost connection fails every open call, and
  every later one, with ConnectionError; no end within :data:`CALL_TIMEOUT_S` raises
  TimeoutError. ``close()``.

Only for benchmarks.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from protos import worker_pb2
from services.common.frames import PREAMBLE, FramedProtocol
from services.common.tls import MeshTls, server_name

CALL_TIMEOUT_S = 30.0  # as the bench's httpx client's


class LeanHttpError(RuntimeError):
    """A non-200 answer."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status


class _HttpConn(asyncio.Protocol):
    """One keep-alive connection, at most one request in flight."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[bytes] | None = None
        self.closed = False
        self._head_end = -1
        self._end = -1
        self._status = 0
        self._chunks: list[bytes] | None = None  # a chunked answer's chunks so far

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self._end < 0 and self._chunks is None:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = bytes(self.buf[:head_end]).decode("latin-1").split("\r\n")
            self._status = int(head[0].split(" ", 2)[1])
            fields = ["".join(line.lower().split()) for line in head[1:]]
            coding = next((f.split(":", 1)[1] for f in fields
                           if f.startswith("transfer-encoding:")), "")
            length = next((int(f.split(":", 1)[1]) for f in fields
                           if f.startswith("content-length:")), None)
            if coding.split(",")[-1] == "chunked":  # it wins over a content-length
                self._chunks = []
                del self.buf[:head_end + 4]
            elif length is not None:
                self._head_end, self._end = head_end + 4, head_end + 4 + length
            else:
                self._fail(ConnectionError(f"HTTP {self._status} without a content-length "
                                           "or chunked encoding"))
                return
        if self._chunks is not None:
            body_or_none = self._chunked_body()
            if body_or_none is None:
                return
            body = body_or_none
        else:
            if len(self.buf) < self._end:
                return
            body = bytes(self.buf[self._head_end:self._end])
            del self.buf[:self._end]
        status, self._end = self._status, -1
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            if status == 200:
                waiter.set_result(body)
            else:
                waiter.set_exception(LeanHttpError(status, body))

    def _chunked_body(self) -> bytes | None:
        """Takes the complete chunks off the buffer; the body once the last (size 0) and
        its trailer section (trailers skipped) came, else None."""
        assert self._chunks is not None
        while True:
            line_end = self.buf.find(b"\r\n")
            if line_end < 0:
                return None
            size = int(bytes(self.buf[:line_end]).split(b";", 1)[0], 16)
            if size == 0:  # then trailer lines, if any, and an empty line
                end = self.buf.find(b"\r\n\r\n", line_end)
                if end < 0:
                    return None
                del self.buf[:end + 4]
                body, self._chunks = b"".join(self._chunks), None
                return body
            end = line_end + 2 + size
            if len(self.buf) < end + 2:
                return None
            self._chunks.append(bytes(self.buf[line_end + 2:end]))
            del self.buf[:end + 2]

    def _fail(self, exc: BaseException) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"connection lost: {exc}"))


class LeanHttp:
    """See the module docstring."""

    def __init__(self, host: str, port: int) -> None:
        self._host, self._port = host, port
        self._idle: list[_HttpConn] = []
        self._all: list[_HttpConn] = []

    async def _conn(self) -> _HttpConn:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        _, conn = await asyncio.get_running_loop().create_connection(
            _HttpConn, self._host, self._port)
        self._all.append(conn)
        return conn

    async def post(self, path: str, obj: Any) -> bytes:
        body = json.dumps(obj).encode()
        conn = await self._conn()
        conn.waiter = asyncio.get_running_loop().create_future()
        assert conn.transport is not None
        conn.transport.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json"
                             b"\r\nContent-Length: %d\r\n\r\n%s"
                             % (path.encode(), self._host.encode(), len(body), body))
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                answer = await conn.waiter
        except LeanHttpError:
            self._idle.append(conn)
            raise
        except TimeoutError:
            conn._fail(TimeoutError("no answer"))  # its state is unknown: not reused
            raise
        self._idle.append(conn)
        return answer

    def close(self) -> None:
        for conn in self._all:
            if conn.transport is not None:
                conn.transport.close()
        self._all.clear()
        self._idle.clear()


class PlaneClient:
    """See the module docstring."""

    def __init__(self, address: str, tls: MeshTls | None = None) -> None:
        self.address = address
        self._tls = tls
        self._proto: FramedProtocol | None = None
        self._calls: dict[int, asyncio.Future[None]] = {}
        self._next = 0
        self._reader: asyncio.Task[None] | None = None
        self._ended: BaseException | None = None  # why the connection is gone

    async def connect(self) -> None:
        host, _, port = self.address.rpartition(":")
        ssl_ctx = self._tls.ssl_context(server=False) if self._tls is not None else None
        _, proto = await asyncio.get_running_loop().create_connection(
            FramedProtocol, host.strip("[]"), int(port), ssl=ssl_ctx,
            server_hostname=server_name("worker") if ssl_ctx is not None else None)
        proto.write_raw(PREAMBLE)
        self._proto = proto
        self._reader = asyncio.ensure_future(self._read(proto))

    async def _read(self, proto: FramedProtocol) -> None:
        try:
            while (data := await proto.read()) is not None:
                for reply in worker_pb2.GenerateReplies.FromString(data).replies:
                    if not reply.HasField("end"):
                        continue
                    call = self._calls.pop(reply.call_id, None)
                    if call is None or call.done():
                        continue
                    if reply.end.code == 0:
                        call.set_result(None)
                    else:
                        call.set_exception(RuntimeError(
                            f"call ended with status {reply.end.code}: {reply.end.details}"))
            error: BaseException = ConnectionError("the worker ended the connection")
        except Exception as exc:  # noqa: BLE001 - lost, or a reply that does not parse:
            error = exc  # every open call fails with it
        self._ended = error
        for call in self._calls.values():
            if not call.done():
                call.set_exception(error)
        self._calls.clear()

    async def generate(self, request: worker_pb2.GenerateRequest) -> None:
        if self._proto is None:
            raise RuntimeError("PlaneClient.connect() first")
        if self._ended is not None:
            raise ConnectionError(f"the connection is gone: {self._ended}")
        self._next += 1
        call_id = self._next
        call: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = call
        self._proto.write(worker_pb2.GenerateFrames(frames=[worker_pb2.GenerateFrame(
            call_id=call_id, request=request)]).SerializeToString())
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                await call
        finally:
            self._calls.pop(call_id, None)

    async def close(self) -> None:
        if self._proto is not None:
            self._proto.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
