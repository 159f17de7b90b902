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
  uvicorn's keep-alive timeout stops counting at the first byte of the next request).
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol


def header_timeout_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol, closing connections whose request headers are late."""

    class HeaderTimeoutProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
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

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


def http_config(app: Any, *, max_connections: int, keep_alive_s: int,
                header_timeout_s: float) -> uvicorn.Config:
    """The uvicorn config of the frontend's HTTP API; see the module docstring."""
    return uvicorn.Config(app, log_level="warning", lifespan="off",
                          timeout_graceful_shutdown=1, limit_concurrency=max_connections,
                          timeout_keep_alive=keep_alive_s,
                          http=header_timeout_protocol(header_timeout_s))
