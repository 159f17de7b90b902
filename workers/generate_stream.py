"""The worker's half of ``Worker.GenerateMux``: many Generate calls multiplexed on one
long-lived gRPC stream (the frontend's half: :mod:`services.frontend.worker_stream`).

A call through a stream costs its frames, not a gRPC call of its own (measured in
``bench/results/mesh_floors.json``: ``grpc`` against ``grpc-mux``), the way Dynamo's
request plane keeps one connection per worker; and each gRPC message carries every
frame (reply) queued when it is sent (:class:`services.common.batching.Outbox`: on the
TCP request plane from a loop callback at the end of the event-loop turn, no writer task
woken), so a call's last response and its end, and the replies of calls that an engine
step served together, cost one message.

Contract of :class:`GenerateStreams` (``handle`` is the servicer's GenerateMux):

- Messages both ways are batches (:class:`GenerateFrames`, :class:`GenerateReplies`):
  their frames (replies) count in order, as if each came alone.
- The stream's first reply, ``call_id`` 0 with neither field, says it is open; the
  caller sends no frame before it (so a worker without GenerateMux, an older
  version, answers UNIMPLEMENTED before any call was sent to it).
- Each :class:`GenerateFrame` with ``request`` starts a call: ``generate(request,
  context)`` (the servicer's own Generate, the same validation, engine, holder and
  errors) in a task of its own, in the trace context the frame's ``metadata`` carries
  (as the server's tracing interceptor would make current: a server span
  ``/kvmesh.worker.Worker/Generate`` when it is sampled and tracing is not lean), within
  ``timeout_s`` when set. Each response goes out as a :class:`GenerateReply` with
  ``response``, in order; then exactly one ``end`` reply: code OK, or the status
  Generate aborted with (code, details, trailing metadata), DEADLINE_EXCEEDED ("Deadline
  Exceeded") past ``timeout_s``, CANCELLED after a cancel frame, UNAVAILABLE ("worker is
  stopping") when ``close()`` ended it, INTERNAL naming an
  exception Generate let escape (logged). Replies of different calls interleave; each
  stream's :class:`~services.common.batching.Outbox` sends them all, in order (a call
  only posts its replies).
- A ``cancel`` frame cancels its call (an unknown or ended ``call_id`` is ignored), as
  cancelling a Generate call does: the engine request is aborted.
- A frame with neither, a ``request`` with ``call_id`` 0 or one whose ``call_id`` is
  still running, or a GenerateFrames with no frame, is a broken caller: the stream ends
  with INVALID_ARGUMENT naming it. A stream that ends, however it ends, cancels the calls
  still running on it.
- ``close()`` (the worker's stop, after its engine has stopped): every call still
  running ends with UNAVAILABLE ("worker is stopping": the caller migrates it), new
  ``request`` frames end so at once, and every stream still open is then ended, so the
  server's graceful stop does not wait for them. Idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from protos import worker_pb2
from services.common import telemetry
from services.common.batching import Outbox

log = logging.getLogger(__name__)

GENERATE_METHOD = "/kvmesh.worker.Worker/Generate"
FLUSH_TIMEOUT_S = 5.0  # a closing stream's last replies wait at most this for the caller
Generate = Callable[[worker_pb2.GenerateRequest, Any],
                    AsyncGenerator[worker_pb2.GenerateResponse, None]]


class CallAborted(Exception):
    """What :class:`FrameContext.abort` raises: the call's status."""

    def __init__(self, code: grpc.StatusCode, details: str,
                 trailing: Iterable[tuple[str, str]]) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details, self.trailing = code, details, tuple(trailing)


class FrameContext:
    """The part of ``grpc.aio.ServicerContext`` Generate uses, for one call on a stream."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Iterable[tuple[str, str]] = ()) -> None:
        raise CallAborted(code, details, trailing_metadata or ())

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


def _end(call_id: int, code: grpc.StatusCode, details: str = "",
         trailing: Iterable[tuple[str, str]] = ()) -> worker_pb2.GenerateReply:
    return worker_pb2.GenerateReply(call_id=call_id, end=worker_pb2.CallStatus(
        code=code.value[0], details=details, trailing_metadata=[
            worker_pb2.MetadataEntry(key=k, value=str(v)) for k, v in trailing]))


class _Stream:
    """One open stream: its running calls, and the outbox that sends its replies (its
    writer task, or on the request plane a loop callback; a call never awaits a write: a
    call cancelled mid-write would leave gRPC's send in flight, and the next write would
    fail with TOO_MANY_OPERATIONS)."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.context = context
        self.calls: dict[int, asyncio.Task[None]] = {}
        self.cancelled: set[int] = set()  # calls a cancel frame cancelled
        self.task = asyncio.current_task()
        nowait = getattr(context, "write_nowait", None)  # the request plane's connection
        self._outbox: Outbox[worker_pb2.GenerateReply] = Outbox(
            self._send, (lambda replies: bool(nowait(worker_pb2.GenerateReplies(
                replies=replies)))) if nowait is not None else None)
        self._writer = asyncio.ensure_future(self._write())

    def forget(self, call_id: int) -> Callable[[asyncio.Task[None]], None]:
        """A done callback that drops ``call_id``'s task from :attr:`calls`."""
        def drop(_task: asyncio.Task[None]) -> None:
            self.calls.pop(call_id, None)
            self.cancelled.discard(call_id)
        return drop

    def send(self, reply: worker_pb2.GenerateReply) -> None:
        """Sends ``reply`` after those sent before it (:class:`Outbox`)."""
        self._outbox.post(reply)

    async def _send(self, replies: list[worker_pb2.GenerateReply]) -> None:
        await self.context.write(worker_pb2.GenerateReplies(replies=replies))

    async def _write(self) -> None:
        """Writes the outbox in order, in batches (what is queued when a write starts),
        until its end; a failed write (the caller or the server is gone: nobody is left
        to tell) ends it, logged at debug level, so the task never ends with an exception
        nobody retrieves (the stream's teardown may be cancelled before ``flush``)."""
        try:
            await self._outbox.run()
        except Exception as exc:  # noqa: BLE001 - see the docstring
            self._outbox.closed = True  # nothing more goes out
            log.debug("GenerateMux: a reply could not be written: %r", exc)

    async def flush(self) -> None:
        """Writes what is queued, then stops the writer (quietly when the stream is gone:
        nobody is left to tell; a write still pending after FLUSH_TIMEOUT_S is dropped)."""
        self._outbox.post(None)
        done, _ = await asyncio.wait({self._writer}, timeout=FLUSH_TIMEOUT_S)
        if not done:
            self._writer.cancel()
            log.warning("GenerateMux: replies not written within %.0f s dropped "
                        "(the caller is gone or stalled)", FLUSH_TIMEOUT_S)


