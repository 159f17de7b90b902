"""POST routes the frontend's HTTP protocol serves itself: no ASGI cycle, Starlette request
or response call in the way (the protocol: :mod:`.http_server`; the routes:
``/v1/completions`` and ``/v1/chat/completions``, :class:`.http_api.DirectRoute`).

Why: on a lone request (one every 10 ms, as at 100 req/s without overlap) this machine
runs the frontend cold, and uvicorn's ASGI cycle with Starlette's request and response
objects cost ~0.15 ms more than an exchange written on the connection
(``bench.mesh_profile.http_floors``: ``kvmesh-asgi`` against ``kvmesh-http``).

Contract:

- :class:`DisconnectWatch`: one request's client-gone signal: ``gone`` and the
  ``callback`` (no argument) called once when it turns True; the app sets and clears
  ``callback`` (one at a time).
- A route is a :class:`DirectPost`. :class:`DirectPostsMixin`, mixed into uvicorn's
  httptools protocol with ``direct_routes`` (raw path → route), serves a request itself
  when the method is POST, the request target is exactly a route's path (no query),
  HTTP/1.1 with keep-alive, no ``Expect: 100-continue``, no upgrade, no request of the
  connection still being answered (a pipelined one waits in uvicorn's queue and uvicorn
  serves it), no ``root_path``, and the server is under its concurrency limit (else
  uvicorn answers 503). Everything else is uvicorn's, unchanged.
- Served so, a request is answered as the ASGI app answers it: ``admit(headers)`` at the
  end of its headers (a refusal, e.g. 401, answered at once), then a declared
  ``Content-Length`` over ``max_body_bytes`` refused 413 at once (in both cases the body
  that still comes is read and dropped and the connection stays usable, as with
  uvicorn), a body passing the limit 413 as soon as it does, a body not complete
  ``body_timeout_s`` after the read that ended its headers 408; then ``answer(admitted,
  body, watch)`` in a task of the server's (graceful shutdown waits for it, then cancels
  it: uvicorn's 500 before the response started, the connection closed after). A body
  still coming is waited for in such a task too (only when it spans several reads).
- The response leaves as uvicorn writes one: the status line, uvicorn's default headers
  (``date``, ``server``), the response's headers (refused as uvicorn refuses them: the
  response counts as started, so the connection is closed, nothing sent) and body, in
  one write, after waiting while the transport's buffer is full; a ``StreamingResponse``
  chunked, its head at once, each chunk as it comes (waiting likewise), cancelled when the
  client goes (its iterator closed). ``connection: close`` when the server is shutting
  down, then closed. An answer that raises is uvicorn's 500 (before the response) or a
  closed connection (mid-stream), logged. The access log line is uvicorn's, when the
  response starts.
- The request's watch fires when the connection is lost before its response completed,
  also while a pipelined request waits behind it (then nothing more is written). A
  refusal written while a read is parsed leaves no keep-alive timer running over the
  request parsed after it; an upgrade pipelined behind a direct request is uvicorn's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from starlette.responses import Response, StreamingResponse

if TYPE_CHECKING:  # the mixin's base, for the type checker (uvicorn's httptools protocol)
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Base
else:
    _Base = object

try:  # uvicorn's own status lines and response header checks, so the bytes stay its own
    from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE
except ImportError:  # no httptools: no direct POST is served (http_server), none written
    STATUS_LINE = {}
    HEADER_RE = HEADER_VALUE_RE = re.compile(b"")

log = logging.getLogger(__name__)

DISCONNECT_WATCH = "kvmesh.disconnect"  # the watch's key in an ASGI scope's extensions
_CHUNKED = b"transfer-encoding: chunked\r\n"


class DisconnectWatch:
    """See the module docstring."""

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
    ``keep_alive``, ``message_event``), and the request's own (``body_done``: the whole
    body, or None when there is none to answer, for a task waiting for it)."""

    __slots__ = ("route", "path", "admitted", "parts", "size", "more_body", "started",
                 "response_complete", "disconnected", "keep_alive", "message_event",
                 "watch", "body_done")

    def __init__(self, route: DirectPost, path: bytes) -> None:
        self.route, self.path = route, path
        self.admitted: Any = None
        self.parts: list[bytes] = []
        self.size = 0
        self.more_body = True
        self.started = False  # the response's head was written (or refused)
        self.response_complete = False
        self.disconnected = False
        self.keep_alive = True
        self.message_event = _NO_EVENT
        self.watch = DisconnectWatch()
        self.body_done: asyncio.Future[bytes | None] | None = None

    def end_body(self, body: bytes | None) -> None:
        """Hands ``body`` (None: nothing to answer) to a task waiting for it, if any."""
        if self.body_done is not None and not self.body_done.done():
            self.body_done.set_result(body)


