"""Waiting in tests: poll a condition until it holds, or fail the test.

Contract:

- :func:`wait_for` (async) calls ``predicate()`` (a plain function or one returning an
  awaitable) until it returns something truthy and returns that value. If ``timeout_s``
  (wall-clock seconds: a bound on how long the test may hang, never a timing assertion)
  passes first, it raises :class:`AssertionError` naming ``what`` and the last value the
  predicate returned. ``what`` may be a string or a function returning one, evaluated only
  on failure (so it can describe the state at that moment). An exception raised by the
  predicate propagates at once.
- :func:`wait_for_sync` is the same for code that runs without an event loop.
- The poll interval (``interval_s``) only spaces the checks; correctness never depends on
  it.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")
What = str | Callable[[], str]


def _fail(what: What, timeout_s: float, last: object) -> AssertionError:
    text = what() if callable(what) else what
    return AssertionError(f"timed out after {timeout_s}s waiting for {text} "
                          f"(last observed: {last!r})")


@overload
async def wait_for(predicate: Callable[[], Awaitable[T]], timeout_s: float, what: What,
                   interval_s: float = ...) -> T: ...


@overload
async def wait_for(predicate: Callable[[], T], timeout_s: float, what: What,
                   interval_s: float = ...) -> T: ...


async def wait_for(predicate: Callable[[], Any], timeout_s: float, what: What,
                   interval_s: float = 0.05) -> Any:
    """Polls ``predicate`` until truthy; see the module docstring."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        last = await value if inspect.isawaitable(value) else value
        if last:
            return last
        if time.monotonic() >= deadline:
            raise _fail(what, timeout_s, last)
        await asyncio.sleep(interval_s)  # poll interval between checks, not synchronisation


def wait_for_sync(predicate: Callable[[], T], timeout_s: float, what: What,
                  interval_s: float = 0.05) -> T:
    """:func:`wait_for` without an event loop (blocks the calling thread)."""
    deadline = time.monotonic() + timeout_s
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise _fail(what, timeout_s, last)
        time.sleep(interval_s)  # poll interval between checks, not synchronisation
