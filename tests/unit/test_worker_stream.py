"""Worker.GenerateMux: Generate calls multiplexed on one stream (the frontend's
``--worker-transport stream``; :mod:`services.frontend.worker_stream` and
:mod:`workers.generate_stream`).

Real WorkerServicers over mock engines on loopback gRPC servers. A call on a stream gives
what a Generate call gives, responses and errors alike; a cancel or a deadline aborts the
engine request; a worker that stops fails the calls on its stream with UNAVAILABLE and a
restarted one is reached by the next call; a caller that breaks the protocol ends its
stream with INVALID_ARGUMENT. The pipeline over streams is
:mod:`tests.unit.test_frontend_release` (every test there runs with both transports).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from protos import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.grpc_client import ChannelPool
from services.frontend.worker_stream import WorkerStreams
from tests.unit.test_frontend_release import serve
from tests.waiting import wait_for
from workers.engines.mock import MockEngine, MockEngineConfig
from workers.service import WorkerServicer


@dataclass
class Worker:
    engine: MockEngine
    servicer: WorkerServicer
    server: grpc.aio.Server
    address: str

    def idle(self) -> bool:
        load = self.engine.load()
        return not load.num_running and not load.num_waiting


async def start_worker(timing: str = "zero", address: str = "") -> Worker:
    engine = MockEngine(MockEngineConfig(model_name="m", block_size=16, num_blocks=512,
                                         max_model_len=4096, timing=timing))
    await engine.start()
    servicer = WorkerServicer(engine, "w")
    if address:
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
        assert server.add_insecure_port(address)
        await server.start()
    else:
        server, address = await serve(worker_pb2_grpc.add_WorkerServicer_to_server,
                                      servicer)
    return Worker(engine, servicer, server, address)


async def stop_worker(w: Worker) -> None:
    await w.server.stop(0)
    await w.engine.shutdown()


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    w = await start_worker("poly")
    yield w
    await stop_worker(w)


@pytest.fixture
async def streams() -> AsyncIterator[WorkerStreams]:
    pool = ChannelPool()
    s = WorkerStreams(pool)
    yield s
    await s.close()
    await pool.close()


def request(rid: str, tokens: int = 12, whole: bool = False, seed: int = 1,
            prompt: list[int] | None = None) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id=rid, token_ids=prompt if prompt is not None else list(range(5, 60)),
        whole=whole, sampling=common_pb2.SamplingParams(max_tokens=tokens, ignore_eos=True,
                                                        seed=seed))


async def by_call(w: Worker, req: worker_pb2.GenerateRequest
                  ) -> list[worker_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(w.address) as ch:
        return [r async for r in worker_pb2_grpc.WorkerStub(ch).Generate(req)]


def answer(msgs: list[worker_pb2.GenerateResponse]) -> tuple[list[int], str]:
    """A call's whole answer: every token id and the text, in order."""
    return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs)


async def test_interleaved_calls_answer_what_generate_calls_answer(
        worker: Worker, streams: WorkerStreams) -> None:
    reqs = [request(f"r{i}", tokens=4 + 3 * i, whole=i % 2 == 0, seed=i) for i in range(8)]
    want = [await by_call(worker, r) for r in reqs]

    async def one(r: worker_pb2.GenerateRequest) -> list[worker_pb2.GenerateResponse]:
        r2 = worker_pb2.GenerateRequest()
        r2.CopyFrom(r)
        r2.request_id += "-s"
        return [m async for m in streams.generate(worker.address, r2, 30)]

    got = await asyncio.gather(*(one(r) for r in reqs))
    for w_msgs, g_msgs in zip(want, got, strict=True):
        # the same answer; how it is cut into messages is the engine's timing (outputs
        # waiting when the consumer asks are merged, as vLLM's are)
        assert answer(g_msgs) == answer(w_msgs)
        assert g_msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert g_msgs[-1].usage.completion_tokens == w_msgs[-1].usage.completion_tokens
    assert len(streams._streams) == 1  # one stream carried them all


async def test_a_call_error_keeps_its_status_and_the_stream_goes_on(
        worker: Worker, streams: WorkerStreams) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in streams.generate(worker.address, request("bad", prompt=[]), 30):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids must not be empty" in (err.value.details() or "")
    ok = [m async for m in streams.generate(worker.address, request("ok", 3), 30)]
    assert sum(len(m.token_ids) for m in ok) == 3


