"""The frontend protocol's direct POSTs (services.frontend.http_server, ``direct``), through
a real uvicorn server on a loopback port: which requests the protocol serves itself and
which stay uvicorn's, the refusals at the end of the headers and during the body (the
connection kept usable), a late body, a client gone mid-answer and mid-stream, failures,
pipelining, the concurrency limit, shutdown, and the access log line."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from services.frontend.direct_posts import DirectCycle, DisconnectWatch
from tests.http_peer import serving

PATH = b"/v1/x"


class Direct:
    """A DirectPost recording what it is given; bodies name what it does."""

    def __init__(self, body_timeout_s: float = 30.0) -> None:
        self.max_body_bytes = 64
        self.body_timeout_s = body_timeout_s
        self.bodies: list[bytes] = []
        self.arrived = asyncio.Event()
        self.gate = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.stream_closed = asyncio.Event()
        self.watches: list[DisconnectWatch] = []
        self.admitted = asyncio.Event()  # a request's headers came

    def admit(self, headers: list[tuple[bytes, bytes]]) -> tuple[Any, Response | None]:
        self.admitted.set()
        key = dict(headers).get(b"x-key")
        if key == b"bad":
            return None, JSONResponse({"refused": "key"}, 401)
        return key, None

    async def _endless(self) -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"e"
                await asyncio.sleep(0)  # a turn of the loop between chunks
        finally:
            self.stream_closed.set()

    async def _parts(self, fail: bool) -> AsyncIterator[bytes | str]:
        try:
            yield b"a"
            yield ""  # nothing to write: skipped
            yield "b"
            if fail:
                raise RuntimeError("the stream broke")
            await self.gate.wait()
            yield b"cd"
        finally:
            self.stream_closed.set()

    async def answer(self, admitted: Any, body: bytes, watch: DisconnectWatch) -> Response:
        self.bodies.append(body)
        self.watches.append(watch)
        self.arrived.set()
        if body == b"boom":
            raise RuntimeError("a bug")
        if body == b"endless":
            return StreamingResponse(self._endless(), media_type="text/event-stream")
        if body in (b"stream", b"stream-fails"):
            return StreamingResponse(self._parts(body == b"stream-fails"),
                                     media_type="text/event-stream")
        if body == b"wait":
            watch.callback = self.cancelled.set
            await self.gate.wait()
            watch.callback = None
        return JSONResponse({"direct": True, "key": admitted and admitted.decode(),
                             "n": len(body)})

    def refusal(self, status: int) -> Response:
        return JSONResponse({"refused": status}, status)


async def _asgi(request: Request) -> Response:
    await request.body()
    return JSONResponse({"asgi": True})


APP = Starlette(routes=[Route("/v1/x", _asgi, methods=["GET", "POST"])])


async def _answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One response: its head and its body (content-length or chunked, undecoded)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    lines = head.lower().split(b"\r\n")
    length = next((int(x.split(b":")[1]) for x in lines if x.startswith(b"content-length:")),
                  None)
    if length is not None:
        return head, await asyncio.wait_for(reader.readexactly(length), 30)
    assert b"transfer-encoding: chunked" in lines
    return head, await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 30)


def _post(body: bytes, extra: bytes = b"", target: bytes = PATH) -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n%s"
            % (target, extra, len(body), body))


async def test_a_direct_post_is_served_by_its_route_on_a_kept_alive_connection() -> None:
    route = Direct()
    async with serving(APP, 5.0, direct={PATH: route}) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(_post(b"one", b"X-Key: k1\r\n"))
            head, body = await _answer(reader)
            assert head.startswith(b"HTTP/1.1 200 OK\r\n")
            assert b"\r\ndate: " in head and b"\r\nserver: uvicorn\r\n" in head
            assert b"content-type: application/json\r\n" in head
            assert json.loads(body) == {"direct": True, "key": "k1", "n": 3}
            writer.write(b"POST /v1/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                         b"\r\n2\r\nab\r\n3\r\ncde\r\n0\r\n\r\n")
            _, body = await _answer(reader)
            assert json.loads(body) == {"direct": True, "key": None, "n": 5}
        finally:
            writer.close()
    assert route.bodies == [b"one", b"abcde"]


@pytest.mark.parametrize("request_bytes", [
    _post(b"q", target=PATH + b"?a=1"),
    b"GET /v1/x HTTP/1.1\r\nHost: x\r\n\r\n",
    _post(b"c", b"Connection: close\r\n"),
    b"POST /v1/x HTTP/1.0\r\nHost: x\r\nContent-Length: 1\r\n\r\nv",
], ids=["query", "get", "close", "http10"])
async def test_other_requests_stay_uvicorns(request_bytes: bytes) -> None:
    route = Direct()
    async with serving(APP, 5.0, direct={PATH: route}) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(request_bytes)
            head, body = await _answer(reader)
        finally:
            writer.close()
    assert head.startswith(b"HTTP/1.1 200") and json.loads(body) == {"asgi": True}
    assert route.bodies == []


async def test_expect_continue_stays_uvicorns() -> None:
    async with serving(APP, 5.0, direct={PATH: Direct()}) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"POST /v1/x HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                         b"Content-Length: 2\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            assert head.startswith(b"HTTP/1.1 100 Continue")
            writer.write(b"ok")
            _, body = await _answer(reader)
        finally:
            writer.close()
    assert json.loads(body) == {"asgi": True}


async def test_refusals_come_at_the_headers_and_the_connection_stays_usable() -> None:
    route = Direct()
    async with serving(APP, 5.0, direct={PATH: route}) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            # a refused key: answered before any of the body is sent
            writer.write(b"POST /v1/x HTTP/1.1\r\nHost: x\r\nX-Key: bad\r\n"
                         b"Content-Length: 4\r\n\r\n")
            head, body = await _answer(reader)
            assert head.startswith(b"HTTP/1.1 401") and json.loads(body) == {"refused": "key"}
            writer.write(b"body")  # read and dropped
            # a declared length over the limit: 413 at once; its body, once sent, dropped
            writer.write(b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            head, body = await _answer(reader)
            assert head.startswith(b"HTTP/1.1 413") and json.loads(body) == {"refused": 413}
            writer.write(b"z" * 100)
            # a chunked body passing the limit: 413 as soon as it does
            writer.write(b"POST /v1/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                         b"\r\n40\r\n" + b"y" * 64 + b"\r\n1\r\ny\r\n")  # 65 bytes
            head, _ = await _answer(reader)
            assert head.startswith(b"HTTP/1.1 413")
            writer.write(b"0\r\n\r\n")
            writer.write(_post(b"after"))
            head, body = await _answer(reader)
            assert json.loads(body) == {"direct": True, "key": None, "n": 5}
        finally:
            writer.close()
    assert route.bodies == [b"after"]


async def test_a_body_that_stops_coming_is_answered_408() -> None:
    route = Direct(body_timeout_s=0.2)
    async with serving(APP, 5.0, direct={PATH: route}) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
            head, body = await _answer(reader)  # the timer answers; nothing else is sent
        finally:
            writer.close()
    assert head.startswith(b"HTTP/1.1 408") and json.loads(body) == {"refused": 408}
    assert route.bodies == []


async def test_a_client_gone_mid_answer_fires_the_watch_and_nothing_is_written() -> None:
    route = Direct()
    async with serving(APP, 5.0, direct={PATH: route}) as (port, _):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post(b"wait"))
        await asyncio.wait_for(route.arrived.wait(), 30)
        writer.close()
        await asyncio.wait_for(route.cancelled.wait(), 30)
        assert route.watches[0].gone
        route.gate.set()  # the answer completes for nobody


async def test_a_stream_is_chunked_and_ends_when_its_client_goes() -> None:
    route = Direct()
    async with serving(APP, 5.0, direct={PATH: route}) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post(b"stream"))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"transfer-encoding: chunked\r\n" in head
        assert b"content-type: text/event-stream; charset=utf-8\r\n" in head
        assert await asyncio.wait_for(reader.readexactly(12), 30) == b"1\r\na\r\n1\r\nb\r\n"
        writer.close()
        await asyncio.wait_for(route.stream_closed.wait(), 30)
        assert route.watches[0].gone and route.watches[0].callback is None


async def test_a_whole_stream_ends_with_its_last_chunk_and_keeps_the_connection() -> None:
    route = Direct()
    route.gate.set()
    async with serving(APP, 5.0, direct={PATH: route}) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(_post(b"stream"))
            _, body = await _answer(reader)
            assert body == b"1\r\na\r\n1\r\nb\r\n2\r\ncd\r\n0\r\n\r\n"
            writer.write(_post(b"next"))
            _, body = await _answer(reader)
            assert json.loads(body)["n"] == 4
        finally:
            writer.close()
    assert route.stream_closed.is_set()


async def test_failures_are_uvicorns_500_or_a_closed_connection(
        caplog: pytest.LogCaptureFixture) -> None:
    route = Direct()
    async with serving(APP, 5.0, direct={PATH: route}) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post(b"boom"))
        got = await asyncio.wait_for(reader.read(), 30)  # closed after the answer
        writer.close()
        assert got.startswith(b"HTTP/1.1 500 Internal Server Error\r\n")
        assert b"connection: close\r\n" in got and got.endswith(b"\r\n\r\nInternal Server Error")
        # a stream that fails once started: what was sent, then the connection closes
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post(b"stream-fails"))
        got = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        assert got.endswith(b"\r\n\r\n1\r\na\r\n1\r\nb\r\n")  # no last chunk
    assert "a direct POST to b'/v1/x' failed" in caplog.text
    assert "stream to b'/v1/x' failed" in caplog.text


async def test_over_the_concurrency_limit_uvicorn_answers() -> None:
    route = Direct()
    async with serving(APP, 5.0, direct={PATH: route}, max_connections=1) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post(b"x"))
        got = await asyncio.wait_for(reader.read(), 30)
        writer.close()
    assert got.startswith(b"HTTP/1.1 503") and route.bodies == []


async def test_a_server_shutting_down_closes_after_the_answer() -> None:
    route = Direct()
    async with serving(APP, 5.0, direct={PATH: route}) as (port, server):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post(b"wait"))
        await asyncio.wait_for(route.arrived.wait(), 30)
        (conn,) = server.server_state.connections
        assert type(conn.cycle) is DirectCycle  # type: ignore[union-attr]
        conn.shutdown()  # what uvicorn's shutdown does to each connection
        route.gate.set()
        got = await asyncio.wait_for(reader.read(), 30)
        writer.close()
    assert got.startswith(b"HTTP/1.1 200") and b"connection: close\r\n" in got


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_the_access_log_line_is_uvicorns() -> None:
    """The same record as uvicorn's (its access formatter unpacks the five arguments)."""
    access, seen = logging.getLogger("uvicorn.access"), _Records()
    level = access.level
    async with serving(APP, 5.0, direct={PATH: Direct()}) as (port, _):
        access.setLevel(logging.INFO)  # the config sets warning
        access.addHandler(seen)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_post(b"x") + _post(b"y", target=PATH + b"?q"))
            await _answer(reader)
            await _answer(reader)
            writer.close()
        finally:
            access.removeHandler(seen)
            access.setLevel(level)
    direct, asgi = seen.records
    assert direct.msg == asgi.msg
    assert isinstance(direct.args, tuple) and isinstance(asgi.args, tuple)
    assert direct.args[1:] == ("POST", "/v1/x", "1.1", 200)
    assert asgi.args[1:] == ("POST", "/v1/x?q", "1.1", 200)
    assert direct.args[0] == asgi.args[0]  # the same client address, formatted alike


