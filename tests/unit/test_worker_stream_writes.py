"""How a :class:`~services.frontend.worker_stream.WorkerStream` sends its frames: those
posted in one event-loop turn leave in one message from a loop callback when the
connection takes a write at once, else through the writer task, and never out of order
(the end of frames last).

The carrier here records what it is given: this is about which frames go out, in which
message and by which path, which the wire cannot show (the real request plane's calls
through the same code are :mod:`tests.unit.test_request_plane`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from protos import worker_pb2
from services.frontend.worker_stream import WorkerStream
from tests.unit.test_batching import turn

Sent = tuple[str, list[str]]


def _names(message: worker_pb2.GenerateFrames) -> list[str]:
    return [f"cancel {f.call_id}" if f.cancel else f"call {f.call_id}"
            for f in message.frames]


class Carrier:
    """A request-plane connection that records each message and how it was sent;
    ``takes_now`` False: it is under back-pressure (``write_nowait`` refuses);
    ``hold`` cleared: an awaited ``write`` waits until it is set."""

    def __init__(self) -> None:
        self.sent: list[Sent] = []
        self.takes_now = True
        self.hold = asyncio.Event()
        self.hold.set()
        self.ended = asyncio.Event()
        self._replies: asyncio.Queue[worker_pb2.GenerateReplies | None] = asyncio.Queue()

    def open(self) -> None:
        """The worker's opening reply."""
        self._replies.put_nowait(worker_pb2.GenerateReplies(
            replies=[worker_pb2.GenerateReply(call_id=0)]))

    def write_nowait(self, message: worker_pb2.GenerateFrames) -> bool:
        if not self.takes_now:
            return False
        self.sent.append(("now", _names(message)))
        return True

    async def write(self, message: worker_pb2.GenerateFrames) -> None:
        self.sent.append(("task", _names(message)))
        await self.hold.wait()

    async def done_writing(self) -> None:
        self.sent.append(("end", []))
        self.ended.set()

    def __aiter__(self) -> Carrier:
        return self

    async def __anext__(self) -> worker_pb2.GenerateReplies:
        reply = await self._replies.get()
        if reply is None:
            raise StopAsyncIteration
        return reply

    def cancel(self) -> bool:
        self._replies.put_nowait(None)
        return True


async def _until(what: asyncio.Event) -> None:
    await asyncio.wait_for(what.wait(), 10)


@pytest.fixture
async def opened() -> AsyncIterator[tuple[WorkerStream, Carrier]]:
    carrier = Carrier()
    stream = WorkerStream(None, "w", carrier)
    carrier.open()
    await asyncio.wait_for(stream._opened.wait(), 10)  # noqa: SLF001
    yield stream, carrier
    await stream.close()


def _request(rid: str) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(request_id=rid, token_ids=[1, 2, 3])


async def test_frames_of_one_turn_leave_in_one_message_without_the_writer(
        opened: tuple[WorkerStream, Carrier]) -> None:
    stream, carrier = opened
    calls = [stream.generate(_request(f"r{i}"), 30) for i in range(3)]
    calls[1].cancel()
    assert carrier.sent == []  # not before the turn ends
    await turn()
    assert carrier.sent == [("now", ["call 1", "call 2", "call 3", "cancel 2"])]
    stream.generate(_request("r3"), 30)
    await turn()
    assert carrier.sent[1:] == [("now", ["call 4"])]


async def test_frames_queue_behind_a_write_in_hand_and_keep_their_order(
        opened: tuple[WorkerStream, Carrier]) -> None:
    stream, carrier = opened
    carrier.takes_now = False  # back-pressure: the callback hands the frame to the writer
    carrier.hold.clear()  # ... whose write then waits
    first = stream.generate(_request("r0"), 30)
    await turn()  # the callback ran: the frame is the writer's now
    await turn()  # ... and the writer took it
    assert carrier.sent == [("task", ["call 1"])]
    carrier.takes_now = True  # the writer still holds its write: these wait behind it
    stream.generate(_request("r1"), 30)
    first.cancel()
    await turn()
    assert carrier.sent == [("task", ["call 1"])]
    carrier.hold.set()
    for _ in range(4):  # the writer finishes its write, then sends what queued meanwhile
        await turn()
    assert carrier.sent == [("task", ["call 1"]), ("task", ["call 2", "cancel 1"])]
    stream.generate(_request("r2"), 30)  # the writer is idle again: the callback sends
    await turn()
    assert carrier.sent[2:] == [("now", ["call 3"])]


async def test_the_end_of_frames_follows_the_frames_before_it(
        opened: tuple[WorkerStream, Carrier]) -> None:
    stream, carrier = opened
    call = stream.generate(_request("r0"), 30)
    stream.retire()  # the stream ends once its last call has
    call.cancel()
    await _until(carrier.ended)
    assert carrier.sent == [("now", ["call 1", "cancel 1"]), ("end", [])]


async def test_frames_before_the_opening_reply_wait_for_it() -> None:
    carrier = Carrier()
    stream = WorkerStream(None, "w", carrier)
    try:
        stream.generate(_request("r0"), 30)
        await turn()
        assert carrier.sent == []
        carrier.open()
        await asyncio.wait_for(stream._opened.wait(), 10)  # noqa: SLF001
        for _ in range(3):
            await turn()
        assert carrier.sent == [("task", ["call 1"])]
    finally:
        await stream.close()
