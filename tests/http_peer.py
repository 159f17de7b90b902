"""The loopback HTTP/1.1 sides of a test.

Contract:

- ``await read_post(reader)`` reads one request's head and its ``content-length`` body
  from ``reader`` and returns the body (IncompleteReadError when the client closes
  first).
- ``async with serving(app, header_timeout_s, direct=None, max_connections=8) as (port,
  server)``: ``app`` served by uvicorn under the frontend's config
  (:func:`services.frontend.http_server.http_config`, ``direct`` its direct POST routes)
  on a free loopback port; the server stops at the end of the block.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import uvicorn

from services.common.procs import free_port
from services.frontend.http_server import DirectPost, http_config


async def read_post(reader: asyncio.StreamReader) -> bytes:
    """See the module docstring."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return await reader.readexactly(length)


@contextlib.asynccontextmanager
async def serving(app: Any, header_timeout_s: float,
                  direct: Mapping[bytes, DirectPost] | None = None,
                  max_connections: int = 8) -> AsyncIterator[tuple[int, uvicorn.Server]]:
    """See the module docstring."""
    port = free_port()
    config = http_config(app, max_connections=max_connections, keep_alive_s=5,
                         header_timeout_s=header_timeout_s, direct=direct)
    config.host, config.port = "127.0.0.1", port
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    try:
        async with asyncio.timeout(30):
            while not server.started:  # uvicorn offers no event to wait on
                assert not task.done(), "uvicorn stopped before it started"
                await asyncio.sleep(0.01)
        yield port, server
    finally:
        server.should_exit = True
        await task
