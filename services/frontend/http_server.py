"""The frontend's HTTP server: uvicorn on a pre-bound socket, with a header timeout.

Contract:

- :func:`http_config` builds the ``uvicorn.Config`` for the OpenAI app: the connection cap
  (``limit_concurrency``: beyond it uvicorn answers 503), the keep-alive timeout (an idle
  connection between requests is closed), and :func:`header_timeout_protocol`.
- :func:`header_timeout_protocol` wraps uvicorn's HTTP protocol class (httptools when
  installed, else h11) so that a connection whose first request's headers are not
  complete ``header_timeout_s`` after it opened is closed (slowloris: a client that
  trickles header bytes forever would otherwise hold the connection for good). Later
  requests on a kept-alive connection are covered by uvicorn's keep-alive timeout, which
  runs until the next request's data arrives.
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import uvicorn


def _base_protocol() -> type[asyncio.Protocol]:
    if importlib.util.find_spec("httptools") is not None:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return H11Protocol


def header_timeout_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol, closing connections whose first headers are late."""
    base: Any = _base_protocol()

    class HeaderTimeoutProtocol(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _headers_late(self) -> None:
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
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
