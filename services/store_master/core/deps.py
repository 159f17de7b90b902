"""What the core takes from outside: a clock and a random source (both injected).

- :data:`Clock`: a callable returning seconds. The store master process passes wall time
  (``time.time``) so deadlines persisted in Redis survive a restart; tests pass a fake
  clock they advance.
- :class:`Rng`: the two methods of ``random.Random`` the core draws with (a seeded
  ``random.Random`` satisfies it); ``main.py`` creates it from ``--seed``.
"""

from __future__ import annotations

from collections.abc import Callable, MutableSequence, Sequence
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

Clock = Callable[[], float]


class Rng(Protocol):
    def shuffle(self, x: MutableSequence[Any]) -> None:
        """Shuffles ``x`` in place."""
        ...

    def sample(self, population: Sequence[T], k: int) -> list[T]:
        """``k`` distinct elements of ``population``, in random order."""
        ...