def _uvicorns_500() -> Response:
    """uvicorn's own 500 (``send_500_response``), header for header."""
    resp = Response(b"Internal Server Error", 500)
    resp.raw_headers = [(b"content-type", b"text/plain; charset=utf-8"),
                        (b"content-length", b"21"), (b"connection", b"close")]
    return resp


class DirectPostsMixin(_Base):
    """See the module docstring: mixed in before uvicorn's httptools protocol."""

    direct_routes: Mapping[bytes, DirectPost] = {}
    _direct_last: DirectCycle | None = None  # the connection's latest direct request

    # -- uvicorn's parser callbacks and transport events ---------------------------------

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        cycle: Any = self.cycle
        if (type(cycle) is DirectCycle and cycle.more_body and not cycle.response_complete
                and cycle.body_done is None and not self.transport.is_closing()):
            cycle.body_done = self.loop.create_future()  # the body spans reads: wait
            self._direct_task(self._direct_wait(cycle))

    def on_headers_complete(self) -> None:
        # a request's headers are in: no keep-alive timer runs over it (a refusal written
        # while this read was parsed armed one: only the next read would clear it)
        self._unset_keepalive_if_required()
        route = self._direct_route() if self.direct_routes else None
        if route is None:
            super().on_headers_complete()
            return
        cycle = self._direct_last = DirectCycle(route, self.url)
        self.cycle = cycle  # type: ignore[assignment]
        headers = self.headers
        try:
            cycle.admitted, refusal = route.admit(headers)
        except Exception:  # admit answers its refusals: this is a bug, answered 500
            log.exception("admitting a direct POST to %r failed", self.url)
            refusal = _uvicorns_500()
        if refusal is None:
            declared = None
            for name, value in headers:
                if name == b"content-length":
                    declared = value
                    break
            if (declared is not None and declared.isdigit()
                    and int(declared) > route.max_body_bytes):
                refusal = route.refusal(413)
        if refusal is not None:
            self._direct_write(cycle, refusal)

    def on_body(self, body: bytes) -> None:
        cycle: Any = self.cycle
        if type(cycle) is not DirectCycle:
            super().on_body(body)
            return
        if cycle.response_complete or not cycle.more_body or self._upgrading():
            return  # refused (the rest of the body is dropped), or not this request's
        cycle.size += len(body)
        if cycle.size > cycle.route.max_body_bytes:
            cycle.parts = []
            self._direct_write(cycle, cycle.route.refusal(413))
            return
        cycle.parts.append(body)

    def on_message_complete(self) -> None:
        cycle: Any = self.cycle
        if type(cycle) is not DirectCycle:
            super().on_message_complete()
            return
        if cycle.response_complete or not cycle.more_body or self._upgrading():
            return  # refused, or an upgrade request pipelined behind it (uvicorn's)
        cycle.more_body = False
        parts, cycle.parts = cycle.parts, []
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        if cycle.body_done is not None:
            cycle.end_body(body)  # its task answers
        else:
            self._direct_task(self._direct_run(cycle, body))

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        cycle = self._direct_last
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # (uvicorn marks only the current cycle)
            cycle.end_body(None)
            cycle.watch.fire()

    # -- serving ---------------------------------------------------------------------------

    def _upgrading(self) -> bool:
        """The message being parsed is an upgrade uvicorn takes (it gets no cycle)."""
        return bool(self.parser.should_upgrade() and self._should_upgrade())

    def _direct_route(self) -> DirectPost | None:
        """The direct route serving the request whose headers just ended, if any."""
        route = self.direct_routes.get(self.url)
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

    def _direct_task(self, work: Any) -> None:
        task = self.loop.create_task(work)
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    async def _direct_wait(self, cycle: DirectCycle) -> None:
        """Waits for a body spanning several reads (408 when it is late), then answers."""
        assert cycle.body_done is not None
        try:
            async with asyncio.timeout(cycle.route.body_timeout_s):
                body = await cycle.body_done
        except TimeoutError:
            if not cycle.response_complete:
                cycle.parts = []
                self._direct_write(cycle, cycle.route.refusal(408))
            return
        except asyncio.CancelledError:  # the server's shutdown: as uvicorn's cycle
            self._direct_abandon(cycle)
            raise
        if body is not None:
            await self._direct_run(cycle, body)

    async def _direct_run(self, cycle: DirectCycle, body: bytes) -> None:
        try:
            response = await cycle.route.answer(cycle.admitted, body, cycle.watch)
            if isinstance(response, StreamingResponse):
                await self._direct_stream(cycle, response)
            else:
                if self.flow.write_paused and not cycle.disconnected:
                    await self.flow.drain()
                self._direct_write(cycle, response)
        except asyncio.CancelledError:  # the server's shutdown: as uvicorn's cycle
            self._direct_abandon(cycle)
            raise
        except Exception:  # a bug (answer answers its errors)
            log.exception("a direct POST to %r failed", cycle.path)
            self._direct_abandon(cycle)
            return
        if response.background is not None:
            try:
                await response.background()
            except Exception:  # as uvicorn: logged, the connection closed
                log.exception("a direct POST's background task for %r failed", cycle.path)
                self.transport.close()

    def _direct_abandon(self, cycle: DirectCycle) -> None:
        """uvicorn's 500 when the response has not started, else the connection closed."""
        if cycle.response_complete:
            return
        if cycle.started:
            self.transport.close()
        else:
            cycle.parts = []
            self._direct_write(cycle, _uvicorns_500())

    def _direct_head(self, cycle: DirectCycle, response: Response,
                     extra: bytes = b"") -> bytes:
        """The status line and headers, as uvicorn's send writes them: the response
        counts as started (and is logged) before a header it refuses raises
        RuntimeError."""
        cycle.started = True
        if self.access_log:
            client = f"{self.client[0]}:{self.client[1]}" if self.client else ""
            self.access_logger.info('%s - "%s %s HTTP/%s" %d', client, "POST",
                                    cycle.path.decode("latin-1"), "1.1",
                                    response.status_code)
        out = [STATUS_LINE[response.status_code]]  # as uvicorn's send (100-599)
        for name, value in self.server_state.default_headers:  # uvicorn's own
            out += (name, b": ", value, b"\r\n")
        close = False
        for name, value in response.raw_headers:
            if HEADER_RE.search(name) or HEADER_VALUE_RE.search(value):
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
            cycle.end_body(None)
            return
        try:
            head = self._direct_head(cycle, response)
        except RuntimeError:  # as uvicorn: started, so closed with nothing sent
            log.exception("a direct POST to %r answered a header uvicorn refuses",
                          cycle.path)
            cycle.response_complete = True
            cycle.end_body(None)
            self.transport.close()
            return
        self.transport.write(head + response.body)
        self._direct_done(cycle)

    async def _direct_stream(self, cycle: DirectCycle, response: StreamingResponse) -> None:
        chunks = response.body_iterator
        try:
            if self.flow.write_paused and not cycle.disconnected:
                await self.flow.drain()
            if not (cycle.disconnected or self.transport.is_closing()):
                self.transport.write(self._direct_head(cycle, response, _CHUNKED))
                if await self._direct_chunks(cycle, response):
                    self._direct_done(cycle)
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def _direct_chunks(self, cycle: DirectCycle, response: StreamingResponse) -> bool:
        """Writes the stream's chunks and its end: True; False when the client went or
        the stream failed (logged, the connection closed, as uvicorn does once a response
        started)."""
        me = asyncio.current_task()
        assert me is not None
        watch = cycle.watch
        if watch.gone:
            return False
        gone = False

        def hang_up() -> None:  # a client gone ends the stream
            nonlocal gone
            gone = True
            me.cancel()

        watch.callback = hang_up
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
            if gone and me.uncancel() == 0:  # our cancel: the client went, nobody reads
                return False
            raise
        except Exception:
            log.exception("a direct POST's stream to %r failed", cycle.path)
            self.transport.close()
            return False
        finally:
            watch.callback = None

    def _direct_done(self, cycle: DirectCycle) -> None:
        cycle.response_complete = True
        cycle.end_body(None)
        if not cycle.keep_alive:
            self.transport.close()
        self.on_response_complete()