class GenerateStreams:
    """Serves GenerateMux with ``generate`` (see the module docstring)."""

    def __init__(self, generate: Generate) -> None:
        self._generate = generate
        self._streams: set[_Stream] = set()
        self._closing = False

    async def close(self) -> None:
        self._closing = True
        streams = list(self._streams)
        calls = [task for stream in streams for task in stream.calls.values()]
        for task in calls:
            task.cancel()  # each ends UNAVAILABLE "worker is stopping" (written first)
        await asyncio.gather(*calls, return_exceptions=True)
        for stream in streams:
            if stream.task is not None:
                stream.task.cancel()

    async def handle(self, messages: AsyncIterator[worker_pb2.GenerateFrames],
                     context: grpc.aio.ServicerContext) -> None:
        stream = _Stream(context)
        self._streams.add(stream)
        stream.send(worker_pb2.GenerateReply(call_id=0))  # open: frames may come
        problem: str | None = None  # how the caller broke the protocol
        try:
            async for message in messages:
                problem = self._take(stream, message.frames)
                if problem is not None:
                    break
        finally:
            self._streams.discard(stream)
            calls = list(stream.calls.values())
            for task in calls:
                task.cancel()
            if calls:
                await asyncio.gather(*calls, return_exceptions=True)
            await stream.flush()  # their end replies too, while the stream is open
        if problem is not None:  # after the writer stopped: no write races the status
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)

    def _take(self, stream: _Stream, frames: Sequence[worker_pb2.GenerateFrame]
              ) -> str | None:
        """Starts or cancels the calls ``frames`` name, in order; how the caller broke the
        protocol, if it did (the frames after the bad one are not taken)."""
        if not frames:
            return "a GenerateFrames message with no frame"
        for frame in frames:
            kind = frame.WhichOneof("kind")
            if kind == "cancel":
                task = stream.calls.get(frame.call_id)
                if task is not None:
                    stream.cancelled.add(frame.call_id)
                    task.cancel()
                continue
            if kind != "request":
                return f"frame of call_id {frame.call_id}: neither request nor cancel"
            if not frame.call_id:
                return "call_id 0 is the stream's own: a call needs another"
            if frame.call_id in stream.calls:
                return f"call_id {frame.call_id} is already running"
            if self._closing:
                stream.send(_end(frame.call_id, grpc.StatusCode.UNAVAILABLE,
                                 "worker is stopping"))
                continue
            task = asyncio.ensure_future(self._call(stream, frame))
            stream.calls[frame.call_id] = task
            task.add_done_callback(stream.forget(frame.call_id))
        return None

    async def _call(self, stream: _Stream, frame: worker_pb2.GenerateFrame) -> None:
        """Runs one call and writes its replies; never raises but for the stream's end."""
        call_id = frame.call_id
        metadata = tuple((m.key, m.value) for m in frame.metadata)
        ctx = telemetry.remote_context(metadata)
        span: trace.Span | None = None
        if not telemetry.lean() or telemetry.is_sampled(ctx):
            span = telemetry.tracer("worker").start_span(
                GENERATE_METHOD, context=ctx, kind=trace.SpanKind.SERVER)
            ctx = trace.set_span_in_context(span, ctx)
        otel_context.attach(ctx)  # this call's own task: it ends with the call
        end: worker_pb2.GenerateReply
        try:
            async with (asyncio.timeout(frame.timeout_s if frame.timeout_s > 0 else None),
                        contextlib.aclosing(self._generate(frame.request, FrameContext(
                            metadata))) as responses):  # closed at once if cancelled
                async for resp in responses:
                    stream.send(worker_pb2.GenerateReply(call_id=call_id, response=resp))
            end = _end(call_id, grpc.StatusCode.OK)
        except CallAborted as exc:
            end = _end(call_id, exc.code, exc.details, exc.trailing)
        except TimeoutError:
            end = _end(call_id, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        except asyncio.CancelledError:  # a cancel frame, close(), or the stream ends
            end = (_end(call_id, grpc.StatusCode.CANCELLED, "cancelled by the caller")
                   if call_id in stream.cancelled
                   else _end(call_id, grpc.StatusCode.UNAVAILABLE, "worker is stopping")
                   if self._closing
                   else _end(call_id, grpc.StatusCode.CANCELLED, "the stream ended"))
        except Exception as exc:
            log.exception("%s (call %d on a stream) failed", GENERATE_METHOD, call_id)
            end = _end(call_id, grpc.StatusCode.INTERNAL,
                       f"{GENERATE_METHOD} failed: {type(exc).__name__}: {exc}"[:512])
        if span is not None:
            if end.end.code:
                span.set_status(trace.Status(trace.StatusCode.ERROR, end.end.details))
            span.end()
        stream.send(end)
