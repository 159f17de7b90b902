"""The frontend's HTTP server: uvicorn on a pre-bound socket, with a header timeout.

Contract:

- :func:`http_config` builds the ``uvicorn.Config`` for the OpenAI app: the connection cap
  (``limit_concurrency``: beyond it uvicorn answers 503), the keep-alive timeout (an idle
  connection between requests is closed), and :func:`header_timeout_protocol`.
- :func:`header_timeout_protocol` subclasses uvicorn's HTTP protocol (its own choice:
  httptools when installed, else h11) so that every request's headers must be complete
  within ``header_timeout_s``: of the first request from when the connection opened, of
  each later one from when the previous response completed. Otherwise the connection is
  closed (slowloris: a client that trickles header bytes forever would hold it for good;
  uvicorn's keep-alive timeout stops counting at the first byte of the next request). A
  pipelined request whose headers came while the one before was answered is not timed:
  its response may take as long as it takes.
  With httptools (uvicorn's choice when it is installed, as here), a response whose
  length is known (``content-length``: every non-streamed answer) also leaves in one
  write: :class:`HeldHeaders` holds its status line and headers until its body is
  written (uvicorn writes them apart: two syscalls, and two wake-ups of a waiting
  client, for every small JSON answer). A streamed (chunked) response's headers leave at
  once, as before. A connection closed or aborted with headers held sends them first.
- With httptools, each request's ASGI scope carries a :class:`DisconnectWatch` under
  ``scope["extensions"][DISCONNECT_WATCH]``: when the connection is lost before the
  request's response completed (when uvicorn's ``receive`` starts answering
  ``http.disconnect``), its ``gone`` turns True and its ``callback``, if set, is called,
  in the connection's ``connection_lost``. The app learns of a client gone without a
  task blocked in ``receive`` per request. Without one (h11, Starlette's TestClient,
  another ASGI server) the app must watch ``receive`` itself.
- **Direct POSTs** (httptools only; ``http_config(direct=...)``: path → :class:`DirectPost`):
  the protocol serves such a request itself, with no ASGI cycle, Starlette request or
  response call in the way (on a lone request, as at 100 req/s, uvicorn's cycle and
  Starlette's objects cost this machine ~0.25 ms more than an exchange written on the
  connection: ``bench.mesh_profile.http_floors``), when the method is POST, the request
  target is exactly the path (no query), HTTP/1.1 keep-alive, no ``Expect:
  100-continue``, no upgrade, no request of the connection still being answered (a
  pipelined one waits in uvicorn's queue and uvicorn serves it) and the server is under
  its concurrency limit (else uvicorn answers 503). Everything else is uvicorn's, as
  before. Served directly, a request is answered as the ASGI app answers it:
  ``admit(headers)`` at the end of its headers (a refusal, e.g. 401, is answered at
  once), then a declared ``Content-Length`` over ``max_body_bytes`` is refused 413 at
  once (in both cases the body that still comes is read and dropped and the connection
  stays usable, as uvicorn's), a body that passes the limit 413 as soon as it does, a
  body not complete ``body_timeout_s`` after its headers 408; then ``answer(admitted,
  body, watch)`` runs in a task of the server's (graceful shutdown waits for it) with the
  request's :class:`DisconnectWatch` (fired when the connection is lost before the
  answer completed). Its response leaves as uvicorn writes one: the status line,
  uvicorn's default headers (``date``, ``server``), the response's headers (checked as
  uvicorn checks them) and body, in one write; a ``StreamingResponse`` chunked (its head
  at once, each chunk as it comes, waiting while the transport's buffer is full, cancelled
  when the client goes). ``connection: close`` when the server is shutting down (closed
  after the answer). An answer that raises is a 500 (before the response) or a closed
  connection (mid-stream), logged, as uvicorn does. The access log line is uvicorn's.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import uvicorn
from starlette.responses import Response, StreamingResponse
from uvicorn.protocols.http.auto import AutoHTTPProtocol

_HTTPTOOLS: tuple[type, ...]
try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    _HTTPTOOLS = (HttpToolsProtocol,)
except ImportError:  # no httptools: uvicorn runs h11, whose responses are not held
    _HTTPTOOLS = ()

log = logging.getLogger(__name__)

# what uvicorn refuses in a response header's name and value (its send checks the same)
_BAD_NAME = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
_BAD_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")
_CHUNKED = b"transfer-encoding: chunked\r\n"


def _line(code: int) -> bytes:
    try:
        phrase = http.HTTPStatus(code).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (code, phrase)


_STATUS_LINES = {code: _line(code) for code in range(100, 600)}


def _status_line(code: int) -> bytes:
    """The status line uvicorn writes for ``code``."""
    return _STATUS_LINES.get(code) or _line(code)


DISCONNECT_WATCH = "kvmesh.disconnect"


class DisconnectWatch:
    """One request's client-gone signal (see the module docstring): ``gone`` and the
    ``callback`` (no argument) called once when it turns True; the app sets and clears
    ``callback`` (one at a time)."""

    __slots__ = ("gone", "callback")

    def __init__(self) -> None:
        self.gone = False
        self.callback: Callable[[], object] | None = None

    def fire(self) -> None:
        """The client is gone (idempotent: the callback is called once)."""
        if not self.gone:
            self.gone = True
            if self.callback is not None:
                self.callback()


class DirectPost(Protocol):
    """A POST route the protocol serves itself (see the module docstring)."""

    max_body_bytes: int
    body_timeout_s: float

    def admit(self, headers: list[tuple[bytes, bytes]]) -> tuple[Any, Response | None]:
        """At the end of the headers (names lowercased): what ``answer`` gets, or a
        refusal to send at once. Never raises."""

    def answer(self, admitted: Any, body: bytes, watch: DisconnectWatch) -> Awaitable[Response]:
        """The response to the whole body. Raises nothing but a cancel from outside."""

    def refusal(self, status: int) -> Response:
        """The answer to a body over the limit (413) or late (408)."""


class _NoEvent:
    """uvicorn's protocol sets its cycle's ``message_event`` on connection loss; a direct
    cycle has nobody to wake."""

    __slots__ = ()

    def set(self) -> None:
        return None


_NO_EVENT = _NoEvent()


class DirectCycle:
    """One request served directly, as the connection's ``cycle``: the attributes uvicorn's
    protocol reads and sets on a cycle (``response_complete``, ``disconnected``,
    ``keep_alive``, ``message_event``), and the request's own."""

    __slots__ = ("route", "path", "admitted", "parts", "size", "more_body",
                 "response_complete", "disconnected", "keep_alive", "message_event",
                 "watch", "timer")

    def __init__(self, route: DirectPost, path: bytes) -> None:
        self.route, self.path = route, path
        self.admitted: Any = None
        self.parts: list[bytes] = []
        self.size = 0
        self.more_body = True
        self.response_complete = False
        self.disconnected = False
        self.keep_alive = True
        self.message_event = _NO_EVENT
        self.watch = DisconnectWatch()
        self.timer: asyncio.TimerHandle | None = None

    def stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


