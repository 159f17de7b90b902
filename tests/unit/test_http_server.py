"""The frontend's uvicorn protocol: a response of known length leaves in one write (its
headers held until its body), streamed and HEAD responses as uvicorn writes them, and
every answer intact through a real uvicorn server on a loopback port."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from services.frontend import http_server
from services.frontend.http_api import _unless_disconnected
from services.frontend.http_server import HeldHeaders
from tests.http_peer import serving


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.closed


class FakeCycle:
    def __init__(self, chunked: bool | None, length: int = 0, method: str = "GET") -> None:
        self.chunked_encoding = chunked
        self.expected_content_length = length
        self.response_complete = False
        self.scope = {"method": method}


def test_known_length_response_leaves_in_one_write() -> None:
    real = FakeTransport()
    held = HeldHeaders(real, FakeCycle(chunked=False, length=2))  # type: ignore[arg-type]
    held.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    assert real.writes == []
    held.write(b"{}")
    assert real.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
    assert not held.is_closing()  # anything else is the real transport's


def test_only_the_first_write_is_held() -> None:
    real = FakeTransport()
    held = HeldHeaders(real, FakeCycle(chunked=False, length=6))  # type: ignore[arg-type]
    held.write(b"HEAD\r\n\r\n")
    held.write(b"ab")  # a body in three parts (uvicorn counts down before each write)
    held.write(b"cd")
    held.write(b"ef")
    assert real.writes == [b"HEAD\r\n\r\nab", b"cd", b"ef"]


@pytest.mark.parametrize("cycle", [FakeCycle(chunked=True), FakeCycle(chunked=None),
                                   FakeCycle(chunked=False, length=0),
                                   FakeCycle(chunked=False, length=5, method="HEAD")],
                         ids=["chunked", "not-started", "empty-body", "head"])
def test_other_writes_pass_straight_through(cycle: FakeCycle) -> None:
    real = FakeTransport()
    held = HeldHeaders(real, cycle)  # type: ignore[arg-type]
    held.write(b"a")
    held.write(b"b")
    assert real.writes == [b"a", b"b"]


@pytest.mark.parametrize("end", ["close", "abort"])
def test_held_headers_are_sent_before_the_connection_ends(end: str) -> None:
    real = FakeTransport()
    held = HeldHeaders(real, FakeCycle(chunked=False, length=9))  # type: ignore[arg-type]
    held.write(b"HTTP/1.1 200 OK\r\n\r\n")
    getattr(held, end)()
    assert real.writes == [b"HTTP/1.1 200 OK\r\n\r\n"]
    assert real.closed if end == "close" else real.aborted


async def _json(_: Request) -> Response:
    return JSONResponse({"a": 1})


async def _stream(_: Request) -> Response:
    async def parts() -> AsyncIterator[bytes]:
        yield b"x"
        await asyncio.sleep(0)
        yield b"y"
    return StreamingResponse(parts())


async def _fails_after_start(_: Request) -> Response:
    class Broken(Response):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"10")]})
            raise RuntimeError("the body never comes")
    return Broken()


async def _in_parts(_: Request) -> Response:
    class Parts(Response):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"6")]})
            for part, more in ((b"ab", True), (b"cd", True), (b"ef", False)):
                await send({"type": "http.response.body", "body": part, "more_body": more})
    return Parts()


async def _exchange(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        return await asyncio.wait_for(reader.read(), 30)  # the server closes: Connection: close
    finally:
        writer.close()


class _Tap:
    """A connection's transport, its writes recorded."""

    writes: list[bytes] = []

    def __init__(self, real: asyncio.Transport) -> None:
        self._real = real

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self._real.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _Tapped(HeldHeaders):
    __slots__ = ()

    def __init__(self, real: asyncio.Transport, cycle: Any) -> None:
        super().__init__(_Tap(real), cycle)  # type: ignore[arg-type]


async def test_answers_through_uvicorn_are_intact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_server, "HeldHeaders", _Tapped)
    monkeypatch.setattr(_Tap, "writes", [])
    app = Starlette(routes=[Route("/j", _json, methods=["GET", "HEAD"]),
                            Route("/s", _stream), Route("/broken", _fails_after_start),
                            Route("/parts", _in_parts)])
    async with serving(app, header_timeout_s=5) as (port, _):
        close = b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        got = await _exchange(port, b"GET /j" + close)
        assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(b'\r\n\r\n{"a":1}')
        assert b"content-length: 7\r\n" in got
        assert _Tap.writes == [got]  # headers and body in one write
        _Tap.writes.clear()
        got = await _exchange(port, b"GET /parts" + close)
        assert got.endswith(b"\r\n\r\nabcdef")
        assert _Tap.writes[1:] == [b"cd", b"ef"] and _Tap.writes[0].endswith(b"\r\n\r\nab")
        # keep-alive: two answers on one connection, each whole
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in range(2):
                writer.write(b"GET /j HTTP/1.1\r\nHost: x\r\n\r\n")
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
                assert head.startswith(b"HTTP/1.1 200 OK\r\n")
                assert await asyncio.wait_for(reader.readexactly(7), 30) == b'{"a":1}'
        finally:
            writer.close()
        got = await _exchange(port, b"HEAD /j" + close)
        assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(b"\r\n\r\n")
        assert b"content-length: 7\r\n" in got
        got = await _exchange(port, b"GET /s" + close)
        assert b"transfer-encoding: chunked\r\n" in got
        assert got.endswith(b"\r\n\r\n1\r\nx\r\n1\r\ny\r\n0\r\n\r\n")
        # the app dies after starting a response: the client still gets the headers uvicorn
        # wrote, then the connection closes (as without holding them)
        got = await _exchange(port, b"GET /broken" + close)
        assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(b"\r\n\r\n")


