"""A server-streaming call through kvmesh's interceptor chain
(:class:`services.common.server.TracingInterceptor`,
:mod:`services.common.grpc_streams`) whose client goes away while grpc writes a message
(a server-streaming and a bidirectional call): the servicer's generator is closed in the
call's own task, and OpenTelemetry's server span detaches its context without the
"Failed to detach context" error (the CI failure of test_migration's client disconnect
test, where the event loop's finalizer closed the generators in another task). Also: a
finished stream, an abort mid-stream, a cleanup that raises (logged, the call still
ends) and a message past the size limit (the client gets RESOURCE_EXHAUSTED; no error
logged, whichever of the failed write and the call's end grpc sees first). Those run
through real grpc in a fresh process each (the tracer provider is process-global), on
asyncio's loop and on uvloop, in lean and in full tracing; the orderings grpc cannot be
made to produce on demand (a second cancel, a failed batch before or after the call's
status) with a stand-in servicer context; and the worker's Generate, closed at a yield,
stops its engine request in that close."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc._cython.cygrpc import ExecuteBatchError

from protos import common_pb2, worker_pb2
from services.common import grpc_streams, server
from tests.fresh_process import run_probe
from tests.waiting import wait_for
from workers.engines.mock import MockEngine, MockEngineConfig
from workers.service import WorkerServicer

PROBE = r"""
import asyncio, json, logging
import grpc
from services.common import telemetry
from services.common.server import (MalformedRequestInterceptor, TracingInterceptor,
                                    event_loop_factory)

telemetry.setup_tracing("probe")
records = []

class Keep(logging.Handler):
    def emit(self, record):
        records.append([record.name, record.levelname, record.getMessage()])
        if "closing its response stream failed" in record.getMessage():
            state["broken"].set()

logging.getLogger().addHandler(Keep(level=logging.WARNING))
state = {}
BIG = 4 << 20  # past the client's flow-control window: the write waits on the client

async def endless(request, context):
    state["task"] = asyncio.current_task()
    try:
        while True:
            state["writing"].set()
            yield b"x" * BIG
    finally:
        state["closed_in_call_task"] = asyncio.current_task() is state["task"]
        state["closed"].set()

async def three(request, context):
    for i in range(3):
        yield bytes([i])
    if request == b"abort":
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "stop here")

async def bad_cleanup(request, context):
    try:
        while True:
            state["writing"].set()
            yield b"x" * BIG
    finally:
        raise RuntimeError("cleanup broke")

async def oversize(request, context):
    yield b"x" * (65 << 20)  # past the server's max_send_message_length

def same(b):
    return b

methods = {name: grpc.unary_stream_rpc_method_handler(fn, same, same)
           for name, fn in (("Endless", endless), ("Three", three),
                            ("BadCleanup", bad_cleanup), ("Oversize", oversize))}
methods["EndlessBidi"] = grpc.stream_stream_rpc_method_handler(endless, same, same)
handler = grpc.method_handlers_generic_handler("probe.P", methods)

async def cancel_mid_write(ch, method):
    state["writing"], state["closed"] = asyncio.Event(), asyncio.Event()
    if method.endswith("Bidi"):
        call = ch.stream_stream(method, request_serializer=same,
                                response_deserializer=same)(iter([b""]))
    else:
        call = ch.unary_stream(method, request_serializer=same,
                               response_deserializer=same)(b"")
    await asyncio.wait_for(state["writing"].wait(), 30)
    call.cancel()

async def main():
    opts = [("grpc.max_send_message_length", 64 << 20),
            ("grpc.max_receive_message_length", 64 << 20)]
    server = grpc.aio.server(interceptors=[TracingInterceptor(), MalformedRequestInterceptor()],
                             options=opts)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    out = {"lean": telemetry.lean()}
    state["broken"] = asyncio.Event()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
        await cancel_mid_write(ch, "/probe.P/Endless")
        await asyncio.wait_for(state["closed"].wait(), 30)
        out["closed_in_call_task"] = [state["closed_in_call_task"]]
        await cancel_mid_write(ch, "/probe.P/EndlessBidi")
        await asyncio.wait_for(state["closed"].wait(), 30)
        out["closed_in_call_task"].append(state["closed_in_call_task"])
        three = ch.unary_stream("/probe.P/Three", request_serializer=same,
                                response_deserializer=same)
        call = three(b"")
        out["three"] = [[m.hex() async for m in call], (await call.code()).name]
        call = three(b"abort")
        got = []
        try:
            async for m in call:
                got.append(m.hex())
        except grpc.aio.AioRpcError as err:
            got.append(err.details())
        out["aborted"] = [got, (await call.code()).name]
        await cancel_mid_write(ch, "/probe.P/BadCleanup")
        await asyncio.wait_for(state["broken"].wait(), 30)
        call = ch.unary_stream("/probe.P/Oversize", request_serializer=same,
                               response_deserializer=same)(b"")
        out["oversize"] = [(await call.code()).name, await call.details()]
        # the next call on the same server is answered after the broken cleanup
        out["after"] = [len([m async for m in three(b"")])]
    await server.stop(0)
    out["records"] = records
    print(json.dumps(out))