async def test_a_header_uvicorn_would_refuse_closes_the_connection_unanswered() -> None:
    """As uvicorn: the response counts as started, so nothing is sent and it closes."""
    class Injecting(Direct):
        async def answer(self, admitted: Any, body: bytes,
                         watch: DisconnectWatch) -> Response:
            return Response(b"x", headers={"x-bad": "a\r\nset-cookie: evil"})

    for direct in (False, True):
        app = Starlette(routes=[Route("/v1/x", _via(Injecting()), methods=["POST"])])
        async with serving(app, 5.0, direct={PATH: Injecting()} if direct else None) as (
                port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_post(b"x"))
            got = await asyncio.wait_for(reader.read(), 30)
            writer.close()
        assert got == b"", direct


def _via(route: Direct) -> Any:
    """An ASGI endpoint answering what ``route`` answers (the same responses, through
    Starlette and uvicorn's cycle)."""
    async def endpoint(request: Request) -> Response:
        return await route.answer(None, await request.body(), DisconnectWatch())
    return endpoint


@pytest.mark.parametrize("body", [b"plain", b"stream"])
async def test_answers_are_uvicorns_byte_for_byte(body: bytes) -> None:
    """A JSON answer and a whole stream, through uvicorn's cycle and directly."""
    got = []
    for direct in (False, True):
        route = Direct()
        route.gate.set()
        app = Starlette(routes=[Route("/v1/x", _via(route), methods=["POST"])])
        async with serving(app, 5.0, direct={PATH: route} if direct else None) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(_post(body))
                head, answer = await _answer(reader)
            finally:
                writer.close()
        got.append((b"\r\n".join(x for x in head.split(b"\r\n")
                                  if not x.startswith(b"date:")), answer))
    assert got[0] == got[1]


