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
- **Direct POSTs** (httptools only; ``http_config(direct=...)``: raw path →
  :class:`~.direct_posts.DirectPost`): the protocol serves those requests itself
  (:class:`~.direct_posts.DirectPostsMixin`, see :mod:`.direct_posts`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from services.frontend.direct_posts import (
    DISCONNECT_WATCH,
    DirectCycle,
    DirectPost,
    DirectPostsMixin,
    DisconnectWatch,
)

_HTTPTOOLS: tuple[type, ...]
try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    _HTTPTOOLS = (HttpToolsProtocol,)
except ImportError:  # no httptools: uvicorn runs h11, whose responses are not held
    _HTTPTOOLS = ()

__all__ = ["DISCONNECT_WATCH", "DirectCycle", "DirectPost", "DisconnectWatch", "HeldHeaders",
           "header_timeout_protocol", "http_config"]


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

    class HeaderTimeoutProtocol(DirectPostsMixin, AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        direct_routes = routes

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_timer: asyncio.TimerHandle | None = None
            self._arm_header_timer()

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
            before = self.cycle
            super().on_headers_complete()
            cycle: Any = self.cycle  # a new one, unless uvicorn returned early (an upgrade)
            if (isinstance(self, _HTTPTOOLS) and cycle is not None and cycle is not before
                    and type(cycle) is not DirectCycle):
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
            if (type(cycle) is not DirectCycle and cycle is not None
                    and getattr(cycle, "disconnected", False)):
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
