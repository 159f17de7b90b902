"""Periodic: calls, backoff on failure, progress resets, stop; cancel_and_wait."""

from __future__ import annotations

import asyncio

import pytest

from services.common.periodic import Periodic, cancel_and_wait


def test_backoff_doubles_up_to_the_cap_and_progress_resets_it() -> None:
    p = Periodic("t", lambda: asyncio.sleep(0), 1.0, max_backoff_s=5.0)  # a no-op fn
    assert p.next_delay() == 1.0
    delays = []
    for _ in range(4):
        p.failures += 1
        delays.append(p.next_delay())
    assert delays == [2.0, 4.0, 5.0, 5.0]
    p.note_progress()
    assert p.failures == 0 and p.next_delay() == 1.0


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        Periodic("t", lambda: asyncio.sleep(0), 0)  # a no-op fn; never run


async def test_failures_are_counted_and_a_success_resets_them() -> None:
    outcomes = iter([False, False, True, False])
    done = asyncio.Event()
    seen: list[int] = []

    async def fn() -> None:
        seen.append(p.failures)
        ok = next(outcomes, None)
        if ok is None:
            done.set()
            return
        if not ok:
            raise RuntimeError("boom")

    p = Periodic("t", fn, 0.001, max_backoff_s=0.004)
    p.start()
    await asyncio.wait_for(done.wait(), 30)
    await p.stop()
    # failures in a row as seen by each call: 0, 1, 2, then reset by the success, then 1
    assert seen == [0, 1, 2, 0, 1]
    assert not p.running
    await p.stop()  # idempotent


async def test_cancel_and_wait_stops_a_task_and_tolerates_none() -> None:
    task = asyncio.create_task(asyncio.sleep(3600))  # a task that never ends by itself
    await cancel_and_wait(task)
    assert task.cancelled()
    await cancel_and_wait(None)


async def test_an_outage_is_logged_once_with_traceback_then_sparsely(
        caplog: pytest.LogCaptureFixture) -> None:
    done = asyncio.Event()

    async def fn() -> None:
        if p.failures_total == 20:
            done.set()
            return
        raise RuntimeError("redis down")

    p = Periodic("outage", fn, 0.001, max_backoff_s=0.001)
    with caplog.at_level("WARNING", logger="services.common.periodic"):
        p.start()
        await asyncio.wait_for(done.wait(), 30)
        await p.stop()
    records = [r for r in caplog.records if "outage" in r.getMessage()]
    # failures 1 (traceback), then 2, 4, 8, 16 as one-line warnings
    assert [r.exc_info is not None for r in records] == [True, False, False, False, False]
    assert "16 in a row" in records[-1].getMessage()
    assert p.failures_total == 20 and p.failures == 0
