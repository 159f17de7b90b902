"""services.common.batching.queued_batches: what a queue holds, in order, in batches
within a byte limit, ended by the queue's None."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import pytest

from services.common.batching import Outbox, queued_batches


@dataclass
class Item:
    name: str
    size: int

    def ByteSize(self) -> int:  # noqa: N802 - protobuf's name
        return self.size


async def collect(queue: asyncio.Queue[Item | None], limit: int) -> list[list[str]]:
    return [[i.name for i in batch] async for batch in queued_batches(queue, limit)]


async def test_what_is_queued_goes_together_in_order_within_the_limit() -> None:
    queue: asyncio.Queue[Item | None] = asyncio.Queue()
    for name, size in [("a", 4), ("b", 4), ("c", 3), ("big", 50), ("d", 1), ("e", 9),
                       ("f", 1)]:
        queue.put_nowait(Item(name, size))
    queue.put_nowait(None)
    queue.put_nowait(Item("after-end", 1))  # never taken: the batches ended at None
    # a+b+c = 11 > 10: c starts the next batch; big goes alone; d+e = 10 fits
    assert await collect(queue, 10) == [["a", "b"], ["c"], ["big"], ["d", "e"], ["f"]]
    assert queue.qsize() == 1


async def test_a_lone_item_is_not_held_back() -> None:
    queue: asyncio.Queue[Item | None] = asyncio.Queue()
    batches = queued_batches(queue, 100)
    queue.put_nowait(Item("a", 1))
    assert [i.name for i in await anext(batches)] == ["a"]  # nothing behind it: at once
    queue.put_nowait(Item("b", 1))
    queue.put_nowait(Item("c", 1))
    assert [i.name for i in await anext(batches)] == ["b", "c"]
    queue.put_nowait(None)
    assert [b async for b in batches] == []


class Conn:
    """A connection for an Outbox: records each batch and how it went (``now``: the
    loop callback's ``write_nowait``; ``task``: the writer's ``write``)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, list[str]]] = []
        self.takes_now = True
        self.hold = asyncio.Event()
        self.hold.set()

    def write_nowait(self, batch: list[Item]) -> bool:
        if self.takes_now:
            self.sent.append(("now", [i.name for i in batch]))
        return self.takes_now

    async def write(self, batch: list[Item]) -> None:
        self.sent.append(("task", [i.name for i in batch]))
        await self.hold.wait()


async def turn() -> None:
    """Until the loop callbacks scheduled before this call have run (they run in order)."""
    fut = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(fut.set_result, None)
    await fut


async def test_an_outbox_sends_one_turn_s_items_in_one_batch_from_the_callback() -> None:
    conn = Conn()
    box: Outbox[Item] = Outbox(conn.write, conn.write_nowait, limit_bytes=10)
    writer = asyncio.ensure_future(box.run())
    for name in "abc":
        box.post(Item(name, 1))
    assert conn.sent == []  # at the end of the turn
    await turn()
    assert conn.sent == [("now", ["a", "b", "c"])]
    box.post(Item("big", 11))  # over the limit: the writer task sends it
    box.post(Item("d", 1))
    box.post(None)
    await asyncio.wait_for(writer, 10)  # the end comes after what was posted before it
    assert conn.sent[1:] == [("task", ["big"]), ("task", ["d"])]


async def test_an_outbox_keeps_the_order_when_the_writer_holds_a_batch() -> None:
    conn = Conn()
    box: Outbox[Item] = Outbox(conn.write, conn.write_nowait)
    writer = asyncio.ensure_future(box.run())
    conn.takes_now, conn.hold = False, asyncio.Event()  # back-pressure, a write that waits
    box.post(Item("a", 1))
    await turn()  # refused by the connection: the writer's now ...
    await turn()  # ... and in its hand
    conn.takes_now = True
    box.post(Item("b", 1))  # behind the batch in hand: not the callback's
    box.post(Item("c", 1))
    await turn()
    assert conn.sent == [("task", ["a"])]
    conn.hold.set()
    box.post(None)
    await asyncio.wait_for(writer, 10)
    assert conn.sent == [("task", ["a"]), ("task", ["b", "c"])]


async def test_an_outbox_not_direct_or_closed_leaves_the_callback_out() -> None:
    conn = Conn()
    box: Outbox[Item] = Outbox(conn.write, conn.write_nowait, direct=False)
    box.post(Item("a", 1))  # to the writer's queue (not run yet)
    box.direct = True
    box.post(Item("b", 1))  # behind the queued one
    writer = asyncio.ensure_future(box.run())
    await turn()
    await turn()
    assert conn.sent == [("task", ["a", "b"])]
    box.post(Item("c", 1))  # the callback's ...
    box.closed = True  # ... dropped: the connection is gone
    await turn()
    assert conn.sent == [("task", ["a", "b"])]
    writer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await writer


class Unsized(Item):
    def ByteSize(self) -> int:  # noqa: N802 - protobuf's name
        raise RuntimeError("no size")


async def test_an_outbox_s_lone_item_takes_the_callback_within_the_limit_only(
        caplog: pytest.LogCaptureFixture) -> None:
    conn = Conn()
    box: Outbox[Item] = Outbox(conn.write, conn.write_nowait, limit_bytes=10)
    writer = asyncio.ensure_future(box.run())
    box.post(Item("a", 10))
    await turn()
    assert conn.sent == [("now", ["a"])]
    box.post(Item("big", 11))  # alone and over the limit: the writer task's
    await turn()
    await turn()
    assert conn.sent[1:] == [("task", ["big"])]
    box.post(Unsized("odd", 0))  # a size that raises: said, and the writer task's
    await turn()
    assert "sending 1 items from the loop callback failed" in caplog.text
    with pytest.raises(RuntimeError, match="no size"):
        await asyncio.wait_for(writer, 10)  # the writer fails too: nothing hangs
