"""The TCP request plane: Generate calls multiplexed on a plain TCP (or mTLS) connection
(the frontend's ``--worker-transport tcp``; :mod:`workers.request_plane`,
:mod:`services.frontend.request_plane`, :mod:`services.common.frames`).

Real WorkerServicers over mock engines, each with its request plane on a loopback port.
A call on the plane gives what a Generate call gives, responses and errors alike; a
cancel or a deadline aborts the engine request; a worker that goes away fails the calls
on its connection with UNAVAILABLE, and its restart (a new plane) is reached by the next
call; a caller that breaks the framing or the protocol is refused with a status naming
the problem (or dropped, when it never said it speaks the protocol) and the worker goes
on; under mTLS only a frontend's certificate is served. The pipeline over the plane is
:mod:`tests.unit.test_frontend_release` (every test there runs with each transport).
"""

from __future__ import annotations

import asyncio
import ssl
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from protos import worker_pb2
from services.common.frames import PREAMBLE, FramedProtocol, FrameError
from services.common.grpc_client import ChannelPool
from services.common.tls import MeshTls, identity_of, issue, make_ca, server_name
from services.frontend.request_plane import PlaneCall
from services.frontend.worker_stream import WorkerStreams
from tests.unit.test_worker_stream import (
    Worker,
    by_call,
    cancel_half_mid_answer,
    request,
    start_worker,
    stop_worker,
)
from tests.waiting import wait_for
from workers.request_plane import RequestPlane, _PlaneContext

_LEN = struct.Struct("<I")


@dataclass
class PlaneWorker:
    worker: Worker
    plane: RequestPlane

    @property
    def address(self) -> str:
        return self.worker.address

    @property
    def plane_address(self) -> str:
        return self.plane.address

    def idle(self) -> bool:
        return self.worker.idle()


async def start(timing: str = "poly", tls: MeshTls | None = None) -> PlaneWorker:
    w = await start_worker(timing)
    plane = RequestPlane(w.servicer.streams, "127.0.0.1", 0, "127.0.0.1", tls)
    await plane.start()
    return PlaneWorker(w, plane)


async def stop(p: PlaneWorker) -> None:
    """The worker's own stop order: its streams end their calls, then its plane closes."""
    await p.worker.servicer.streams.close()
    await p.plane.close()
    await stop_worker(p.worker)


async def crash(p: PlaneWorker) -> None:
    """The worker's process dies: its connections drop, nothing more is sent."""
    p.plane.abort_connections()
    await p.plane.close()
    await stop_worker(p.worker)


@pytest.fixture
async def worker() -> AsyncIterator[PlaneWorker]:
    p = await start()
    yield p
    await stop(p)


@pytest.fixture
async def streams() -> AsyncIterator[WorkerStreams]:
    pool = ChannelPool()
    s = WorkerStreams(pool, planes=True)
    yield s
    await s.close()
    await pool.close()


def call(streams: WorkerStreams, w: PlaneWorker, req: worker_pb2.GenerateRequest,
         timeout: float = 30) -> object:
    return streams.generate(w.address, req, timeout, w.plane_address)


async def tokens(streams: WorkerStreams, w: PlaneWorker,
                 req: worker_pb2.GenerateRequest) -> int:
    return sum([len(m.token_ids) async for m in streams.generate(  # type: ignore[attr-defined]
        w.address, req, 30, w.plane_address)])


def answer(msgs: list[worker_pb2.GenerateResponse]) -> tuple[list[int], str]:
    """A call's whole answer: every token id and the text, in order."""
    return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs)


async def test_interleaved_calls_answer_what_generate_calls_answer(
        worker: PlaneWorker, streams: WorkerStreams) -> None:
    reqs = [request(f"r{i}", tokens=4 + 3 * i, whole=i % 2 == 0, seed=i) for i in range(8)]
    want = [await by_call(worker.worker, r) for r in reqs]

    async def one(r: worker_pb2.GenerateRequest) -> list[worker_pb2.GenerateResponse]:
        r2 = worker_pb2.GenerateRequest()
        r2.CopyFrom(r)
        r2.request_id += "-p"
        return [m async for m in streams.generate(worker.address, r2, 30,
                                                  worker.plane_address)]

    got = await asyncio.gather(*(one(r) for r in reqs))
    for w_msgs, g_msgs in zip(want, got, strict=True):
        # the same answer; how it is cut into messages is the engine's timing (outputs
        # waiting when the consumer asks are merged, as vLLM's are)
        assert answer(g_msgs) == answer(w_msgs)
        assert g_msgs[-1].usage.completion_tokens == w_msgs[-1].usage.completion_tokens
    assert list(streams._planes) == [worker.plane_address]  # one connection carried all
    assert len(worker.plane._conns) == 1


