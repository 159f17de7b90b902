"""bench.router_overhead's lean clients against loopback servers: answers, refusals and
lost connections surface; nothing waits forever."""

from __future__ import annotations

import asyncio
import math

import pytest

from bench.router_overhead.lean import LeanHttp, LeanHttpError, PlaneClient
from protos import worker_pb2
from services.common.frames import FramedProtocol
from tests.http_peer import read_post


async def _http_server(answers: list[bytes], piece: int | None = None) -> asyncio.Server:
    """Answers each request with the next of ``answers`` (b"" closes the connection),
    whole or (``piece``) in writes of that many bytes, each flushed on its own."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while answers:
                await read_post(reader)
                answer = answers.pop(0)
                if not answer:
                    break
                step = piece or len(answer)
                for i in range(0, len(answer), step):
                    writer.write(answer[i:i + step])
                    await writer.drain()
                    await asyncio.sleep(0)  # the next piece in another loop turn
        finally:
            writer.close()
    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def test_lean_http_answers_refusals_and_lost_connections() -> None:
    answers = [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
               b"HTTP/1.1 404 Not Found\r\nContent-Length: 4\r\n\r\nnope", b""]
    server = await _http_server(answers)
    port = server.sockets[0].getsockname()[1]
    http = LeanHttp("127.0.0.1", port)
    try:
        async with asyncio.timeout(30):
            assert await http.post("/x", {"a": 1}) == b"ok"
            with pytest.raises(LeanHttpError) as err:
                await http.post("/x", {})
            assert err.value.status == 404
            with pytest.raises(ConnectionError):  # closed before answering
                await http.post("/x", {})
    finally:
        http.close()
        server.close()
        await server.wait_closed()


async def test_lean_http_joins_a_chunked_answer_sent_in_pieces() -> None:
    """Dynamo's frontend answers chunked: the body is the chunks joined, whatever the
    packets they arrive in (chunked over a content-length, trailers skipped); the
    connection is reused after it."""
    chunked = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
               b"3\r\nabc\r\n10\r\n" + b"x" * 16 + b"\r\n0\r\n\r\n")
    trailers = (b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\nTransfer-Encoding: gzip,\tchunked"
                b"\r\n\r\n2\r\nhi\r\n0\r\nX-T: 1\r\n\r\n")  # chunked wins; trailers
    answers = [chunked, trailers, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
               b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nboom\r\n0\r\n\r\n"]
    server = await _http_server(answers, piece=5)
    http = LeanHttp("127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        async with asyncio.timeout(30):
            assert await http.post("/x", {}) == b"abc" + b"x" * 16
            assert await http.post("/x", {}) == b"hi"
            assert await http.post("/x", {}) == b"ok"  # the same connection, nothing left
            with pytest.raises(LeanHttpError) as err:
                await http.post("/x", {})
            assert err.value.status == 500 and "boom" in str(err.value)
    finally:
        http.close()
        server.close()
        await server.wait_closed()


async def test_plane_client_ends_ok_error_and_loss() -> None:
    protos: list[FramedProtocol] = []

    async def answer(proto: FramedProtocol) -> None:
        await proto.ready
        while (data := await proto.read()) is not None:
            for frame in worker_pb2.GenerateFrames.FromString(data).frames:
                if frame.request.request_id == "lose":
                    proto.close()
                    return
                code = 0 if frame.request.request_id == "ok" else 3
                proto.write(worker_pb2.GenerateReplies(replies=[
                    worker_pb2.GenerateReply(call_id=frame.call_id,
                                             response=worker_pb2.GenerateResponse()),
                    worker_pb2.GenerateReply(call_id=frame.call_id, end=worker_pb2.CallStatus(
                        code=code, details="bad"))]).SerializeToString())

    tasks: list[asyncio.Task[None]] = []

    def made(proto: FramedProtocol) -> None:
        protos.append(proto)
        tasks.append(asyncio.ensure_future(answer(proto)))

    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: FramedProtocol(expect_preamble=True, on_connect=made), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = PlaneClient(f"127.0.0.1:{port}")
    try:
        async with asyncio.timeout(30):
            await client.connect()
            await client.generate(worker_pb2.GenerateRequest(request_id="ok"))
            with pytest.raises(RuntimeError, match="status 3: bad"):
                await client.generate(worker_pb2.GenerateRequest(request_id="err"))
            with pytest.raises(ConnectionError):
                await client.generate(worker_pb2.GenerateRequest(request_id="lose"))
            with pytest.raises(ConnectionError, match="gone"):  # later calls: at once
                await client.generate(worker_pb2.GenerateRequest(request_id="ok"))
    finally:
        await client.close()
        server.close()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_mixed_poisson_streams_share_one_run() -> None:
    from bench.router_overhead.run import _poisson_mixed

    seen: dict[str, list[int]] = {"a": [], "b": []}

    async def a(i: int) -> None:
        seen["a"].append(i)

    async def b(i: int) -> None:
        seen["b"].append(i)
        if i % 2:
            raise RuntimeError("counted, not raised")

    got_a, got_b = await _poisson_mixed(400, 0.25, [a, b], seed=7)
    assert got_a["sent"] == len(seen["a"]) and got_b["sent"] == len(seen["b"])
    assert got_a["ok"] == got_a["sent"] and got_a["errors"] == 0
    assert got_b["errors"] == sum(i % 2 for i in seen["b"])
    assert got_b["ok"] + got_b["errors"] == got_b["sent"]
    # one numbering for both: the arrivals were interleaved, none given to both
    assert sorted(seen["a"] + seen["b"]) == list(range(got_a["sent"] + got_b["sent"]))
    assert seen["a"] and seen["b"]


async def test_paced_pairs_run_one_at_a_time_in_rounds() -> None:
    from bench.router_overhead.run import _paced

    running = 0
    order: list[tuple[str, int]] = []

    async def call(name: str, i: int, fail: bool = False) -> None:
        nonlocal running
        running += 1
        assert running == 1  # never two at once
        order.append((name, i))
        await asyncio.sleep(0)
        running -= 1
        if fail:
            raise RuntimeError("counted, not raised")

    async def anchor(i: int) -> None:
        await call("anchor", i)

    async def mesh(i: int) -> None:
        await call("mesh", i, fail=i == 2)

    got_anchor, got_mesh = await _paced([anchor, mesh], 5, 0.0, seed=3)
    assert (got_anchor["ok"], got_anchor["errors"]) == (5, 0)
    assert (got_mesh["ok"], got_mesh["errors"]) == (4, 1)
    for i in range(5):  # each round holds both, once
        assert sorted(order[2 * i:2 * i + 2]) == [("anchor", i), ("mesh", i)]
    assert got_mesh["paired_diff_p50_ms"] == got_anchor["paired_diff_p50_ms"]
    assert not math.isnan(got_mesh["paired_diff_p50_ms"])  # 4 rounds answered in full


async def test_paced_rounds_make_every_call_once_per_round_and_keep_failures() -> None:
    from bench.router_overhead.run import Timed, paced_rounds

    order: list[str] = []

    def make(name: str, fail_at: int = -1) -> Timed:
        async def call(i: int) -> tuple[float, float | None]:
            order.append(name)
            if i == fail_at:
                raise RuntimeError("down")
            return 0.001 * (i + 1), None
        return call

    out = await paced_rounds({"a": make("a"), "b": make("b", fail_at=2)}, 4, 0.0, seed=3)
    assert sorted(order) == ["a"] * 4 + ["b"] * 4
    assert [r[0] if r else None for r in out["a"]] == [0, 1, 2, 3]
    assert out["b"][2] is None and out["b"][3] == (3, 0.004, None)
    pairs = [tuple(order[k:k + 2]) for k in range(0, 8, 2)]
    assert {("a", "b"), ("b", "a")} >= set(pairs)  # each round holds both, in some order