_INTERNAL_ERROR = Response(b"Internal Server Error", 500, media_type="text/plain",
                           headers={"connection": "close"})  # uvicorn's own 500


class HeldHeaders:
    """One response's transport (a request cycle's), holding the first write of a response
    of known length (its status line and headers: uvicorn writes them as soon as the app
    starts the response) until the next write (its body's first part), so that both
    leave in one ``write``; every later write goes straight through. Everything else is
    the connection's transport's."""

    __slots__ = ("_real", "_cycle", "_held", "_first")

    def __init__(self, real: asyncio.Transport, cycle: Any) -> None:
        self._real = real
        self._cycle = cycle  # uvicorn's RequestResponseCycle: its chunked_encoding
        self._held: bytes | None = None
        self._first = True  # no write yet: only the first may be held

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._real.write(held + data)
        elif (self._first and self._cycle.chunked_encoding is False
              and not self._cycle.response_complete
              and self._cycle.expected_content_length > 0
              and self._cycle.scope["method"] != "HEAD"):
            self._held = bytes(data)  # the headers; a body of > 0 bytes follows (HEAD: none)
        else:
            self._real.write(data)
        self._first = False

    def _flush(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self._real.write(held)

    def close(self) -> None:
        self._flush()
        self._real.close()

    def abort(self) -> None:
        self._flush()
        self._real.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def header_timeout_protocol(header_timeout_s: float,
                            direct: Mapping[bytes, DirectPost] | None = None
                            ) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol, closing connections whose request headers are late and
    (httptools) serving ``direct``'s POSTs itself (see the module docstring)."""
    routes = dict(direct or {}) if _HTTPTOOLS and issubclass(AutoHTTPProtocol, _HTTPTOOLS) \
        else {}

    class HeaderTimeoutProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_timer: asyncio.TimerHandle | None = None
            self._arm_header_timer()

        # -- direct POSTs ----------------------------------------------------------------

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            cycle = self.cycle
            if (type(cycle) is DirectCycle and cycle.more_body and not cycle.response_complete
                    and cycle.timer is None and not self.transport.is_closing()):
                cycle.timer = self.loop.call_later(cycle.route.body_timeout_s,
                                                   self._direct_late, cycle)

        def _direct_route(self) -> DirectPost | None:
            """The direct route serving the request whose headers just ended, if any."""
            route = routes.get(self.url)
            if route is None:
                return None
            parser, cycle, limit = self.parser, self.cycle, self.limit_concurrency
            if (parser.get_method() != b"POST" or self.expect_100_continue
                    or parser.get_http_version() != "1.1" or not parser.should_keep_alive()
                    or parser.should_upgrade() or self.root_path
                    or (cycle is not None and not cycle.response_complete)
                    or (limit is not None and (len(self.connections) >= limit
                                               or len(self.tasks) >= limit))):
                return None
            return route

        def _direct_start(self, route: DirectPost) -> None:
            cycle = DirectCycle(route, self.url)
            self.cycle = cycle
            headers = self.headers
            try:
                cycle.admitted, refusal = route.admit(headers)
            except Exception:  # admit answers its refusals: this is a bug, answered 500
                log.exception("admitting a direct POST to %r failed", self.url)
                refusal = _INTERNAL_ERROR
            if refusal is None:
                declared = next((v for k, v in headers if k == b"content-length"), None)
                if (declared is not None and declared.isdigit()
                        and int(declared) > route.max_body_bytes):
                    refusal = route.refusal(413)
            if refusal is not None:
                self._direct_write(cycle, refusal)

        def on_body(self, body: bytes) -> None:
            cycle = self.cycle
            if type(cycle) is not DirectCycle:
                super().on_body(body)
                return
            if cycle.response_complete:
                return  # refused: the rest of the body is dropped
            cycle.size += len(body)
            if cycle.size > cycle.route.max_body_bytes:
                cycle.parts = []
                self._direct_write(cycle, cycle.route.refusal(413))
                return
            cycle.parts.append(body)

        def on_message_complete(self) -> None:
            cycle = self.cycle
            if type(cycle) is not DirectCycle:
                super().on_message_complete()
                return
            if cycle.response_complete:
                return
            cycle.more_body = False
            cycle.stop_timer()
            parts, cycle.parts = cycle.parts, []
            body = parts[0] if len(parts) == 1 else b"".join(parts)
            task = self.loop.create_task(self._direct_run(cycle, body))
            task.add_done_callback(self.tasks.discard)
            self.tasks.add(task)

        def _direct_late(self, cycle: DirectCycle) -> None:
            cycle.timer = None
            if (self.cycle is cycle and cycle.more_body and not cycle.response_complete
                    and not self.transport.is_closing()):
                cycle.parts = []
                self._direct_write(cycle, cycle.route.refusal(408))

        async def _direct_run(self, cycle: DirectCycle, body: bytes) -> None:
            try:
                response = await cycle.route.answer(cycle.admitted, body, cycle.watch)
                if isinstance(response, StreamingResponse):
                    await self._direct_stream(cycle, response)
                else:
                    self._direct_write(cycle, response)
            except Exception:  # a bug (answer answers its errors), before any write
                log.exception("a direct POST to %r failed", cycle.path)
                self._direct_write(cycle, _INTERNAL_ERROR)  # uvicorn's 500, then closed
                return
            if response.background is not None:
                await response.background()

        def _direct_head(self, cycle: DirectCycle, response: Response,
                         extra: bytes = b"") -> bytes:
            """The status line and headers, as uvicorn's send writes them (RuntimeError
            for a header it refuses)."""
            out = [_status_line(response.status_code)]
            for name, value in self.server_state.default_headers:  # uvicorn's own
                out += (name, b": ", value, b"\r\n")
            close = False
            for name, value in response.raw_headers:
                if _BAD_NAME.search(name) or _BAD_VALUE.search(value):
                    raise RuntimeError(f"invalid HTTP header {name!r}")
                if name == b"connection" and b"close" in [
                        t.strip() for t in value.lower().split(b",")]:
                    close = True
                out += (name, b": ", value, b"\r\n")
            if close:
                cycle.keep_alive = False
            elif not cycle.keep_alive:
                out.append(b"connection: close\r\n")
            out += (extra, b"\r\n")
            return b"".join(out)

        def _direct_write(self, cycle: DirectCycle, response: Response) -> None:
            if cycle.disconnected or self.transport.is_closing():
                cycle.response_complete = True  # nobody to answer
                cycle.stop_timer()
                return
            self.transport.write(self._direct_head(cycle, response) + response.body)
            self._direct_done(cycle, response.status_code)

        async def _direct_stream(self, cycle: DirectCycle, response: StreamingResponse
                                 ) -> None:
            chunks = response.body_iterator
            try:
                if not (cycle.disconnected or self.transport.is_closing()):
                    # the head first: a header uvicorn would refuse raises before any write
                    self.transport.write(self._direct_head(cycle, response, _CHUNKED))
                    if await self._direct_chunks(cycle, response):
                        self._direct_done(cycle, response.status_code)
            finally:
                aclose = getattr(chunks, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()

        async def _direct_chunks(self, cycle: DirectCycle, response: StreamingResponse
                                 ) -> bool:
            """Writes the stream's chunks and its end: True; False when the client went
            or the stream failed (logged, the connection closed, as uvicorn does once a
            response started)."""
            me = asyncio.current_task()
            assert me is not None
            watch = cycle.watch
            watch.callback = me.cancel  # a client gone ends the stream
            try:
                async for chunk in response.body_iterator:
                    data = chunk.encode(response.charset) if isinstance(chunk, str) \
                        else bytes(chunk)
                    if not data:
                        continue
                    if self.flow.write_paused:
                        await self.flow.drain()
                    if cycle.disconnected:
                        return False
                    self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.transport.write(b"0\r\n\r\n")
                return True
            except asyncio.CancelledError:
                if watch.gone and me.uncancel() == 0:  # the client went: nobody reads
                    return False
                raise
            except Exception:
                log.exception("a direct POST's stream to %r failed", cycle.path)
                self.transport.close()
                return False
            finally:
                watch.callback = None

        def _direct_done(self, cycle: DirectCycle, status: int) -> None:
            cycle.response_complete = True
            cycle.stop_timer()
            if self.access_log:
                client = f"{self.client[0]}:{self.client[1]}" if self.client else ""
                self.access_logger.info('%s - "%s %s HTTP/%s" %d', client, "POST",
                                        cycle.path.decode("latin-1"), "1.1", status)
            if not cycle.keep_alive:
                self.transport.close()
            self.on_response_complete()

        # -- header timeout --------------------------------------------------------------

        def _arm_header_timer(self) -> None:
            """Closes the connection unless a new request's headers (a new cycle) are
            complete ``header_timeout_s`` from now."""
            if self._header_timer is not None:
                self._header_timer.cancel()
            waiting_after = self.cycle
            self._header_timer = self.loop.call_later(
                header_timeout_s, self._headers_late, waiting_after)

        def _headers_late(self, waiting_after: Any) -> None:
            if self.cycle is waiting_after and not self.transport.is_closing():
                self.transport.close()

        def on_headers_complete(self) -> None:
            route = self._direct_route() if routes else None
            if route is not None:
                self._direct_start(route)
                return
            before = self.cycle
            super().on_headers_complete()
            cycle: Any = self.cycle  # a new one, unless uvicorn returned early (an upgrade)
            if isinstance(self, _HTTPTOOLS) and cycle is not None and cycle is not before:
                cycle.scope.setdefault("extensions", {})[DISCONNECT_WATCH] = \
                    DisconnectWatch()
                cycle.transport = HeldHeaders(self.transport, cycle)

        def on_response_complete(self) -> None:
            super().on_response_complete()  # starts a pipelined request's cycle, if any
            if not self.transport.is_closing() and (self.cycle is None
                                                    or self.cycle.response_complete):
                self._arm_header_timer()  # else that cycle's headers are in: no timer
                # until its own response completes (it may take longer than the timeout)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            cycle: Any = self.cycle
            super().connection_lost(exc)
            if type(cycle) is DirectCycle:
                cycle.stop_timer()
                if cycle.disconnected:
                    cycle.watch.fire()
            elif cycle is not None and getattr(cycle, "disconnected", False):
                watch = cycle.scope.get("extensions", {}).get(DISCONNECT_WATCH)
                if watch is not None:  # as uvicorn's receive() now answers
                    watch.fire()  # http.disconnect

    return HeaderTimeoutProtocol


def http_config(app: Any, *, max_connections: int, keep_alive_s: int,
                header_timeout_s: float,
                direct: Mapping[bytes, DirectPost] | None = None) -> uvicorn.Config:
    """The uvicorn config of the frontend's HTTP API (``direct``: the POST routes its
    protocol serves itself, by path); see the module docstring."""
    return uvicorn.Config(app, log_level="warning", lifespan="off",
                          timeout_graceful_shutdown=1, limit_concurrency=max_connections,
                          timeout_keep_alive=keep_alive_s,
                          http=header_timeout_protocol(header_timeout_s, direct))
