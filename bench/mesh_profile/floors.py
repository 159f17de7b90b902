"""The floor of the Python serving stack kvmesh is built on, on this machine: the CPU per
request of a uvicorn + FastAPI endpoint that does no work (the frontend's HTTP layer
alone), of one grpc.aio unary-stream call of three messages (one frontend → worker
hop), and of the same three messages per request multiplexed on one long-lived
bidirectional stream (what a multiplexed worker transport, as Dynamo's TCP request plane,
would pay), under :mod:`bench.mesh_profile`'s closed-loop client.

``python -m bench.mesh_profile.floors [--requests 2000] [--concurrency 8] [--words 240]
[--rounds 2] [--out bench/results] [--name mesh_floors]``

Contracts:

- Each server runs in a child process of its own (``--serve http|grpc PORT``), on
  uvloop, on a free loopback port, stopped by PID at the end:
  - ``http``: uvicorn with httptools (as the frontend runs it), a FastAPI app whose
    ``POST /v1/completions`` reads and parses the JSON body and answers a fixed
    completion (16 tokens of text, usage) as a JSONResponse;
  - ``grpc``: a ``Worker`` servicer whose ``Generate`` answers three
    ``GenerateResponse`` messages (one token, fourteen, one with the finish and usage),
    as a non-streamed request's worker answers;
  - ``grpc-mux``: one stream-stream method (generic handler, bytes in and out) whose
    frames are an 8-byte request number and a serialized ``GenerateRequest``; for each
    frame a task parses it and writes the same three ``GenerateResponse`` messages, each
    behind the request number (one writer at a time: a stream takes one write at once).
  - ``tcp-mux``: the same frames and answers as ``grpc-mux`` on one plain TCP connection,
    in :mod:`services.common.frames`' length-prefixed messages (the carrier of the TCP
    request plane, ``--worker-transport tcp``).
- Load: ``--concurrency`` clients in this process; HTTP: the same requests as
  :func:`bench.mesh_profile.run.closed_loop` (a ``--words`` prompt, 16 tokens); gRPC: a
  ``GenerateRequest`` of 300 token ids per call, each client on its own channel;
  gRPC-mux: every client's requests on one channel's one stream, a reader task handing
  each answer to its request's queue; TCP-mux: the same on one connection. ``--requests``
  per round after 200 of warm-up, ``--rounds`` rounds of each.
- Reports per server: the server process's CPU per request (user + system, psutil), this
  process's (the client's), req/s, p50; the means over rounds. Writes
  ``<out>/<name>.json``. The numbers are a floor for kvmesh's frontend and workers: a
  request through the mesh pays at least one HTTP request and one such gRPC call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import struct
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from bench.mesh_profile.run import _cpu, closed_loop
from protos import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.frames import PREAMBLE, FramedProtocol
from services.common.procs import free_port, port_open, spawn, wait_until
from services.common.server import event_loop_factory

WARMUP = 200
ANSWER = {"id": "cmpl-floor", "object": "text_completion", "created": 0, "model": "tiny",
          "choices": [{"index": 0, "text": "".join(f" w{i}" for i in range(16)),
                       "logprobs": None, "finish_reason": "length"}],
          "usage": {"prompt_tokens": 300, "completion_tokens": 16, "total_tokens": 316}}


def http_app(answer: dict[str, Any]) -> FastAPI:
    """The ``http`` floor's app, answering ``answer`` (its model: the request's)."""
    app = FastAPI(docs_url=None, redoc_url=None)

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body = json.loads(await request.body())
        return JSONResponse({**answer, "model": body.get("model", "tiny")})

    return app


class _Worker(worker_pb2_grpc.WorkerServicer):
    @staticmethod
    def answers(request: worker_pb2.GenerateRequest) -> list[worker_pb2.GenerateResponse]:
        """The three messages of a non-streamed 16-token answer."""
        return [
            worker_pb2.GenerateResponse(token_ids=[1], text=" w1", worker_id="w"),
            worker_pb2.GenerateResponse(token_ids=list(range(2, 16)), worker_id="w",
                                        text="".join(f" w{i}" for i in range(2, 16))),
            worker_pb2.GenerateResponse(
                token_ids=[16], text=" w16", worker_id="w",
                finish_reason=common_pb2.FINISH_REASON_LENGTH,
                usage=common_pb2.Usage(prompt_tokens=len(request.token_ids),
                                       completion_tokens=16))]

    async def Generate(  # noqa: N802 - gRPC method name
            self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        for resp in self.answers(request):
            yield resp


MUX_METHOD = "/kvmesh.bench.Mux/Generate"
_ID = struct.Struct(">Q")


def _identity(b: bytes) -> bytes:
    return b


async def _mux_generate(requests: AsyncIterator[bytes],
                        context: grpc.aio.ServicerContext) -> None:
    """``grpc-mux``'s handler (module docstring)."""
    lock = asyncio.Lock()
    tasks: set[asyncio.Task[None]] = set()

    async def answer(frame: bytes) -> None:
        rid = frame[:_ID.size]
        request = worker_pb2.GenerateRequest.FromString(frame[_ID.size:])
        for resp in _Worker.answers(request):
            async with lock:
                await context.write(rid + resp.SerializeToString())

    async for frame in requests:
        task = asyncio.ensure_future(answer(frame))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