with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
    runner.run(main())
"""


@pytest.mark.parametrize("sampler", ["", "parentbased_always_on"])
@pytest.mark.parametrize("uvloop", ["1", "0"])
def test_a_stream_cancelled_mid_write_closes_in_its_own_task(uvloop: str,
                                                              sampler: str) -> None:
    got = run_probe(PROBE, KVMESH_UVLOOP=uvloop,
                    **({"OTEL_TRACES_SAMPLER": sampler} if sampler else {}))
    assert got["lean"] is (not sampler)
    assert got["closed_in_call_task"] == [True, True]  # unary-stream, stream-stream
    assert got["three"] == [["00", "01", "02"], "OK"]
    assert got["aborted"] == [["00", "01", "02", "stop here"], "FAILED_PRECONDITION"]
    assert got["after"] == [3]
    assert got["oversize"][0] == "RESOURCE_EXHAUSTED" and "larger than max" in \
        got["oversize"][1]
    # the only error: the broken cleanup, logged once naming its method (no "Failed to
    # detach context", no grpc error for the failed write of the oversized message)
    errors = [r for r in got["records"] if r[1] in ("ERROR", "CRITICAL")]
    assert errors == [["services.common.grpc_streams", "ERROR",
                       "/probe.P/BadCleanup: closing its response stream failed"]], \
        got["records"]


# -- writing()'s contract where grpc's timing cannot be chosen: a stand-in for grpc's
# servicer context (StandInContext) whose write the test fails or holds, and the test
# cancels the call's task where grpc would.

BATCH_FAILED = 'Failed "execute_batch": (<SendMessageOperation>,)'


class StandInContext:
    """grpc's servicer context as writing() uses it: ``write`` waits on ``gate`` (a
    future the test resolves, fails or leaves pending), counting its calls; ``done``."""

    def __init__(self) -> None:
        self.gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.writes = 0
        self.status_sent = False  # what done() answers: grpc's "status sent" flag

    def done(self) -> bool:
        return self.status_sent

    async def write(self, message: object) -> None:
        self.writes += 1
        await self.gate


class Chain:
    """Three layers as the interceptors make them: outer iterates middle, middle
    iterates inner (each registered with grpc_streams.opened), each noting the task its
    cleanup ran in; ``inner_cleanup`` is awaited by the inner one's cleanup."""

    def __init__(self) -> None:
        self.closed: list[tuple[str, asyncio.Task[Any] | None]] = []
        self.inner_cleanup: asyncio.Future[None] | None = None
        self.cleanup_started = asyncio.Event()

    async def inner(self, request: object, context: object) -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"m"
        finally:
            if self.inner_cleanup is not None:
                self.cleanup_started.set()
                await self.inner_cleanup
            self.closed.append(("inner", asyncio.current_task()))

    def layer(self, name: str, below: Any) -> Any:
        async def behavior(request: object, context: object) -> AsyncIterator[bytes]:
            try:
                async for item in grpc_streams.opened(below(request, context)):
                    yield item
            finally:
                self.closed.append((name, asyncio.current_task()))
        return behavior

    def handler(self) -> Any:
        return grpc_streams.writing(self.layer("outer", self.layer("middle", self.inner)),
                                    "/probe.P/Chain")


async def started(chain: Chain, ctx: StandInContext) -> asyncio.Task[None]:
    task = asyncio.create_task(chain.handler()(b"", ctx))
    await wait_for(lambda: ctx.writes == 1, 10, "the first write")
    return task


async def ended_cancelled(task: asyncio.Task[None]) -> None:
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)


async def test_a_cancel_mid_write_closes_the_chain_innermost_first_in_the_task() -> None:
    chain, ctx = Chain(), StandInContext()
    task = await started(chain, ctx)
    task.cancel()
    await ended_cancelled(task)
    assert chain.closed == [("inner", task), ("middle", task), ("outer", task)]


