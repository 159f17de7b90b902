"""Batches of what a queue holds, for the multiplexed streams (``Worker.GenerateMux``).

Contract of :func:`queued_batches`:

- ``queued_batches(queue, limit_bytes)`` yields the queue's items in order, in lists: each
  list holds the first item it waited for plus every item already queued behind it, as
  long as their ``ByteSize()`` sum stays within ``limit_bytes``; an item that would pass
  it starts the next list, and an item over the limit on its own goes alone. It ends at
  the queue's ``None`` (after yielding the items before it). Nothing is dropped,
  reordered or waited for beyond the first item: a lone item is yielded at once.

Contract of :class:`Outbox` (one connection's outgoing items, both stream halves):

- ``post(item)`` sends ``item`` after every item posted before it; ``post(None)`` ends
  the items (:meth:`Outbox.run` returns once the items before it are written).
- With ``write_nowait`` (a connection that can take a write without waiting: it answers
  False when it cannot), the items posted in one event-loop turn while the writer task
  has nothing queued or in hand leave in one batch from a loop callback at the end of
  that turn (no task woken), when ``direct`` is True, they fit ``limit_bytes`` and
  ``write_nowait`` takes them. Everything else (before ``direct``, a refused or
  over-limit batch, the end) goes to the writer task: :meth:`Outbox.run` writes the
  queue's batches (:func:`queued_batches`) with ``await write(batch)`` in order.
  Items never overtake each other either way. With ``closed`` set, items the callback
  holds are dropped (as a stopped writer's queue).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Generic, Protocol, TypeVar

log = logging.getLogger(__name__)

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


class Outbox(Generic[T]):
    """One connection's outgoing items (see the module docstring)."""

    def __init__(self, write: Callable[[list[T]], Awaitable[None]],
                 write_nowait: Callable[[list[T]], bool] | None = None,
                 limit_bytes: int = BATCH_LIMIT_BYTES, direct: bool = True) -> None:
        self._write = write
        self._write_nowait = write_nowait
        self._limit = limit_bytes
        self._queue: asyncio.Queue[T | None] = asyncio.Queue()
        self._soon: list[T | None] = []  # the loop callback's items, in order
        self._writing = False  # the writer task holds a batch
        self.direct = direct
        self.closed = False

    def post(self, item: T | None) -> None:
        """Sends ``item`` (None: the end) after the items posted before it."""
        if self._soon:
            self._soon.append(item)
        elif (self._write_nowait is not None and self.direct and not self._writing
              and self._queue.empty()):
            self._soon.append(item)
            asyncio.get_running_loop().call_soon(self._flush_soon)
        else:
            self._queue.put_nowait(item)

    def _flush_soon(self) -> None:
        """The callback's items in one batch if the connection takes it now; else (and
        from the end on) to the writer task, in order (its queue is empty: items went to
        the callback's list meanwhile)."""
        items, self._soon = self._soon, []
        if self.closed:
            return
        only = items[0] if len(items) == 1 else None
        batch: list[T]
        if only is not None:  # the usual: one item
            end, batch = 1, [only]
        else:
            end = items.index(None) if None in items else len(items)
            batch = [i for i in items[:end] if i is not None]
        assert self._write_nowait is not None
        try:
            size = only.ByteSize() if only is not None else sum(i.ByteSize() for i in batch)
            if batch and size <= self._limit and self._write_nowait(batch):
                items = items[end:]
        except Exception:  # a bug: said, and the writer task sends them (or fails too)
            log.exception("sending %d items from the loop callback failed", len(batch))
        for i in items:
            self._queue.put_nowait(i)

    async def run(self) -> None:
        """The writer task: writes the queue's batches in order until the end; what
        ``write`` raises ends it."""
        async for batch in queued_batches(self._queue, self._limit):
            self._writing = True
            try:
                await self._write(batch)
            finally:
                self._writing = False