@pytest.mark.parametrize("second", [_post(b"second"), b"GET /v1/x HTTP/1.1\r\nHost: x\r\n\r\n"],
                         ids=["post", "get"])
async def test_a_request_pipelined_behind_a_direct_one_is_uvicorns(second: bytes) -> None:
    """It waits its turn and uvicorn serves it, even a POST to the direct path."""
    route = Direct()
    async with serving(APP, 5.0, direct={PATH: route}) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(_post(b"wait") + second)
            await asyncio.wait_for(route.arrived.wait(), 30)
            route.gate.set()
            _, first = await _answer(reader)
            _, second = await _answer(reader)
        finally:
            writer.close()
    assert json.loads(first)["direct"] and json.loads(second) == {"asgi": True}
    assert route.bodies == [b"wait"]


async def test_a_client_gone_with_a_request_pipelined_behind_fires_the_watch() -> None:
    """uvicorn stops reading while a request is pipelined behind another, so the loss
    shows when a write fails: an endless stream's. Its watch fires (uvicorn itself only
    marks the pipelined cycle) and the stream ends."""
    route = Direct()
    async with serving(APP, 5.0, direct={PATH: route}) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post(b"endless") + b"GET /v1/x HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(reader.readuntil(b"1\r\ne\r\n"), 30)
        writer.close()
        await asyncio.wait_for(route.stream_closed.wait(), 30)
        assert route.watches[0].gone