async def test_a_failed_write_waits_for_grpcs_cancel_before_closing(
        caplog: pytest.LogCaptureFixture) -> None:
    chain, ctx = Chain(), StandInContext()
    task = await started(chain, ctx)
    ctx.gate.set_exception(ExecuteBatchError(BATCH_FAILED))
    await wait_for(lambda: any("writing a response failed" in r.getMessage()
                               for r in caplog.records), 10, "the failed write's warning")
    assert chain.closed == [] and not task.done()  # waiting for grpc's cancel
    task.cancel()  # grpc's, once it sees the call's end
    await ended_cancelled(task)
    assert chain.closed == [("inner", task), ("middle", task), ("outer", task)]
    assert [r.levelname for r in caplog.records] == ["WARNING"]


async def test_no_cancel_after_a_failed_write_ends_the_call_as_cancelled(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grpc_streams, "CANCEL_WAIT_S", 0.01)
    chain, ctx = Chain(), StandInContext()
    task = await started(chain, ctx)
    ctx.gate.set_exception(ExecuteBatchError(BATCH_FAILED))
    await ended_cancelled(task)
    assert [n for n, _ in chain.closed] == ["inner", "middle", "outer"]
    assert any("did not cancel the call" in r.getMessage() for r in caplog.records)


async def test_a_batch_failed_after_the_status_was_sent_ends_at_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """An abort whose status found the client gone: grpc sends no cancel (its status
    counts as sent), so nothing is waited for."""
    chain, ctx = Chain(), StandInContext()
    task = await started(chain, ctx)
    ctx.status_sent = True
    ctx.gate.set_exception(ExecuteBatchError(BATCH_FAILED))
    await ended_cancelled(task)  # nobody cancelled it
    assert chain.closed == [("inner", task), ("middle", task), ("outer", task)]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_batch_grpc_could_not_start_propagates_unchanged() -> None:
    chain, ctx = Chain(), StandInContext()
    task = await started(chain, ctx)
    ctx.gate.set_exception(ExecuteBatchError("Failed grpc_call_start_batch: 8"))
    with pytest.raises(ExecuteBatchError, match="start_batch"):
        await asyncio.wait_for(task, 10)
    assert [n for n, _ in chain.closed] == ["inner", "middle", "outer"]


async def test_a_second_cancel_during_cleanup_still_closes_the_outer_layers() -> None:
    chain, ctx = Chain(), StandInContext()
    chain.inner_cleanup = asyncio.get_running_loop().create_future()
    task = await started(chain, ctx)
    task.cancel()
    await asyncio.wait_for(chain.cleanup_started.wait(), 10)
    task.cancel()  # cuts the inner cleanup short
    await ended_cancelled(task)
    assert chain.closed == [("middle", task), ("outer", task)]


async def test_the_workers_generate_closed_at_a_yield_stops_its_engine_request() -> None:
    """What writing() does to a worker's Generate whose client left while a response
    was being written: its close stops the engine request before the close returns (in
    the call's task), not later from the event loop's finalizer."""
    engine = MockEngine(MockEngineConfig(model_name="m", block_size=16, num_blocks=512,
                                         max_model_len=4096, timing="zero"))
    await engine.start()
    try:
        req = worker_pb2.GenerateRequest(
            request_id="r", token_ids=list(range(5, 40)),
            sampling=common_pb2.SamplingParams(max_tokens=1000, ignore_eos=True))
        answer = WorkerServicer(engine, "w").Generate(req, StandInContext())
        first = await anext(answer)
        assert first.token_ids and engine.load().num_running == 1
        await answer.aclose()  # as writing() closes it, suspended at its yield
        assert engine.load().num_running == 0 and not engine.load().num_waiting
    finally:
        await engine.shutdown()


async def test_a_registering_behavior_no_wrapper_took_is_unwrapped() -> None:
    """Where OpenTelemetry's interceptor does not wrap (instrumentation suppressed), the
    handler grpc gets is still an async-generator stream (written by writing()) or the
    coroutine that writes itself, never the plain Registering callable."""
    async def two(request: object, context: object) -> AsyncIterator[bytes]:
        yield b"a"
        yield b"b"

    async def writes_itself(request: object, context: Any) -> None:
        await context.write(b"c")

    handler = server._closing(grpc.unary_stream_rpc_method_handler(
        grpc_streams.Registering(two)), "/probe.P/Two")
    assert inspect.iscoroutinefunction(handler.unary_stream)
    ctx = StandInContext()
    ctx.gate.set_result(None)
    await asyncio.wait_for(handler.unary_stream(b"", ctx), 10)
    assert ctx.writes == 2
    handler = server._closing(grpc.stream_stream_rpc_method_handler(
        grpc_streams.Registering(writes_itself)), "/probe.P/Self")
    assert handler.stream_stream is writes_itself