async def test_a_call_error_keeps_its_status_and_the_connection_goes_on(
        worker: PlaneWorker, streams: WorkerStreams) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call(streams, worker, request("bad", prompt=[])):  # type: ignore[attr-defined]
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids must not be empty" in (err.value.details() or "")
    assert await tokens(streams, worker, request("ok", 3)) == 3


async def test_cancel_and_deadline_abort_the_engine_request(
        worker: PlaneWorker, streams: WorkerStreams) -> None:
    c = streams.generate(worker.address, request("long", tokens=2000), 30,
                         worker.plane_address)
    assert (await c.__anext__()).token_ids
    assert c.cancel() and not c.cancel()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.__anext__()
    assert err.value.code() == grpc.StatusCode.CANCELLED
    await wait_for(worker.idle, 10, "the cancelled engine request aborted")
    slow = streams.generate(worker.address, request("slow", tokens=3000), 0.3,
                            worker.plane_address)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in slow:
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_for(worker.idle, 10, "the expired engine request aborted")
    assert await tokens(streams, worker, request("after", 2)) == 2


async def test_a_worker_gone_fails_its_calls_and_its_restart_is_reached(
        streams: WorkerStreams) -> None:
    w = await start()
    c = streams.generate(w.address, request("mid", tokens=2000), 30, w.plane_address)
    assert (await c.__anext__()).token_ids
    await crash(w)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in c:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert w.plane_address in (err.value.details() or "")
    again = await start()
    try:
        assert await tokens(streams, again, request("new", 3)) == 3
        assert list(streams._planes) == [again.plane_address]  # the dead plane forgotten
    finally:
        await stop(again)


async def test_an_unreachable_plane_sends_the_calls_over_grpc(
        caplog: pytest.LogCaptureFixture) -> None:
    """A plane nothing listens on (a firewall, a wrong address): the calls sent to it go
    on as Generate calls (nothing reached the worker), the worker's later calls use its
    GenerateMux, logged once; after retry_stream_s the plane is tried again."""
    now = [0.0]
    pool = ChannelPool()
    streams = WorkerStreams(pool, clock=lambda: now[0], retry_stream_s=60, planes=True)
    w = await start("zero")
    dead = w.plane.address
    await w.plane.close()  # the published address leads nowhere now
    try:
        async def one(i: int) -> int:
            c = streams.generate(w.address, request(f"u{i}", tokens=4, seed=i), 30, dead)
            return sum([len(m.token_ids) async for m in c])

        with caplog.at_level("WARNING", logger="services.frontend.worker_stream"):
            assert await asyncio.gather(*(one(i) for i in range(4))) == [4] * 4
            assert dead in streams._plane_off and not streams._planes
            assert await one(5) == 4 and w.address in streams._streams  # its GenerateMux
            now[0] = 61.0
            assert await one(6) == 4  # tried again: still unreachable, over gRPC again
        warned = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(warned) == 1 and dead in warned[0].getMessage()
        assert streams._plane_off[dead] == 61.0
        other = await start("zero")  # much later another plane fails: the old one is gone
        await other.plane.close()
        now[0] = 61.0 + 10 * 60
        c = streams.generate(other.address, request("o", 2), 30, other.plane.address)
        assert sum([len(m.token_ids) async for m in c]) == 2
        assert list(streams._plane_off) == [other.plane.address]
        await stop_worker(other.worker)
    finally:
        await streams.close()
        await pool.close()
        await stop_worker(w.worker)


async def test_a_stopping_worker_ends_the_calls_on_its_plane(
        worker: PlaneWorker, streams: WorkerStreams) -> None:
    c = call(streams, worker, request("run", tokens=2000))
    assert (await c.__anext__()).token_ids  # type: ignore[attr-defined]
    done = [m async for m in call(streams, worker, request("done", 3))]  # type: ignore[attr-defined]
    await worker.worker.servicer.streams.close()  # the worker's stop order
    await worker.plane.close()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in c:  # type: ignore[attr-defined]
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details() == "worker is stopping"  # its last reply came through
    assert sum(len(m.token_ids) for m in done) == 3
    await wait_for(worker.idle, 10, "the engine request aborted")


async def test_cancels_of_calls_mid_answer_lose_no_other_reply(
        streams: WorkerStreams) -> None:
    w = await start("zero")
    try:
        await cancel_half_mid_answer(
            lambda i: streams.generate(w.address, request(f"x{i}", tokens=60, seed=i), 30,
                                       w.plane_address), w.idle)
    finally:
        await stop(w)


# the raw protocol -------------------------------------------------------------------


