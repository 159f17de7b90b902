"""HTTP limits on a real frontend socket: oversized bodies get 413, a body that never
arrives gets 408, connections that never finish their headers are closed (slowloris),
and the frontend keeps serving new connections afterwards.

Raw sockets, because these are the cases an HTTP client library will not produce (a
Content-Length larger than the body, a body that keeps coming).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.common.config import load_config
from services.common.procs import Child
from services.frontend.main import FrontendApp, FrontendConfig, start_frontend
from tests.integration.conftest import base_args

# Upper bound on any one answer; reaching it fails the test (it is not a latency check).
ANSWER_TIMEOUT_S = 30


@pytest.fixture(scope="module")
async def frontend(etcd: Child) -> AsyncIterator[FrontendApp]:
    cfg = load_config(FrontendConfig, [*base_args(etcd.address, "limits"), "--http-port", "0",
                                       "--max-body-mib", "1", "--body-timeout-s", "1",
                                       "--header-timeout-s", "1"], {})
    app = await start_frontend(cfg)
    try:
        yield app
    finally:
        await app.server.stop()


async def _exchange(app: FrontendApp, head: bytes, body: bytes = b"") -> bytes:
    """Sends ``head`` + ``body`` on a fresh connection; returns the status line."""
    reader, writer = await asyncio.open_connection("127.0.0.1", app.http_port)
    try:
        writer.write(head + body)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), ANSWER_TIMEOUT_S)
    finally:
        writer.close()
    return line


def _post(length: int | None, chunked: bool = False) -> bytes:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    if chunked:
        head += b"Transfer-Encoding: chunked\r\n"
    elif length is not None:
        head += b"Content-Length: %d\r\n" % length
    return head + b"\r\n"


async def test_declared_oversized_body_is_refused_before_it_is_read(
        frontend: FrontendApp) -> None:
    line = await _exchange(frontend, _post(50 << 20))  # 50 MiB declared, none sent
    assert line.startswith(b"HTTP/1.1 413"), line


async def test_chunked_body_over_the_limit_is_refused(frontend: FrontendApp) -> None:
    chunk = b"a" * (256 << 10)
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(8))  # 2 MiB
    line = await _exchange(frontend, _post(None, chunked=True), body)
    assert line.startswith(b"HTTP/1.1 413"), line


async def test_body_shorter_than_its_content_length_times_out_with_408(
        frontend: FrontendApp) -> None:
    line = await _exchange(frontend, _post(100), b'{"model": ')
    assert line.startswith(b"HTTP/1.1 408"), line


async def test_frontend_serves_after_the_refusals(frontend: FrontendApp) -> None:
    await _exchange(frontend, _post(50 << 20))
    line = await _exchange(frontend, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    assert line.startswith(b"HTTP/1.1 200"), line
    small = b'{"model": "m", "prompt": "x"}'
    line = await _exchange(frontend, _post(len(small)), small)
    assert line.startswith(b"HTTP/1.1 404"), line  # validated, then: no such model


async def test_connections_that_never_finish_their_headers_are_closed(
        frontend: FrontendApp) -> None:
    conns = [await asyncio.open_connection("127.0.0.1", frontend.http_port) for _ in range(50)]
    try:
        for _, writer in conns:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            await writer.drain()
        for reader, _ in conns:  # EOF: the server closed the connection
            assert await asyncio.wait_for(reader.read(), ANSWER_TIMEOUT_S) == b""
    finally:
        for _, writer in conns:
            writer.close()
    line = await _exchange(frontend, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    assert line.startswith(b"HTTP/1.1 200"), line


async def _response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """Reads one HTTP/1.1 response with a Content-Length: (status line, body)."""
    status = await asyncio.wait_for(reader.readline(), ANSWER_TIMEOUT_S)
    length = 0
    while (line := await asyncio.wait_for(reader.readline(), ANSWER_TIMEOUT_S)) != b"\r\n":
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    body = await asyncio.wait_for(reader.readexactly(length), ANSWER_TIMEOUT_S)
    return status, body


async def test_a_bad_request_leaves_the_keep_alive_connection_usable(
        frontend: FrontendApp) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.http_port)
    try:
        bad = b'{"model": "m", "prompt": "x", "seed": 9223372036854775808}'
        writer.write(_post(len(bad)) + bad)
        status, body = await _response(reader)
        assert status.startswith(b"HTTP/1.1 400") and b'"seed"' in body, (status, body)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _ = await _response(reader)
        assert status.startswith(b"HTTP/1.1 200"), status
    finally:
        writer.close()


async def test_late_headers_of_a_later_request_close_the_connection(
        frontend: FrontendApp) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.http_port)
    try:
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _ = await _response(reader)
        assert status.startswith(b"HTTP/1.1 200"), status
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # never ends
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), ANSWER_TIMEOUT_S) == b""
    finally:
        writer.close()
