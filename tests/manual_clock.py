"""A clock that moves only when a test says so, for code that takes ``clock=``."""

from __future__ import annotations


class Clock:
    """Callable clock: ``clock()`` is the current time; ``advance(dt)`` moves it on."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> float:
        self.t += dt
        return self.t