async def test_cancel_aborts_the_engine_request(worker: Worker,
                                                streams: WorkerStreams) -> None:
    call = streams.generate(worker.address, request("long", tokens=2000), 30)
    first = await call.__anext__()
    assert first.token_ids
    assert call.cancel() and not call.cancel()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.__anext__()
    assert err.value.code() == grpc.StatusCode.CANCELLED
    await wait_for(worker.idle, 10, "the engine request aborted")
    ok = [m async for m in streams.generate(worker.address, request("after", 2), 30)]
    assert sum(len(m.token_ids) for m in ok) == 2


async def test_a_deadline_ends_the_call_and_aborts_the_engine_request(
        worker: Worker, streams: WorkerStreams) -> None:
    call = streams.generate(worker.address, request("slow", tokens=3000), 0.3)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_for(worker.idle, 10, "the engine request aborted")


async def test_a_stopped_worker_fails_the_calls_on_its_stream_and_a_restart_is_reached(
        streams: WorkerStreams) -> None:
    w = await start_worker("poly")
    call = streams.generate(w.address, request("mid", tokens=2000), 30)
    assert (await call.__anext__()).token_ids
    await w.server.stop(0)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert w.address in (err.value.details() or "")
    await w.engine.shutdown()
    again = await start_worker(address=w.address)
    try:
        streams._pool.invalidate(w.address)  # what the pipeline does after UNAVAILABLE
        ok = [m async for m in streams.generate(w.address, request("new", 3), 30)]
        assert sum(len(m.token_ids) for m in ok) == 3
    finally:
        await stop_worker(again)


async def test_a_stopping_worker_ends_its_streams_and_refuses_new_calls(
        worker: Worker, streams: WorkerStreams) -> None:
    call = streams.generate(worker.address, request("run", tokens=2000), 30)
    assert (await call.__anext__()).token_ids
    await worker.servicer.streams.close()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details() == "worker is stopping"
    await wait_for(worker.idle, 10, "the engine request aborted")
    async with grpc.aio.insecure_channel(worker.address) as ch:
        stream = worker_pb2_grpc.WorkerStub(ch).GenerateMux()
        hello = await stream.read()  # the stream is open: frames may come
        assert list(hello.replies) == [worker_pb2.GenerateReply(call_id=0)]
        await stream.write(worker_pb2.GenerateFrames(frames=[
            worker_pb2.GenerateFrame(call_id=1, request=request("late"))]))
        (reply,) = (await stream.read()).replies
        assert reply.call_id == 1 and reply.WhichOneof("kind") == "end"
        assert reply.end.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert reply.end.details == "worker is stopping"
        stream.cancel()


@pytest.mark.parametrize(("messages", "message"), [
    ([[worker_pb2.GenerateFrame(call_id=3)]], "frame of call_id 3: neither request nor cancel"),
    ([[worker_pb2.GenerateFrame(call_id=4, request=request("a", 2000))],
      [worker_pb2.GenerateFrame(call_id=4, request=request("b"))]],
     "call_id 4 is already running"),
    ([[worker_pb2.GenerateFrame(call_id=5, request=request("c", 2000)),
       worker_pb2.GenerateFrame(call_id=5, request=request("d"))]],
     "call_id 5 is already running"),
    ([[]], "a GenerateFrames message with no frame"),
], ids=["no-kind", "running-id", "running-id-same-message", "empty-message"])
async def test_a_caller_breaking_the_protocol_ends_its_stream(
        worker: Worker, messages: list[list[worker_pb2.GenerateFrame]], message: str) -> None:
    async with grpc.aio.insecure_channel(worker.address) as ch:
        stream = worker_pb2_grpc.WorkerStub(ch).GenerateMux()
        for frames in messages:
            await stream.write(worker_pb2.GenerateFrames(frames=frames))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stream:
                pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == message
    await wait_for(worker.idle, 10, "the stream's calls cancelled")