class Raw:
    """A caller speaking the wire by hand."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, address: str, preamble: bytes = PREAMBLE) -> Raw:
        host, _, port = address.rpartition(":")
        r, w = await asyncio.open_connection(host, int(port))
        w.write(preamble)
        return cls(r, w)

    def send(self, payload: bytes) -> None:
        self.writer.write(_LEN.pack(len(payload)) + payload)

    async def message(self) -> worker_pb2.GenerateReplies | None:
        try:
            (size,) = _LEN.unpack(await self.reader.readexactly(4))
        except asyncio.IncompleteReadError as exc:
            assert exc.partial == b""
            return None
        return worker_pb2.GenerateReplies.FromString(await self.reader.readexactly(size))

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def _status(raw: Raw) -> worker_pb2.CallStatus:
    """The connection's last status (after the opening reply), then its close."""
    hello = await raw.message()
    assert hello is not None and list(hello.replies) == [worker_pb2.GenerateReply(call_id=0)]
    last = await raw.message()
    assert last is not None and len(last.replies) == 1 and last.replies[0].call_id == 0
    assert await raw.message() is None  # closed
    return last.replies[0].end


def _frames(*frames: worker_pb2.GenerateFrame) -> bytes:
    return worker_pb2.GenerateFrames(frames=frames).SerializeToString()


@pytest.mark.parametrize(("payloads", "message"), [
    ([_frames(worker_pb2.GenerateFrame(call_id=3))],
     "frame of call_id 3: neither request nor cancel"),
    ([_frames(worker_pb2.GenerateFrame(call_id=4, request=request("a", 2000))),
      _frames(worker_pb2.GenerateFrame(call_id=4, request=request("b")))],
     "call_id 4 is already running"),
    ([b"\xff\xff\xff"], "a request-plane message is not a GenerateFrames"),
    ([_frames(worker_pb2.GenerateFrame(call_id=0, request=request("z")))],
     "call_id 0 is the stream's own"),
], ids=["no-kind", "running-id", "not-protobuf", "call-id-0"])
async def test_a_caller_breaking_the_protocol_gets_a_status_naming_it(
        worker: PlaneWorker, streams: WorkerStreams, payloads: list[bytes],
        message: str) -> None:
    raw = await Raw.open(worker.plane_address)
    for p in payloads:
        raw.send(p)
    status = await _status(raw)
    await raw.close()
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert status.details.startswith(message)
    await wait_for(worker.idle, 10, "the connection's calls cancelled")
    assert await tokens(streams, worker, request("still", 2)) == 2  # the worker goes on


async def test_a_status_reaches_the_frontend_as_the_error_it_names(
        worker: PlaneWorker) -> None:
    carrier = PlaneCall(worker.plane_address)
    try:
        opened = await carrier.__anext__()
        assert list(opened.replies) == [worker_pb2.GenerateReply(call_id=0)]
        await carrier.write(worker_pb2.GenerateFrames(frames=[
            worker_pb2.GenerateFrame(call_id=9)]))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await carrier.__anext__()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "call_id 9" in (err.value.details() or "")
    finally:
        carrier.cancel()


@pytest.mark.parametrize("oversized", [False, True], ids=["not-the-protocol",
                                                         "oversized-message"])
async def test_a_connection_breaking_the_framing_is_dropped(
        worker: PlaneWorker, streams: WorkerStreams, oversized: bool) -> None:
    raw = await Raw.open(worker.plane_address,
                         preamble=PREAMBLE if oversized else b"GET / HTTP/1.1\r\n\r\n")
    if oversized:
        hello = await raw.message()
        assert hello is not None and hello.replies[0].call_id == 0
        raw.writer.write(_LEN.pack(1 << 30))  # past the 64 MiB limit
    assert await raw.message() is None  # closed, nothing (more) answered
    await raw.close()
    assert await tokens(streams, worker, request("still", 2)) == 2


async def test_framing_survives_any_split_and_refuses_data_after_the_end() -> None:
    got: list[bytes | None] = []
    proto = FramedProtocol()

    class _Transport(asyncio.Transport):
        def close(self) -> None:
            proto.connection_lost(None)

        def abort(self) -> None:
            proto.connection_lost(None)

        def is_closing(self) -> bool:
            return False

    proto.connection_made(_Transport())
    wire = b"".join(_LEN.pack(len(m)) + m for m in (b"a", b"bcd" * 100, b"e"))
    for i in range(len(wire)):  # one byte at a time
        proto.data_received(wire[i:i + 1])
    for _ in range(3):
        got.append(await proto.read())
    assert got == [b"a", b"bcd" * 100, b"e"]
    proto.data_received(_LEN.pack(0))  # the end of messages
    assert await proto.read() is None
    proto.data_received(_LEN.pack(1) + b"x")
    with pytest.raises(FrameError, match="after the end of messages"):
        await proto.read()


# mTLS -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs() -> dict[str, MeshTls]:
    ca, ca_key = make_ca()
    out = {}
    for role in ("worker", "frontend", "router"):
        cert, key = issue(ca, ca_key, role, f"{role}-0")
        out[role] = MeshTls(ca, cert, key, identity_of(cert))
    return out


