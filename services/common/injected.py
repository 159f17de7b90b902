"""What pure cores take from outside instead of importing ``time`` or ``random``.

- :data:`Clock`: a callable returning seconds. Processes pass ``time.monotonic`` (or
  ``time.time`` where deadlines are persisted and must survive a restart, as in the
  store master); the offline simulation passes its virtual clock; tests pass a clock
  they advance (``tests/manual_clock.py``).
- :class:`Rng`: the methods of ``random.Random`` the cores draw with; a
  ``random.Random`` seeded in ``main.py`` (``--seed``) satisfies it.
"""

from __future__ import annotations

from collections.abc import Callable, MutableSequence, Sequence
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

Clock = Callable[[], float]


class Rng(Protocol):
    """The random source a core is given (``random.Random`` satisfies it)."""

    def random(self) -> float:
        """A float in [0, 1)."""
        ...

    def choice(self, seq: Sequence[T]) -> T:
        """One element of the non-empty ``seq``, uniformly."""
        ...

    def choices(self, population: Sequence[T], weights: Sequence[float] | None = None, *,
                k: int = 1) -> list[T]:
        """``k`` elements drawn with replacement, with relative ``weights``."""
        ...

    def shuffle(self, x: MutableSequence[Any]) -> None:
        """Shuffles ``x`` in place."""
        ...

    def sample(self, population: Sequence[T], k: int) -> list[T]:
        """``k`` distinct elements of ``population``, in random order."""
        ...
