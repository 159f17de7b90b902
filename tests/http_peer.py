"""A loopback HTTP/1.1 peer's side of a test: reading what a client sent.

Contract: ``await read_post(reader)`` reads one request's head and its
``content-length`` body from ``reader`` and returns the body (IncompleteReadError when
the client closes first).
"""

from __future__ import annotations

import asyncio


async def read_post(reader: asyncio.StreamReader) -> bytes:
    """See the module docstring."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return await reader.readexactly(length)