async def test_frames_and_replies_travel_in_batches(worker: Worker) -> None:
    """Frames sent in one message start their calls in order; a whole answer's last
    response and its end come in one message (the worker sends what it had queued
    together), and every call gets exactly its replies: its responses, then one end."""
    async with grpc.aio.insecure_channel(worker.address) as ch:
        stream = worker_pb2_grpc.WorkerStub(ch).GenerateMux()
        await stream.read()  # open
        await stream.write(worker_pb2.GenerateFrames(frames=[
            worker_pb2.GenerateFrame(call_id=i, request=request(f"b{i}", tokens=3 + i,
                                                                whole=True, seed=i))
            for i in (1, 2, 3)]))
        replies: dict[int, list[worker_pb2.GenerateReply]] = {1: [], 2: [], 3: []}
        together = 0  # messages holding a call's last response and its end
        while any(not r or r[-1].WhichOneof("kind") != "end" for r in replies.values()):
            message = await stream.read()
            assert message.replies, "a message with no reply"
            for a, b in itertools.pairwise(message.replies):
                together += (a.call_id == b.call_id and a.WhichOneof("kind") == "response"
                             and b.WhichOneof("kind") == "end")
            for reply in message.replies:
                replies[reply.call_id].append(reply)
        stream.cancel()
    for i, got in replies.items():
        *responses, end = got
        assert end.end.code == grpc.StatusCode.OK.value[0]
        assert all(r.WhichOneof("kind") == "response" for r in responses)
        assert sum(len(r.response.token_ids) for r in responses) == 3 + i
        assert responses[-1].response.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert together == 3


async def test_cancels_of_calls_mid_answer_lose_no_other_reply(
        streams: WorkerStreams) -> None:
    """Calls cancelled while the worker writes their responses (the pipeline cancels a
    call whose client went away, or as soon as its finish is in), interleaved with calls
    that run to the end: every one of those gets all its replies (a write cancelled
    mid-way would leave gRPC's send in flight and fail the next one: a lost reply hangs
    its call, and wait_for fails)."""
    w = await start_worker("zero")
    try:
        await cancel_half_mid_answer(
            lambda i: streams.generate(w.address, request(f"x{i}", tokens=60, seed=i), 30),
            w.idle)
    finally:
        await stop_worker(w)


async def cancel_half_mid_answer(start: Callable[[int], Any], idle: Callable[[], bool]) -> None:
    """4 rounds of 100 calls ``start(i)`` of 60 tokens each, every odd one cancelled after
    a few tokens: the others get all 60, and the worker ends up ``idle``."""
    async def one(i: int) -> int:
        call = start(i)
        n = 0
        async for m in call:
            n += len(m.token_ids)
            if i % 2 and n >= 1 + i % 7:
                call.cancel()
                return -1
        return n

    for r in range(4):
        got = await asyncio.wait_for(
            asyncio.gather(*(one(100 * r + i) for i in range(100))), 30)
        assert got == [60 if i % 2 == 0 else -1 for i in range(100)]
    await wait_for(idle, 10, "every call ended on the worker")


async def test_a_worker_without_generate_stream_is_called_the_old_way() -> None:
    """An older worker (no GenerateMux: UNIMPLEMENTED) ran none of the calls sent on
    the stream: each goes on as a Generate call of its own, as do the later ones, until
    retry_stream_s has passed; the same address upgraded in place then gets a stream."""
    now = [0.0]
    pool = ChannelPool()
    streams = WorkerStreams(pool, clock=lambda: now[0], retry_stream_s=60)
    engine = MockEngine(MockEngineConfig(model_name="m", block_size=16, num_blocks=512,
                                         max_model_len=4096, timing="zero"))
    await engine.start()
    servicer = WorkerServicer(engine, "old")
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "kvmesh.worker.Worker", {"Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, worker_pb2.GenerateRequest.FromString,
            worker_pb2.GenerateResponse.SerializeToString)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    new: Worker | None = None
    try:
        async def one(i: int) -> int:
            call = streams.generate(address, request(f"o{i}", tokens=5, seed=i), 30)
            return sum([len(m.token_ids) async for m in call])

        assert await asyncio.gather(*(one(i) for i in range(4))) == [5] * 4
        assert await one(9) == 5
        assert address in streams._call_only and address not in streams._streams
        await server.stop(0)
        new = await start_worker(address=address)  # upgraded in place
        pool.invalidate(address)  # as the pipeline does after the restart's UNAVAILABLE
        now[0] = 59.0
        assert await one(10) == 5 and address not in streams._streams  # still calls
        now[0] = 61.0
        assert await one(11) == 5 and address in streams._streams  # a stream again
    finally:
        await server.stop(0)
        await engine.shutdown()
        if new is not None:
            await stop_worker(new)
        await streams.close()
        await pool.close()