@pytest.mark.parametrize("phase", ["answer", "body"])
async def test_a_server_stop_answers_uvicorns_500_after_its_grace(phase: str) -> None:
    """The graceful shutdown's grace (1 s) runs out: the request's task is cancelled and
    answered as uvicorn's cycle is, mid-answer and while its body still comes."""
    route = Direct()
    async with serving(APP, 5.0, direct={PATH: route}) as (port, server):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        if phase == "answer":
            writer.write(_post(b"wait"))
            await asyncio.wait_for(route.arrived.wait(), 30)
        else:
            writer.write(b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\nab")
            await writer.drain()  # the body's first part; the rest never comes
            await asyncio.wait_for(route.admitted.wait(), 30)
        server.should_exit = True
        got = await asyncio.wait_for(reader.read(), 30)
        writer.close()
    assert got.startswith(b"HTTP/1.1 500 Internal Server Error\r\n")
    assert got.endswith(b"content-type: text/plain; charset=utf-8\r\ncontent-length: 21"
                        b"\r\nconnection: close\r\n\r\nInternal Server Error")
    assert route.bodies == ([b"wait"] if phase == "answer" else [])


async def test_a_broken_or_lost_body_is_never_answered_by_the_route() -> None:
    route = Direct()
    async with serving(APP, 5.0, direct={PATH: route}) as (port, server):
        # a parse error mid-body: uvicorn's 400, closed
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"2\r\nab\r\n")
        await writer.drain()
        writer.write(b"zz\r\n")  # not a chunk size
        got = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        assert got.startswith(b"HTTP/1.1 400")
        # a connection lost mid-body: its watch fires, nothing runs
        route.admitted.clear()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\nab")
        await asyncio.wait_for(route.admitted.wait(), 30)
        (conn,) = [c for c in server.server_state.connections  # the first may linger
                   if not c.transport.is_closing()]  # type: ignore[union-attr]
        cycle = conn.cycle  # type: ignore[union-attr]
        assert type(cycle) is DirectCycle and cycle.more_body
        gone = asyncio.Event()
        cycle.watch.callback = gone.set
        writer.close()
        await asyncio.wait_for(gone.wait(), 30)
    assert route.bodies == []


# --- the frontend's own routes: the same answers served directly as through ASGI --------

def _frontend_app() -> Any:
    from services.frontend.auth import ApiKeys
    from services.frontend.http_api import HttpLimits, create_app
    from services.frontend.models import ModelCatalog
    from services.frontend.pipeline import Pipeline

    return create_app(Pipeline(ModelCatalog(), lambda: None),
                      HttpLimits(max_body_bytes=200, body_timeout_s=0.3),
                      keys=ApiKeys.from_sources("sk-good"))


GOOD = b"Authorization: Bearer sk-good\r\n"
CASES = {
    "no key": _post(b'{"model": "m", "prompt": "x"}', target=b"/v1/completions"),
    "bad key": _post(b"{}", b"Authorization: Bearer sk-bad\r\n", b"/v1/completions"),
    "bad json": _post(b'{"model": ', GOOD, b"/v1/completions"),
    "surrogate": _post(b'{"model": "\\ud800", "prompt": "x"}', GOOD, b"/v1/completions"),
    "bad field": _post(b'{"model": "m", "prompt": "x", "n": "2"}', GOOD,
                       b"/v1/completions"),
    "unknown model": _post(b'{"model": "m", "prompt": "x"}', GOOD, b"/v1/completions"),
    "chat unknown model": _post(b'{"model": "m", "messages": [{"role": "user", '
                                b'"content": "hi"}]}', GOOD, b"/v1/chat/completions"),
    "declared too large": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + GOOD
                          + b"Content-Length: 201\r\n\r\n",
    "chunked too large": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + GOOD
                         + b"Transfer-Encoding: chunked\r\n\r\nc9\r\n" + b"x" * 201 + b"\r\n",
    "late body": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + GOOD
                 + b"Content-Length: 20\r\n\r\n{",
}


