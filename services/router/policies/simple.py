"""Baseline policies: round robin and least loaded."""

from __future__ import annotations

from collections.abc import Sequence

from services.router.policies.base import Decision, RouteContext, WorkerState


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
    return max(w.num_running + w.num_waiting, w.in_flight) + w.kv_usage


class LeastLoaded:
    """Picks the candidate with the lowest load; ties go to the lowest instance id."""

    name = "least_loaded"

    def select(self, ctx: RouteContext, candidates: Sequence[WorkerState]) -> Decision:
        """The candidate minimising :func:`load_of`."""
        best = min(candidates, key=lambda w: (load_of(w), w.instance_id))
        return Decision(best.instance_id, f"least loaded (load {load_of(best):.2f})")