async def test_a_pipelined_request_is_not_cut_off_by_the_header_timeout() -> None:
    """Two requests sent at once (pipelined): the second's headers are in before the
    first is answered, and its answer may take longer than the header timeout."""
    release = asyncio.Event()

    async def slow(_: Request) -> Response:
        await release.wait()
        return JSONResponse({"slow": True})

    app = Starlette(routes=[Route("/j", _json), Route("/slow", slow)])
    async with serving(app, header_timeout_s=0.2) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET /j HTTP/1.1\r\nHost: x\r\n\r\n"
                         b"GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            first = await asyncio.wait_for(reader.readuntil(b'{"a":1}'), 30)
            assert first.startswith(b"HTTP/1.1 200 OK")
            # the header timeout is the condition under test: let five of them pass with
            # the second answer still being computed
            await asyncio.sleep(1.0)
            release.set()
            rest = await asyncio.wait_for(reader.read(), 30)
            assert rest.startswith(b"HTTP/1.1 200 OK") and rest.endswith(b'{"slow":true}')
        finally:
            writer.close()


async def test_a_client_gone_mid_request_fires_its_watch_once() -> None:
    """The connection closes while the app still answers: the request's watch turns
    ``gone`` and calls its callback once, in ``connection_lost`` (no task in
    ``receive``); the same app's next request on a new connection has a fresh watch."""
    watches: list[http_server.DisconnectWatch] = []
    fired: list[int] = []
    hung_up, arrived = asyncio.Event(), asyncio.Event()

    async def slow(request: Request) -> Response:
        watch = request.scope["extensions"][http_server.DISCONNECT_WATCH]
        watches.append(watch)
        arrived.set()
        assert not watch.gone

        def gone() -> None:
            fired.append(len(watches))
            hung_up.set()
        watch.callback = gone
        await asyncio.wait_for(hung_up.wait(), 30)
        return Response(b"nobody reads this")

    async with serving(Starlette(routes=[Route("/slow", slow)]), 5.0) as (port, _):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        await asyncio.wait_for(arrived.wait(), 30)
        writer.close()
        await asyncio.wait_for(hung_up.wait(), 30)
        assert watches[0].gone and fired == [1]
        watches[0].fire()  # idempotent
        assert fired == [1]


async def test_a_connection_closed_after_its_answer_fires_nothing() -> None:
    """A client that closes its keep-alive connection once answered is not a client gone
    mid-request: the answered request's watch stays quiet."""
    watches: list[http_server.DisconnectWatch] = []
    fired: list[int] = []

    async def quick(request: Request) -> Response:
        watch = request.scope["extensions"][http_server.DISCONNECT_WATCH]
        watch.callback = lambda: fired.append(1)
        watches.append(watch)
        return Response(b"ok")

    app = Starlette(routes=[Route("/quick", quick)])
    async with serving(app, 5.0) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /quick HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"ok"), 30)).startswith(
            b"HTTP/1.1 200")
        writer.close()
        await writer.wait_closed()
        assert b"200 OK" in await _exchange(
            port, b"GET /quick HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    # the server has stopped: both connections are gone
    assert len(watches) == 2 and not any(w.gone for w in watches) and not fired


class _Asgi:
    """The part of a Starlette Request ``_unless_disconnected`` reads: its scope, with a
    watch as the frontend's server puts there."""

    def __init__(self) -> None:
        self.watch = http_server.DisconnectWatch()
        self.scope = {"extensions": {http_server.DISCONNECT_WATCH: self.watch}}


async def test_a_watched_handler_is_cancelled_when_its_client_goes() -> None:
    req, started, cancelled = _Asgi(), asyncio.Event(), []

    async def work() -> Response:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(1)
            raise
        return Response(b"never")

    handler = asyncio.ensure_future(_unless_disconnected(req, work()))  # type: ignore[arg-type]
    await asyncio.wait_for(started.wait(), 10)
    assert req.watch.callback is not None
    req.watch.fire()
    resp = await asyncio.wait_for(handler, 10)
    assert resp.status_code == 499 and cancelled == [1] and req.watch.callback is None


async def test_work_for_a_client_gone_before_it_starts_never_runs() -> None:
    req, ran = _Asgi(), []

    async def work() -> Response:
        ran.append(1)
        return Response(b"never")

    req.watch.fire()
    resp = await _unless_disconnected(req, work())  # type: ignore[arg-type]
    assert resp.status_code == 499 and not ran
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_watched_handler_answers_and_leaves_no_callback() -> None:
    req = _Asgi()

    async def work() -> Response:
        await asyncio.sleep(0)
        return Response(b"ok")

    resp = await _unless_disconnected(req, work())  # type: ignore[arg-type]
    assert resp.status_code == 200 and req.watch.callback is None
    req.watch.fire()  # the client goes after its answer: nothing to cancel
