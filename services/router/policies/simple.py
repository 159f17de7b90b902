"""Baseline policies: round robin, least loaded and (seeded) random.

Contract: each ``select`` returns one of the non-empty candidates; see each class.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.router.policies.base import Decision, Rng, RouteContext, WorkerState, queue_of


class RoundRobin:
    """Cycles through the candidates in instance-id order."""

    name = "round_robin"

    def __init__(self) -> None:
        self._cursor = 0

    def select(self, ctx: RouteContext, candidates: Sequence[WorkerState]) -> Decision:
        """The next candidate after the previous pick (wrapping around)."""
        w = candidates[self._cursor % len(candidates)]
        self._cursor += 1
        return Decision(w.instance_id, f"round robin slot {(self._cursor - 1) % len(candidates)}")


def load_of(w: WorkerState) -> float:
    """Load score: queued and running requests (the larger of the engine report and the
    router's own in-flight count, which is fresher), then KV usage to break ties."""
    return queue_of(w) + w.kv_usage


class LeastLoaded:
    """Picks the candidate with the lowest load; ties go to the lowest instance id."""

    name = "least_loaded"

    def select(self, ctx: RouteContext, candidates: Sequence[WorkerState]) -> Decision:
        """The candidate minimising :func:`load_of`."""
        best = min(candidates, key=lambda w: (load_of(w), w.instance_id))
        return Decision(best.instance_id, f"least loaded (load {load_of(best):.2f})")


class RandomPolicy:
    """Uniformly random candidate from the injected (seeded) RNG."""

    name = "random"

    def __init__(self, rng: Rng) -> None:
        self._rng = rng

    def select(self, ctx: RouteContext, candidates: Sequence[WorkerState]) -> Decision:
        """A uniformly drawn candidate."""
        w = self._rng.choice(list(candidates))
        return Decision(w.instance_id, "random")
