"""services.common.batching.queued_batches: what a queue holds, in order, in batches
within a byte limit, ended by the queue's None."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from services.common.batching import queued_batches


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