async def _frontend_answer(direct: bool, request_bytes: bytes) -> tuple[bytes, bytes]:
    app = _frontend_app()
    async with serving(app, 5.0, direct=app.direct_routes if direct else None) as (
            port, server):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(request_bytes)
            head, body = await _answer(reader)
            (conn,) = server.server_state.connections
            assert (type(conn.cycle) is DirectCycle) is direct  # type: ignore[union-attr]
        finally:
            writer.close()
    # the date header aside, byte for byte
    return b"\r\n".join(x for x in head.split(b"\r\n") if not x.startswith(b"date:")), body


@pytest.mark.parametrize("case", list(CASES))
async def test_the_frontends_routes_answer_alike_both_ways(case: str) -> None:
    via_asgi = await _frontend_answer(False, CASES[case])
    assert await _frontend_answer(True, CASES[case]) == via_asgi
    assert via_asgi[0].split(b" ")[1] in (b"400", b"401", b"404", b"408", b"413")


async def test_a_stream_its_client_leaves_is_logged_when_it_starts() -> None:
    access, seen = logging.getLogger("uvicorn.access"), _Records()
    level = access.level
    route = Direct()
    async with serving(APP, 5.0, direct={PATH: route}) as (port, _):
        access.setLevel(logging.INFO)
        access.addHandler(seen)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_post(b"stream"))
            await asyncio.wait_for(reader.readuntil(b"1\r\nb\r\n"), 30)
            writer.close()
            await asyncio.wait_for(route.stream_closed.wait(), 30)
        finally:
            access.removeHandler(seen)
            access.setLevel(level)
    (record,) = seen.records
    assert isinstance(record.args, tuple) and record.args[1:] == ("POST", "/v1/x", "1.1", 200)



async def test_a_refusal_in_the_same_read_arms_no_timer_over_the_next_request() -> None:
    """A 401 written while a read is parsed completes a response, which arms uvicorn's
    keep-alive timer; the request parsed next in that read must not run under it."""
    route = Direct()
    async with serving(APP, 30.0, direct={PATH: route}) as (port, server):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(_post(b"", b"X-Key: bad\r\n") + _post(b"wait"))
            head, _ = await _answer(reader)
            assert head.startswith(b"HTTP/1.1 401")
            await asyncio.wait_for(route.arrived.wait(), 30)
            (conn,) = server.server_state.connections
            assert conn.timeout_keep_alive_task is None  # type: ignore[union-attr]
            route.gate.set()
            _, body = await _answer(reader)
            assert json.loads(body)["direct"]
        finally:
            writer.close()


async def test_an_upgrade_pipelined_behind_a_direct_post_is_not_answered_by_it() -> None:
    route = Direct()
    async with serving(APP, 5.0, direct={PATH: route}) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(_post(b"wait") + b"GET /ws HTTP/1.1\r\nHost: x\r\n"
                         b"Connection: Upgrade\r\nUpgrade: websocket\r\n"
                         b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                         b"Sec-WebSocket-Version: 13\r\n\r\n")
            await asyncio.wait_for(route.arrived.wait(), 30)
            route.gate.set()
            # uvicorn hands the connection to its WebSocket protocol (403: no such
            # route), which closes it: what else the client gets is uvicorn's business
            await asyncio.wait_for(reader.read(), 30)
        finally:
            writer.close()
    assert route.bodies == [b"wait"]  # the upgrade's end of message started nothing


async def test_a_refusal_with_a_header_uvicorn_refuses_closes_unanswered() -> None:
    class BadRefusal(Direct):
        def admit(self, headers: list[tuple[bytes, bytes]]) -> tuple[Any, Response | None]:
            return None, Response(b"no", 401, headers={"x-bad": "a\r\nb"})

    route = BadRefusal()
    async with serving(APP, 5.0, direct={PATH: route}) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post(b"x"))
        got = await asyncio.wait_for(reader.read(), 30)
        writer.close()
    assert got == b"" and route.bodies == []
