"""Batches of what a queue holds, for the multiplexed streams (``Worker.GenerateMux``).

Contract of :func:`queued_batches`:

- ``queued_batches(queue, limit_bytes)`` yields the queue's items in order, in lists: each
  list holds the first item it waited for plus every item already queued behind it, as
  long as their ``ByteSize()`` sum stays within ``limit_bytes``; an item that would pass
  it starts the next list, and an item over the limit on its own goes alone. It ends at
  the queue's ``None`` (after yielding the items before it). Nothing is dropped,
  reordered or waited for beyond the first item: a lone item is yielded at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol, TypeVar

BATCH_LIMIT_BYTES = 1 << 20  # a batch (one gRPC message) holds at most about this much


class Sized(Protocol):
    def ByteSize(self) -> int: ...  # noqa: N802 - protobuf's name


T = TypeVar("T", bound=Sized)


async def queued_batches(queue: asyncio.Queue[T | None],
                         limit_bytes: int = BATCH_LIMIT_BYTES) -> AsyncIterator[list[T]]:
    """See the module docstring."""
    carry: T | None = None
    while True:
        item = carry if carry is not None else await queue.get()
        carry = None
        if item is None:
            return
        batch = [item]
        size = item.ByteSize()
        while not queue.empty():
            nxt = queue.get_nowait()
            if nxt is None:
                yield batch
                return
            size += nxt.ByteSize()
            if size > limit_bytes:
                carry = nxt
                break
            batch.append(nxt)
        yield batch
