"""bench.mesh_profile.proxy_floor (the floor of a frontend hop) against a loopback worker
plane: answers, the worker's errors and a lost worker surface as statuses; nothing
waits forever."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.mesh_profile import proxy_floor
from bench.router_overhead.lean import LeanHttp, LeanHttpError
from protos import common_pb2, worker_pb2
from services.common.frames import FramedProtocol


async def _plane() -> tuple[asyncio.Server, list[asyncio.Task[None]]]:
    """A worker plane: prompt [1] answers "a", "b" and a finish (length), [2] ends with
    status 3, [3] closes the connection."""
    tasks: list[asyncio.Task[None]] = []

    async def answer(proto: FramedProtocol) -> None:
        await proto.ready
        while (data := await proto.read()) is not None:
            for frame in worker_pb2.GenerateFrames.FromString(data).frames:
                kind = list(frame.request.token_ids)
                if kind == [3]:
                    proto.close()
                    return
                cid = frame.call_id
                out = [worker_pb2.GenerateReply(call_id=cid, end=worker_pb2.CallStatus(
                    code=3, details="bad prompt"))]
                if kind == [1]:
                    usage = common_pb2.Usage(prompt_tokens=1, completion_tokens=2)
                    out = [worker_pb2.GenerateReply(call_id=cid, response=worker_pb2.
                                                    GenerateResponse(text="a")),
                           worker_pb2.GenerateReply(call_id=cid, response=worker_pb2.
                                                    GenerateResponse(
                               text="b", finish_reason=common_pb2.FINISH_REASON_LENGTH,
                               usage=usage)),
                           worker_pb2.GenerateReply(call_id=cid,
                                                    end=worker_pb2.CallStatus(code=0))]
                proto.write(worker_pb2.GenerateReplies(replies=out).SerializeToString())

    def made(proto: FramedProtocol) -> None:
        tasks.append(asyncio.ensure_future(answer(proto)))

    server = await asyncio.get_running_loop().create_server(
        lambda: FramedProtocol(expect_preamble=True, on_connect=made), "127.0.0.1", 0)
    return server, tasks


@pytest.mark.parametrize("in_tasks", [False, True])
async def test_answers_errors_and_a_lost_worker(in_tasks: bool) -> None:
    plane_server, tasks = await _plane()
    port = plane_server.sockets[0].getsockname()[1]
    server, plane = await proxy_floor.serve(0, f"127.0.0.1:{port}", tasks=in_tasks)
    http = LeanHttp("127.0.0.1", server.sockets[0].getsockname()[1])
    body = {"model": "m", "max_tokens": 2, "temperature": 0}
    try:
        async with asyncio.timeout(30):
            answer = json.loads(await http.post("/v1/completions", {**body, "prompt": [1]}))
            assert answer["choices"][0]["text"] == "ab"
            assert answer["choices"][0]["finish_reason"] == "length"
            assert answer["usage"] == {"prompt_tokens": 1, "completion_tokens": 2,
                                       "total_tokens": 3}
            with pytest.raises(LeanHttpError, match="HTTP 502.*status 3: bad prompt"):
                await http.post("/v1/completions", {**body, "prompt": [2]})
            with pytest.raises(LeanHttpError, match="HTTP 400.*not a floor request"):
                await http.post("/v1/completions", {"prompt": [1]})
            with pytest.raises(LeanHttpError, match="HTTP 502.*connection is gone"):
                await http.post("/v1/completions", {**body, "prompt": [3]})
            with pytest.raises(LeanHttpError, match="HTTP 502.*connection is gone"):
                await http.post("/v1/completions", {**body, "prompt": [1]})  # at once
    finally:
        http.close()
        server.close()
        plane_server.close()
        assert plane.proto is not None
        plane.proto.close()  # a failure before [3] leaves it open
        if plane.reader is not None:
            await asyncio.gather(plane.reader, return_exceptions=True)
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_body_that_is_not_json_is_a_400() -> None:
    plane_server, tasks = await _plane()
    port = plane_server.sockets[0].getsockname()[1]
    server, plane = await proxy_floor.serve(0, f"127.0.0.1:{port}")
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        async with asyncio.timeout(30):
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                         b"content-length: 5\r\n\r\n{nope")
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400 Bad Request")
            length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
            assert b"not JSON" in await reader.readexactly(length)
    finally:
        writer.close()
        server.close()
        plane_server.close()
        assert plane.proto is not None
        plane.proto.close()
        if plane.reader is not None:
            await asyncio.gather(plane.reader, return_exceptions=True)
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_call_on_a_connection_lost_unseen_is_a_502() -> None:
    """The worker's connection closed, its reader not told yet: the call is answered
    502 at once, not left waiting (with a task per request, its task is woken)."""
    plane_server, tasks = await _plane()
    port = plane_server.sockets[0].getsockname()[1]
    server, plane = await proxy_floor.serve(0, f"127.0.0.1:{port}", tasks=True)
    assert plane.proto is not None and plane.proto.transport is not None
    answers: list[tuple[int, object]] = []

    class Sink:
        def answer(self, status: int, obj: object) -> None:
            answers.append((status, obj))
    try:
        plane.proto.transport.close()
        plane.call(Sink(), {"model": "m", "prompt": [1], "max_tokens": 1})
        assert [a[0] for a in answers] == [502] and not plane.calls
    finally:
        server.close()
        plane_server.close()
        if plane.reader is not None:
            await asyncio.gather(plane.reader, return_exceptions=True)
        await asyncio.gather(*tasks, return_exceptions=True)
