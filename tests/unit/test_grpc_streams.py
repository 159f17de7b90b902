"""A server-streaming call through kvmesh's interceptor chain
(:class:`services.common.server.TracingInterceptor`, :mod:`services.common.grpc_streams`)
whose client goes away while grpc writes a message: the servicer's generator is closed
in the call's own task, and OpenTelemetry's server span detaches its context without
the "Failed to detach context" error (the CI failure of test_migration's client
disconnect test, where the event loop's finalizer closed the generators in another
task). Also: a finished stream, an abort mid-stream, a cleanup that raises (logged,
the call still ends) and a message past the size limit (the client gets
RESOURCE_EXHAUSTED; no error logged, whichever of the failed write and the call's end
grpc sees first). Each case runs in a fresh process (the tracer provider is
process-global), on asyncio's loop and on uvloop, in lean and in full tracing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

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
        if record.name == "services.common.grpc_streams":
            state["logged"].set()

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

handler = grpc.method_handlers_generic_handler("probe.P", {
    name: grpc.unary_stream_rpc_method_handler(fn, same, same)
    for name, fn in (("Endless", endless), ("Three", three), ("BadCleanup", bad_cleanup),
                     ("Oversize", oversize))})

async def cancel_mid_write(ch, method):
    state["writing"], state["closed"] = asyncio.Event(), asyncio.Event()
    call = ch.unary_stream(method, request_serializer=same, response_deserializer=same)(b"")
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
    state["logged"] = asyncio.Event()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
        await cancel_mid_write(ch, "/probe.P/Endless")
        await asyncio.wait_for(state["closed"].wait(), 30)
        out["closed_in_call_task"] = state["closed_in_call_task"]
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
        await asyncio.wait_for(state["logged"].wait(), 30)
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


def probe(**env: str) -> dict[str, Any]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVMESH_"))}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env},
                         capture_output=True, text=True, timeout=120, check=True)
    got: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


@pytest.mark.parametrize("sampler", ["", "parentbased_always_on"])
@pytest.mark.parametrize("uvloop", ["1", "0"])
def test_a_stream_cancelled_mid_write_closes_in_its_own_task(uvloop: str,
                                                              sampler: str) -> None:
    got = probe(KVMESH_UVLOOP=uvloop, **({"OTEL_TRACES_SAMPLER": sampler} if sampler else {}))
    assert got["lean"] is (not sampler)
    assert got["closed_in_call_task"] is True
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
