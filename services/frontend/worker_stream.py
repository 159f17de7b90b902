"""The frontend's half of ``Worker.GenerateMux`` (``--worker-transport stream``, and
``tcp`` through :mod:`.request_plane`): the Generate calls to one worker multiplexed on
one long-lived gRPC stream, or TCP connection (the worker's half:
:mod:`workers.generate_stream`).

Contract:

- :class:`WorkerStreams` (``pool``: the :class:`~services.common.grpc_client.ChannelPool`
  the calls would otherwise use) keeps one :class:`WorkerStream` per worker address, on
  that address's pooled channel; ``generate(address, request, timeout, plane)`` returns
  a :class:`StreamCall`. A stream that ended or broke, or whose channel the pool replaced
  (``invalidate`` after an UNAVAILABLE), is not used again: the next call opens a new one
  (a replaced stream closes its sending side once its last call ended). With ``planes``
  and a ``plane`` (the worker's ``request_plane_address``) the stream is the same
  protocol on one TCP connection to that plane instead (:mod:`.request_plane`, with the
  pool's TLS), one per plane address; one that ended or broke is forgotten (the next
  call to that plane opens a new one), and a lost connection is a stream that broke
  (its calls: UNAVAILABLE naming how). A plane that cannot be connected to (refused,
  timed out, TLS handshake failed) got none of its calls: they go on as Generate calls
  of their own, and that worker's calls go over gRPC (as without a plane; logged once
  per plane) for ``retry_stream_s``, after which the plane is tried again. ``close()``
  ends every stream. The stream carries no trace context of its own (no tracing
  interceptors): each call's frame does. Each message sent carries every frame queued
  when it is sent, and each message read may carry many replies
  (:func:`services.common.batching.queued_batches`; frames and replies count in order).
  On a request plane, whose connection can take a write without waiting, the frames
  posted in one event-loop turn once the worker's opening reply came leave in one
  message from a loop callback, no writer task woken
  (:class:`services.common.batching.Outbox`).
- :class:`StreamCall` behaves as the ``grpc.aio`` unary-stream call a ``Generate`` would
  be, for what the frontend uses: ``async for`` yields the responses in order and ends
  when the call ends OK; a call ending otherwise raises ``grpc.aio.AioRpcError`` with
  the worker's code, details and trailing metadata. Past ``timeout`` seconds it raises
  DEADLINE_EXCEEDED ("Deadline Exceeded") and the worker is told to cancel it (it also
  gets the timeout). ``cancel()`` ends it with CANCELLED and tells the worker (the engine
  request is aborted, as for a cancelled Generate call); False when it had ended. When
  the stream breaks or ends, every call still on it raises UNAVAILABLE naming the worker
  and how the stream ended: the worker or its connection went away, as a Generate call
  would see it (the pipeline migrates it). No frame is sent before the worker's opening
  reply; a worker without GenerateMux (an older version) answers UNIMPLEMENTED
  instead, having run none of the calls: each goes on as a Generate call of its own, and
  so do that address's later calls (logged once) for ``retry_stream_s`` (60), after which a
  stream is tried again (a worker upgraded in place gets one; an old one costs nothing:
  its calls fall back again).
- The call's frame carries the current trace context as metadata: the caller's (lean
  tracing, unsampled) or, otherwise, a client span ``/kvmesh.worker.Worker/Generate``
  ended with the call, as the client interceptor makes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.propagate import inject

from protos import worker_pb2, worker_pb2_grpc
from services.common import telemetry
from services.common.batching import Outbox
from services.common.grpc_client import ChannelPool
from services.frontend.request_plane import PlaneCall, PlaneUnreachable
from services.router.embedded import rpc_error

log = logging.getLogger(__name__)

STREAM_METHOD = "/kvmesh.worker.Worker/GenerateMux"
# A worker that had no GenerateMux is offered one again after this long (an upgrade);
# meanwhile its calls are gRPC calls of their own.
RETRY_STREAM_S = 60.0
GENERATE_METHOD = "/kvmesh.worker.Worker/Generate"
# an unreachable plane not tried for this many retry periods is forgotten (a dead worker's)
FORGET_OFF_PLANES = 10
_OK = grpc.StatusCode.OK
_OK_CODE = _OK.value[0]  # a CallStatus's code for OK
_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _status_error(status: worker_pb2.CallStatus) -> grpc.aio.AioRpcError:
    code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
    return rpc_error(code, status.details,
                     tuple((m.key, m.value) for m in status.trailing_metadata))


class StreamCall:
    """One Generate call on a :class:`WorkerStream` (see the module docstring)."""

    def __init__(self, stream: WorkerStream, call_id: int, timeout: float | None,
                 span: trace.Span | None, request: worker_pb2.GenerateRequest) -> None:
        self._stream = stream
        self.call_id = call_id
        self._request = request
        self._timeout = timeout
        self._unary: Any = None  # the Generate call it became (a worker without streams)
        self._unary_iter: Any = None
        self._items: deque[worker_pb2.GenerateResponse] = deque()
        self._error: grpc.aio.AioRpcError | None = None
        self._ended = False  # no more responses will come (OK, error or cancel)
        self._waiter: asyncio.Future[None] | None = None
        self._span = span
        self._timer = (asyncio.get_running_loop().call_later(timeout, self._expire)
                       if timeout is not None else None)

    def __aiter__(self) -> StreamCall:
        return self

    async def __anext__(self) -> worker_pb2.GenerateResponse:
        while True:
            if self._items:
                return self._items.popleft()
            if self._unary_iter is not None:
                resp: worker_pb2.GenerateResponse = await self._unary_iter.__anext__()
                return resp
            if self._ended:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def feed(self, reply: worker_pb2.GenerateReply) -> None:
        """A reply of this call from the stream."""
        if self._ended:
            return
        if reply.HasField("response"):
            self._items.append(reply.response)
        else:
            status = reply.end
            self._finish(None if status.code == _OK_CODE else _status_error(status))
        self._wake()

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        """Ends the call with ``error`` (its responses so far are still read first)."""
        if not self._ended:
            self._finish(error)
            self._wake()

    def _finish(self, error: grpc.aio.AioRpcError | None) -> None:
        self._ended = True
        self._error = error
        if self._timer is not None:
            self._timer.cancel()
        self._stream.forget(self.call_id)
        if self._span is not None:
            if error is not None:
                self._span.set_status(trace.Status(trace.StatusCode.ERROR,
                                                   f"{error.code().name}: {error.details()}"))
            self._span.end()

    def fall_back(self, channel: Any) -> None:
        """Goes on as a Generate call of its own on ``channel`` (the worker has no
        GenerateMux: it never saw this call)."""
        if self._ended:
            return
        if self._timer is not None:
            self._timer.cancel()
        if self._span is not None:
            self._span.end()  # the Generate call makes its own client span
            self._span = None
        self._stream.forget(self.call_id)
        self._unary = worker_pb2_grpc.WorkerStub(channel).Generate(self._request,
                                                                   timeout=self._timeout)
        self._unary_iter = self._unary.__aiter__()
        self._wake()

    def _expire(self) -> None:
        if not self._ended:
            self._stream.send_cancel(self.call_id)
            self.fail(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def cancel(self) -> bool:
        """Cancels the call (see the module docstring); False when it had ended."""
        if self._unary is not None:
            return bool(self._unary.cancel())
        if self._ended:
            return False
        self._stream.send_cancel(self.call_id)
        self._items.clear()
        self.fail(rpc_error(grpc.StatusCode.CANCELLED, "Locally cancelled by application!"))
        return True


class WorkerStream:
    """One GenerateMux to a worker (see the module docstring)."""

    def __init__(self, channel: Any, address: str, carrier: Any = None,
                 on_end: Callable[[WorkerStream], None] | None = None) -> None:
        self.channel = channel
        self.address = address
        self._on_end = on_end
        self.broken = False
        self.unimplemented = False  # the worker has no GenerateMux (an older version)
        self.unreachable: PlaneUnreachable | None = None  # its request plane was
        self._retired = False
        self._calls: dict[int, StreamCall] = {}
        self._ids = itertools.count(1)
        self._opened = asyncio.Event()  # the worker's first reply (call_id 0) came
        # nothing goes out before that reply (the writer task waits for it)
        self._outbox: Outbox[worker_pb2.GenerateFrame] = Outbox(
            self._send_frames, self._frames_nowait
            if getattr(carrier, "write_nowait", None) is not None else None, direct=False)
        if carrier is not None:  # the worker's TCP request plane (.request_plane)
            self._call = carrier
        else:  # a plain grpc.aio channel (tests) has no interceptors to skip
            make = getattr(channel, "untraced_stream_stream", channel.stream_stream)
            self._call = make(STREAM_METHOD,
                              request_serializer=worker_pb2.GenerateFrames.SerializeToString,
                              response_deserializer=worker_pb2.GenerateReplies.FromString)()
        self._writer = asyncio.ensure_future(self._write())
        self._reader = asyncio.ensure_future(self._read())

    def generate(self, request: worker_pb2.GenerateRequest,
                 timeout: float | None) -> StreamCall:
        """Starts a call (see the module docstring)."""
        call_id = next(self._ids)
        span: trace.Span | None = None
        if telemetry.may_record():
            span = telemetry.tracer("frontend").start_span(GENERATE_METHOD,
                                                           kind=trace.SpanKind.CLIENT)
            carrier: dict[str, str] = {}
            inject(carrier, trace.set_span_in_context(span))
            metadata = list(carrier.items())
        else:
            metadata = telemetry.propagation_metadata()
        call = StreamCall(self, call_id, timeout, span, request)
        self._calls[call_id] = call
        self._outbox.post(worker_pb2.GenerateFrame(
            call_id=call_id, request=request, timeout_s=timeout or 0.0,
            metadata=[worker_pb2.MetadataEntry(key=k, value=v) for k, v in metadata]))
        return call

    def send_cancel(self, call_id: int) -> None:
        if not self.broken:
            self._outbox.post(worker_pb2.GenerateFrame(call_id=call_id, cancel=True))

    def forget(self, call_id: int) -> None:
        self._calls.pop(call_id, None)
        if self._retired and not self._calls:
            self._outbox.post(None)  # the sending side ends: the stream ends

    def retire(self) -> None:
        """No new calls; the stream ends once its last call ended."""
        self._retired = True
        if not self._calls:
            self._outbox.post(None)

    async def _send_frames(self, frames: list[worker_pb2.GenerateFrame]) -> None:
        await self._call.write(worker_pb2.GenerateFrames(frames=frames))

    def _frames_nowait(self, frames: list[worker_pb2.GenerateFrame]) -> bool:
        return bool(self._call.write_nowait(worker_pb2.GenerateFrames(frames=frames)))

    async def _write(self) -> None:
        try:
            await self._opened.wait()  # nothing goes to a worker that cannot take it
            self._outbox.direct = True
            await self._outbox.run()
            await self._call.done_writing()
        except Exception as exc:  # noqa: BLE001 - the reader sees the stream's end too
            log.debug("GenerateMux to %s: writing failed: %r", self.address, exc)

    async def _read(self) -> None:
        how = "ended"
        try:
            calls = self._calls
            async for message in self._call:
                for reply in message.replies:
                    if not reply.call_id:
                        self._opened.set()
                        continue
                    call = calls.get(reply.call_id)
                    if call is not None:
                        call.feed(reply)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            how = f"failed: {code.name}: {exc.details()}"
            self.unimplemented = code == grpc.StatusCode.UNIMPLEMENTED
        except asyncio.CancelledError:  # what reading a cancelled call raises (close())
            how = "was closed"
        except PlaneUnreachable as exc:  # nothing was sent: they can go over gRPC
            how = f"failed: could not connect: {exc}"
            self.unreachable = exc
        except Exception as exc:  # noqa: BLE001 - every call on it fails below
            how = f"failed: {type(exc).__name__}: {exc}"
        self.broken = True
        self._outbox.closed = True
        self._writer.cancel()
        self._call.cancel()  # a connection whose reading failed is dropped (harmless if done)
        if self._on_end is not None:
            self._on_end(self)
        if self.unimplemented or self.unreachable is not None:
            # it ran none of them: each goes on as a call of its own
            for call in list(self._calls.values()):
                call.fall_back(self.channel)
        if self._calls:
            err = rpc_error(grpc.StatusCode.UNAVAILABLE,
                            f"the GenerateMux to worker {self.address} {how}")
            for call in list(self._calls.values()):
                call.fail(err)

    async def close(self) -> None:
        """Ends the stream and fails its calls (UNAVAILABLE)."""
        self.broken = True
        self._outbox.closed = True
        self._call.cancel()
        self._writer.cancel()
        await asyncio.gather(self._reader, self._writer, return_exceptions=True)


class WorkerStreams:
    """One :class:`WorkerStream` per worker address (see the module docstring)."""

    def __init__(self, pool: ChannelPool, clock: Callable[[], float] = time.monotonic,
                 retry_stream_s: float = RETRY_STREAM_S, planes: bool = False) -> None:
        self._pool = pool
        self._use_planes = planes
        self._planes: dict[str, WorkerStream] = {}  # by request-plane address
        self._plane_off: dict[str, float] = {}  # unreachable plane -> since
        self._streams: dict[str, WorkerStream] = {}
        self._old: set[WorkerStream] = set()
        self._call_only: dict[str, float] = {}  # worker without GenerateMux -> since
        self._clock = clock
        self._retry_s = retry_stream_s

    def generate(self, address: str, request: worker_pb2.GenerateRequest,
                 timeout: float | None, plane: str = "") -> Any:
        if plane and self._use_planes:
            since = self._plane_off.get(plane)
            if since is None or self._clock() - since >= self._retry_s:
                return self._plane_stream(address, plane).generate(request, timeout)
        channel = self._pool.get(address)
        stream = self._streams.get(address)
        now = self._clock()
        if stream is not None and stream.unimplemented:
            del self._streams[address]
            if address not in self._call_only:
                log.warning("worker %s has no GenerateMux (an older version?): its calls "
                            "are gRPC calls of their own (a stream is tried again every "
                            "%.0f s)", address, self._retry_s)
            self._call_only[address] = now
            stream = None
        since = self._call_only.get(address)
        if since is not None and now - since < self._retry_s:
            return worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=timeout)
        if stream is None or stream.broken or stream.channel is not channel:
            if stream is not None:
                stream.retire()
                self._old.add(stream)
            self._old = {s for s in self._old if not s.broken}
            stream = self._streams[address] = WorkerStream(channel, address)
        return stream.generate(request, timeout)

    def _plane_stream(self, address: str, plane: str) -> WorkerStream:
        """The stream on the worker's request plane at ``plane`` (a new connection when
        there is none or it ended)."""
        stream = self._planes.get(plane)
        if stream is None or stream.broken:
            stream = self._planes[plane] = WorkerStream(
                self._pool.get(address), plane, PlaneCall(plane, self._pool.tls),
                on_end=self._ended)
        return stream

    def _ended(self, stream: WorkerStream) -> None:
        """Forgets a plane's stream that ended (a restarted worker has a new plane
        address); an unreachable plane is not tried again for ``retry_stream_s``."""
        if self._planes.get(stream.address) is stream:
            del self._planes[stream.address]
        if stream.unreachable is not None:
            now = self._clock()  # planes not tried for long (dead workers') are dropped
            self._plane_off = {a: t for a, t in self._plane_off.items()
                               if now - t < FORGET_OFF_PLANES * self._retry_s}
            if stream.address not in self._plane_off:
                log.warning("the request plane %s is unreachable (%s): its worker's calls "
                            "go over gRPC (it is tried again every %.0f s)",
                            stream.address, stream.unreachable, self._retry_s)
            self._plane_off[stream.address] = now

    async def close(self) -> None:
        streams = [*self._streams.values(), *self._old, *self._planes.values()]
        self._streams.clear()
        self._planes.clear()
        self._old.clear()
        await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)
