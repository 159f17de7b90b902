"""Background tasks: one periodic loop and one way to stop a task.

Contract:

- :class:`Periodic` calls an async ``fn()`` in its own task, every ``interval_s``.
  ``start()`` (idempotent) creates the task; the first call runs at once unless
  ``delay_first`` is set, in which case it waits one interval first. The interval is
  measured from the end of one call to the start of the next.
  - When ``fn`` raises, the error is logged with the task's name (never swallowed
    silently) and the next call waits ``min(interval_s · 2^k, max_backoff_s)`` after the
    k-th failure in a row (k ≥ 1); a success resets the interval. ``failures`` counts
    failures in a row, ``failures_total`` every failure, ``calls`` every finished call.
  - Logging of an outage stays bounded: the first failure in a row is logged with its
    traceback; later ones as one warning line (the error's repr) when their number in
    the row is a power of two, so a long outage leaves a few lines, not one per try.
  - A long-running ``fn`` (one that loops and returns only by raising, like a stream
    follower) calls ``note_progress()`` whenever it has done useful work, so the failures
    in a row, and with them the backoff, start again from zero.
  - ``CancelledError`` from ``fn`` ends the loop.
  - ``stop()`` cancels the task and waits for it to finish; a loop whose ``fn`` swallowed
    the cancel (Python 3.11's ``wait_for`` can lose one that lands as its inner call
    completes, e.g. inside redis-py) ends after that call instead of sleeping on.
    Idempotent; after it, ``start()`` may start a new task.
- :func:`cancel_and_wait` cancels one task and waits for it, suppressing only its
  ``CancelledError``: an exception the task had already ended with is logged. A task
  still running ``RECANCEL_S`` after the cancel is logged and cancelled again, until it
  ends. A ``None`` task is a no-op.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)


RECANCEL_S = 5.0


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancels ``task`` (if any) and waits for it to end; see the module docstring."""
    if task is None:
        return
    task.cancel()
    while not (await asyncio.wait({task}, timeout=RECANCEL_S))[0]:
        log.warning("task %s is still running %.0fs after its cancel (a swallowed "
                    "CancelledError?); cancelling it again", task.get_name(), RECANCEL_S)
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        try:
            await task
        except Exception:
            log.exception("task %s had failed", task.get_name())


class Periodic:
    """``fn()`` every ``interval_s`` with backoff on error; see the module docstring."""

    def __init__(self, name: str, fn: Callable[[], Awaitable[Any]], interval_s: float, *,
                 delay_first: bool = False, max_backoff_s: float | None = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"{name}: interval_s must be > 0, got {interval_s}")
        self.name = name
        self.interval_s = interval_s
        self.max_backoff_s = max(interval_s, max_backoff_s or interval_s * 8)
        self.failures = 0
        self.failures_total = 0
        self.calls = 0
        self._fn = fn
        self._delay_first = delay_first
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def next_delay(self) -> float:
        """The wait before the next call given the failures in a row so far."""
        if self.failures == 0:
            return self.interval_s
        return min(self.interval_s * 2 ** self.failures, self.max_backoff_s)

    def note_progress(self) -> None:
        """Resets the failures in a row (see the module docstring)."""
        self.failures = 0

    def start(self) -> None:
        """Starts the loop task (no-op while one runs)."""
        if not self.running:
            self._stopping = False
            self._task = asyncio.create_task(self._run(), name=self.name)

    async def _run(self) -> None:
        if self._delay_first:
            await asyncio.sleep(self.interval_s)
        while True:
            try:
                await self._fn()
            except Exception as exc:
                self.failures += 1
                self.failures_total += 1
                self._log_failure(exc)
            else:
                self.failures = 0
            self.calls += 1
            if self._stopping:  # fn swallowed stop()'s cancel
                return
            await asyncio.sleep(self.next_delay())

    def _log_failure(self, exc: Exception) -> None:
        n = self.failures
        if n == 1:
            log.exception("%s failed; next try in %.2fs", self.name, self.next_delay())
        elif n & (n - 1) == 0:
            log.warning("%s still failing (%d in a row): %r; next try in %.2fs", self.name,
                        n, exc, self.next_delay())

    async def stop(self) -> None:
        """Cancels the loop and waits for it. Idempotent."""
        task, self._task = self._task, None
        self._stopping = True
        await cancel_and_wait(task)
