"""An asyncio event loop on virtual time, for tests of code that takes a ``clock``.

Contract:

- :class:`VirtualTimeLoop` is a selector event loop whose ``time()`` starts at 0 and only
  moves when the loop would otherwise wait: instead of blocking until its next timer, it
  jumps straight to it. Sleeps, ``wait_for`` timeouts and ``call_later`` therefore take no
  real time, and ``loop.time`` is an exact clock of the modelled durations. Pass
  ``loop.time`` as the code's ``clock``.
- Ready I/O is still served (polled without blocking). With no timer pending and nothing
  ready it blocks on I/O as usual.
- :func:`run_virtual` runs one coroutine to completion on a fresh loop and closes it.
  Only pure-asyncio code belongs here: a thread or process doing real work meanwhile sees
  virtual time race ahead of it.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _JumpingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """A selector that never waits for a timer: it moves the loop's clock instead."""

    def __init__(self, advance: Callable[[float], None]) -> None:
        super().__init__()
        self._advance = advance

    def select(self, timeout: float | None = None) -> list[tuple[Any, int]]:
        if timeout is None:
            return super().select(None)  # type: ignore[no-any-return]
        events: list[tuple[Any, int]] = super().select(0)
        if not events and timeout > 0:
            self._advance(timeout)
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """See the module docstring."""

    def __init__(self) -> None:
        self._now = 0.0
        super().__init__(_JumpingSelector(self._advance))

    def _advance(self, seconds: float) -> None:
        self._now += seconds

    def time(self) -> float:
        return self._now


def run_virtual(make: Callable[[VirtualTimeLoop], Coroutine[Any, Any, T]]) -> T:
    """Runs ``make(loop)`` on a fresh :class:`VirtualTimeLoop`; returns its result."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(make(loop))
    finally:
        loop.close()
