"""Router policy plugin interface.

Contract:

- A policy is any object with a ``name`` and ``select(ctx, candidates) -> Decision``.
  ``candidates`` is non-empty, sorted by instance id, and holds only workers that can
  serve the request. ``select`` must return one of them and must not mutate them.
  Policies may keep their own state (a round-robin cursor, a request-history tree).
- Policies are created by name through :class:`PolicyRegistry` (see ``registry.py``);
  later policies (KV-aware cost, approximate cache, P/D selection) plug in the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class RouteContext:
    """One request as the router sees it."""

    request_id: str
    model: str
    token_ids: Sequence[int] = field(default_factory=tuple)


@dataclass(frozen=True)
class WorkerState:
    """A candidate worker with its latest load and the router's own in-flight count."""

    instance_id: str
    address: str
    block_size: int
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    in_flight: int = 0


@dataclass(frozen=True)
class Decision:
    """The chosen worker and why."""

    worker_id: str
    reason: str


class Policy(Protocol):
    """A routing policy plugin."""

    name: str

    def select(self, ctx: RouteContext, candidates: Sequence[WorkerState]) -> Decision:
        """Picks one of ``candidates`` (non-empty) for ``ctx``."""
        ...