async def test_under_mtls_only_a_frontend_is_served(certs: dict[str, MeshTls]) -> None:
    w = await start(tls=certs["worker"])
    pool = ChannelPool()
    try:
        front = WorkerStreams(ChannelPool(certs["frontend"], "worker"), planes=True)
        assert await tokens(front, w, request("tls", 4)) == 4
        await front.close()
        router = PlaneCall(w.plane_address, certs["router"])  # refused before any reply
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await router.__anext__()
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "'router'" in (err.value.details() or "")
        router.cancel()
        plain = WorkerStreams(pool, planes=True)  # no TLS at all: no handshake
        c = plain.generate(w.address, request("plain", 2), 30, w.plane_address)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in c:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        await plain.close()
        # trusting the mesh CA, but with no client certificate, or one of another CA
        ca2, ca2_key = make_ca("another CA")
        cert, key = issue(ca2, ca2_key, "frontend", "rogue")
        rogue = MeshTls(certs["worker"].ca, cert, key, identity_of(cert))
        host, _, port = w.plane_address.rpartition(":")
        for ctx in (ssl.create_default_context(cadata=certs["worker"].ca.decode()),
                    rogue.ssl_context(server=False)):
            with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
                r, wr = await asyncio.open_connection(host, int(port), ssl=ctx,
                                                      server_hostname=server_name("worker"))
                wr.write(PREAMBLE)
                await r.readexactly(4)  # the worker refuses the handshake: no answer
        assert w.idle() and not w.plane._conns  # a refused handshake never got served
    finally:
        await pool.close()
        await stop(w)


async def test_a_frontend_gone_mid_call_aborts_its_engine_requests(
        worker: PlaneWorker) -> None:
    carrier = PlaneCall(worker.plane_address)
    opened = await carrier.__anext__()
    assert opened.replies[0].call_id == 0
    await carrier.write(worker_pb2.GenerateFrames(frames=[
        worker_pb2.GenerateFrame(call_id=1, request=request("orphan", tokens=2000))]))
    first = await carrier.__anext__()
    assert first.replies[0].call_id == 1 and first.replies[0].response.token_ids
    carrier.cancel()  # the frontend's connection drops
    await wait_for(worker.idle, 10, "the orphaned engine request aborted")
    await wait_for(lambda: not worker.plane._conns, 10, "the connection forgotten")


async def test_a_connection_that_never_says_hello_is_closed() -> None:
    w = await start_worker("zero")
    plane = RequestPlane(w.servicer.streams, "127.0.0.1", 0, "127.0.0.1",
                         handshake_timeout_s=0.2)
    await plane.start()
    try:
        host, _, port = plane.address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:  # closed (dropped), nothing sent
            assert await asyncio.wait_for(reader.read(), 10) == b""
        except ConnectionResetError:
            pass
        writer.close()
    finally:
        await plane.close()
        await stop_worker(w)


async def test_write_nowait_sends_only_what_need_not_wait() -> None:
    """``PlaneCall.write_nowait`` and the worker's ``_PlaneContext.write_nowait`` send at
    once (True) on a connection that is up, open and not under back-pressure; else
    False, nothing sent (the Outbox's writer task then awaits the write)."""
    peers: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def hold(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        peers.append((r, w))  # reads nothing until told

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    call = PlaneCall(f"127.0.0.1:{port}")
    frames = worker_pb2.GenerateFrames(frames=[worker_pb2.GenerateFrame(call_id=1,
                                                                        cancel=True)])
    replies = worker_pb2.GenerateReplies(replies=[worker_pb2.GenerateReply(call_id=1)])
    try:
        assert not call.write_nowait(frames)  # not connected yet
        proto = await asyncio.wait_for(call._connected(), 10)  # noqa: SLF001
        ctx = _PlaneContext(proto)
        assert call.write_nowait(frames) and ctx.write_nowait(replies)
        assert proto.transport is not None
        proto.transport.set_write_buffer_limits(high=1 << 16)
        async with asyncio.timeout(30):
            while not proto.write_paused:  # the peer reads nothing: the buffers fill
                proto.write(b"x" * (1 << 20))
                await asyncio.sleep(0)
        assert not call.write_nowait(frames) and not ctx.write_nowait(replies)
        reader = peers[0][0]
        async with asyncio.timeout(30):
            while proto.write_paused:  # the peer reads: writing resumes
                await reader.read(1 << 20)
        assert call.write_nowait(frames) and ctx.write_nowait(replies)
        call.cancel()  # the connection is dropped
        assert not call.write_nowait(frames) and not ctx.write_nowait(replies)
    finally:
        call.cancel()
        for _, w in peers:
            w.close()
        server.close()
        await server.wait_closed()
