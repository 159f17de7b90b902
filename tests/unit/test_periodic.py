"""Periodic: calls, backoff on failure, progress resets, stop; cancel_and_wait."""

from __future__ import annotations

import asyncio

import pytest

from services.common import periodic
from services.common.periodic import Periodic, cancel_and_wait
from tests.virtual_time import VirtualTimeLoop, run_virtual


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


async def test_cancel_and_wait_logs_an_error_the_task_had_ended_with(
        caplog: pytest.LogCaptureFixture) -> None:
    async def fails() -> None:
        raise ValueError("lost")

    task = asyncio.create_task(fails(), name="failing-task")
    await asyncio.wait([task])
    with caplog.at_level("ERROR", logger="services.common.periodic"):
        await cancel_and_wait(task)  # does not raise
    (record,) = caplog.records
    assert "failing-task" in record.getMessage() and record.exc_info is not None


def test_delay_first_waits_one_interval_and_a_stopped_loop_restarts() -> None:
    """On virtual time (tests/virtual_time.py), so the call times are exact."""

    async def scenario(loop: VirtualTimeLoop) -> list[float]:
        calls: list[float] = []
        ran = asyncio.Event()

        async def fn() -> None:
            calls.append(loop.time())
            ran.set()

        p = Periodic("t", fn, 0.5, delay_first=True)
        p.start()
        await ran.wait()
        await asyncio.sleep(1.2)  # virtual: two more calls, at 1.0 and 1.5
        await p.stop()
        assert not p.running
        ran.clear()
        restarted_at = loop.time()
        p.start()
        await ran.wait()
        await p.stop()
        return [*calls, restarted_at]

    *calls, restarted_at = run_virtual(scenario)
    assert calls[:3] == [0.5, 1.0, 1.5]
    assert calls[3] == restarted_at + 0.5  # a restarted loop waits its first interval again


async def test_stop_ends_a_loop_whose_fn_swallowed_the_cancel() -> None:
    entered = asyncio.Event()

    async def swallowing() -> None:  # as a lost cancel inside redis-py looks from outside
        entered.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass

    loop = Periodic("swallower", swallowing, 3600)
    loop.start()
    await entered.wait()
    await asyncio.wait_for(loop.stop(), 30)  # hang guard only
    assert not loop.running and loop.calls == 1


async def test_cancel_and_wait_cancels_again_until_the_task_ends(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(periodic, "RECANCEL_S", 0.01)
    cancels = 0

    async def stubborn() -> None:
        nonlocal cancels
        while cancels < 3:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels += 1

    task = asyncio.ensure_future(stubborn())
    await asyncio.sleep(0)  # reason: let the task reach its first sleep
    await asyncio.wait_for(periodic.cancel_and_wait(task), 30)  # hang guard only
    assert cancels == 3 and task.done()
    assert sum("cancelling it again" in r.getMessage() for r in caplog.records) == 2