async def _tcp_mux_serve(port: int) -> None:
    """``tcp-mux``'s server (module docstring)."""
    tasks: set[asyncio.Task[None]] = set()

    async def answer(proto: FramedProtocol, frame: bytes) -> None:
        rid = frame[:_ID.size]
        request = worker_pb2.GenerateRequest.FromString(frame[_ID.size:])
        for resp in _Worker.answers(request):
            proto.write(rid + resp.SerializeToString())
            await proto.drain()

    async def serve(proto: FramedProtocol) -> None:
        await proto.ready
        while (frame := await proto.read()) is not None:
            task = asyncio.ensure_future(answer(proto, frame))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    def accept(proto: FramedProtocol) -> None:
        task = asyncio.ensure_future(serve(proto))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    server = await asyncio.get_running_loop().create_server(
        lambda: FramedProtocol(expect_preamble=True, on_connect=accept), "127.0.0.1", port)
    await server.serve_forever()


async def _serve(kind: str, port: int) -> None:
    if kind == "tcp-mux":
        await _tcp_mux_serve(port)
        return
    if kind == "http":
        import uvicorn

        config = uvicorn.Config(http_app(ANSWER), host="127.0.0.1", port=port, loop="none",
                                http="httptools", log_level="warning", access_log=False)
        await uvicorn.Server(config).serve()
        return
    server = grpc.aio.server()
    if kind == "grpc-mux":
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            MUX_METHOD.split("/")[1], {"Generate": grpc.stream_stream_rpc_method_handler(
                _mux_generate, _identity, _identity)})])
    else:
        worker_pb2_grpc.add_WorkerServicer_to_server(_Worker(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _grpc_load(address: str, n: int, concurrency: int) -> dict[str, Any]:
    lat: list[float] = []
    req = worker_pb2.GenerateRequest(request_id="r", token_ids=list(range(300)),
                                     sampling=common_pb2.SamplingParams(max_tokens=16))
    next_i = 0

    async def client() -> None:
        nonlocal next_i
        async with grpc.aio.insecure_channel(address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            while next_i < n:
                next_i += 1
                t0 = time.perf_counter()
                got = [m async for m in stub.Generate(req)]
                if len(got) != 3:
                    raise RuntimeError(f"expected 3 messages, got {len(got)}")
                lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"requests": n, "ok": len(lat), "errors": n - len(lat), "req_per_s": len(lat) / wall,
            "p50_ms": float(np.percentile(lat, 50) * 1e3)}


async def _mux_clients(send: Callable[[bytes], Awaitable[None]], frames: AsyncIterator[bytes],
                       n: int, concurrency: int) -> dict[str, Any]:
    """``concurrency`` clients sending ``n`` numbered frames (:func:`send`) on one
    multiplexed carrier, a reader handing each answer in ``frames`` to its request;
    returns when every request had its three answers (``frames`` is then left to end)."""
    lat: list[float] = []
    req = worker_pb2.GenerateRequest(request_id="r", token_ids=list(range(300)),
                                     sampling=common_pb2.SamplingParams(max_tokens=16))
    body = req.SerializeToString()
    next_i = 0
    queues: dict[int, asyncio.Queue[worker_pb2.GenerateResponse]] = {}

    async def read() -> None:
        async for frame in frames:
            (rid,) = _ID.unpack_from(frame)
            queues[rid].put_nowait(worker_pb2.GenerateResponse.FromString(frame[_ID.size:]))

    async def client() -> None:
        nonlocal next_i
        while next_i < n:
            rid = next_i = next_i + 1
            q = queues[rid] = asyncio.Queue()
            t0 = time.perf_counter()
            await send(_ID.pack(rid) + body)
            got = [await q.get() for _ in range(3)]
            if got[-1].finish_reason != common_pb2.FINISH_REASON_LENGTH:
                raise RuntimeError(f"request {rid}: no finish in {got}")
            del queues[rid]
            lat.append(time.perf_counter() - t0)

    reader = asyncio.ensure_future(read())
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(client() for _ in range(concurrency)))
    finally:
        wall = time.perf_counter() - t0
        if not reader.done():
            reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
    return {"requests": n, "ok": len(lat), "errors": n - len(lat), "req_per_s": len(lat) / wall,
            "p50_ms": float(np.percentile(lat, 50) * 1e3)}


async def _mux_load(address: str, n: int, concurrency: int) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(address) as ch:
        call = ch.stream_stream(MUX_METHOD, request_serializer=_identity,
                                response_deserializer=_identity)()
        lock = asyncio.Lock()

        async def send(frame: bytes) -> None:
            async with lock:  # a stream takes one write at once
                await call.write(frame)

        try:
            return await _mux_clients(send, call.__aiter__(), n, concurrency)
        finally:
            await call.done_writing()


async def _tcp_mux_load(address: str, n: int, concurrency: int) -> dict[str, Any]:
    host, _, port = address.rpartition(":")
    _, proto = await asyncio.get_running_loop().create_connection(FramedProtocol, host,
                                                                  int(port))
    proto.write_raw(PREAMBLE)

    async def send(frame: bytes) -> None:
        proto.write(frame)

    async def frames() -> AsyncIterator[bytes]:
        while (frame := await proto.read()) is not None:
            yield frame

    try:
        return await _mux_clients(send, frames(), n, concurrency)
    finally:
        proto.close()


def measure(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """One round against a fresh ``kind`` server (module docstring)."""
    port = free_port()
    logs = Path(tempfile.mkdtemp(prefix="kvmesh-floors-"))
    child = spawn(f"floor-{kind}", [sys.executable, "-m", "bench.mesh_profile.floors",
                                    "--serve", kind, str(port)], logs)
    try:
        wait_until(lambda: port_open("127.0.0.1", port), child, 60, f"{kind} to listen")

        def go(n: int, offset: int) -> dict[str, Any]:
            runner = asyncio.Runner(loop_factory=event_loop_factory())
            with runner:
                if kind == "http":
                    return runner.run(closed_loop(f"http://127.0.0.1:{port}", n,
                                                  args.concurrency, args.words, 16, False,
                                                  offset))
                load = {"grpc-mux": _mux_load, "tcp-mux": _tcp_mux_load}.get(kind, _grpc_load)
                return runner.run(load(f"127.0.0.1:{port}", n, args.concurrency))

        warm = go(WARMUP, 10_000_000)
        if warm["ok"] != WARMUP:
            raise RuntimeError(f"{kind} warm-up failed: {warm}")
        c0, p0 = _cpu(child.pid), time.process_time()
        load = go(args.requests, 0)
        server_us = (_cpu(child.pid) - c0) / args.requests * 1e6
        client_us = (time.process_time() - p0) / args.requests * 1e6
    finally:
        child.stop()
    print(f"[{kind}] {load['req_per_s']:.0f} req/s p50 {load['p50_ms']:.2f} ms; CPU µs/req "
          f"server={server_us:.0f} client={client_us:.0f}", flush=True)
    return {"load": load, "server_cpu_us_per_req": server_us,
            "client_cpu_us_per_req": client_us}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.mesh_profile.floors",
                                description=__doc__.splitlines()[0])
    p.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--words", type=int, default=240)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--name", default="mesh_floors")
    args = p.parse_args(argv)
    if args.serve:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(_serve(args.serve[0], int(args.serve[1])))
        return 0
    runs: dict[str, list[dict[str, Any]]] = {"http": [], "grpc": [], "grpc-mux": [],
                                             "tcp-mux": []}
    for _ in range(args.rounds):
        for kind in runs:
            runs[kind].append(measure(kind, args))
    means = {kind: {key: float(np.mean([r[key] for r in rs]))
                    for key in ("server_cpu_us_per_req", "client_cpu_us_per_req")}
             | {"req_per_s": float(np.mean([r["load"]["req_per_s"] for r in rs]))}
             for kind, rs in runs.items()}
    report = {"benchmark": "mesh_floors", "requests": args.requests,
              "concurrency": args.concurrency, "words": args.words, "rounds": args.rounds,
              "cpus": os.cpu_count(), "runs": runs, "means": means}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps(report, indent=1))
    print(json.dumps(means, indent=1))
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
