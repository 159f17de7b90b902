"""The router's pure core: the candidate set, load tracking and policy dispatch.

No grpc, etcd or asyncio here; the service feeds discovery changes and load reports in,
and asks for decisions.

Contract of :class:`RouterCore`:

- ``set_workers(records)`` replaces the candidate set with the live discovery records
  (workers whose lease expired are simply absent). Load and in-flight state of workers
  that vanished is dropped.
- ``update_load(worker_id, load)`` stores the latest load report of a worker.
- ``route(request)`` picks a worker for ``request.model`` among the workers serving it with
  a role that can produce tokens (agg; decode workers arrive with P/D routing). Raises
  :class:`UnknownModel` when no worker ever served the model name, :class:`NoWorkers`
  when it is known but has no candidate now. The chosen worker's in-flight count grows
  until ``release(request_id)``.
- ``release(request_id)`` ends the request's accounting; False when unknown.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from services.router.policies.base import Decision, Policy, RouteContext, WorkerState

GENERATING_ROLES = ("agg",)


class RoutingError(Exception):
    """Base of routing failures."""


class UnknownModel(RoutingError):
    """No worker serves this model name."""


class NoWorkers(RoutingError):
    """The model is known but no worker can take the request now."""


@dataclass(frozen=True)
class WorkerRecord:
    """What the router needs to know about a worker from discovery."""

    instance_id: str
    address: str
    model: str
    role: str
    block_size: int
    max_model_len: int


@dataclass
class _Load:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0


@dataclass
class RouterCore:
    """Routing state; see the module docstring."""

    policy: Policy
    _workers: dict[str, WorkerRecord] = field(default_factory=dict)
    _loads: dict[str, _Load] = field(default_factory=dict)
    _in_flight: dict[str, str] = field(default_factory=dict)  # request id -> worker id
    _known_models: set[str] = field(default_factory=set)

    def set_workers(self, records: Iterable[WorkerRecord]) -> None:
        """Replaces the candidate set."""
        self._workers = {r.instance_id: r for r in records}
        self._known_models.update(r.model for r in self._workers.values())
        for wid in list(self._loads):
            if wid not in self._workers:
                del self._loads[wid]

    def workers(self, model: str = "") -> list[WorkerRecord]:
        """Live workers, optionally only those serving ``model``, sorted by id."""
        return sorted(
            (w for w in self._workers.values() if not model or w.model == model),
            key=lambda w: w.instance_id,
        )

    def models(self) -> dict[str, list[WorkerRecord]]:
        """Live workers grouped by model name."""
        out: dict[str, list[WorkerRecord]] = {}
        for w in self.workers():
            out.setdefault(w.model, []).append(w)
        return out

    def update_load(self, worker_id: str, num_running: int, num_waiting: int,
                    kv_usage: float) -> None:
        """Stores a worker's latest load report (ignored for unknown workers)."""
        if worker_id in self._workers:
            self._loads[worker_id] = _Load(num_running, num_waiting, kv_usage)

    def in_flight(self) -> Mapping[str, int]:
        """Requests routed and not yet released, per worker id."""
        counts: dict[str, int] = {}
        for wid in self._in_flight.values():
            counts[wid] = counts.get(wid, 0) + 1
        return counts

    def _states(self, candidates: list[WorkerRecord]) -> list[WorkerState]:
        flight = self.in_flight()
        out = []
        for w in candidates:
            load = self._loads.get(w.instance_id, _Load())
            out.append(WorkerState(
                instance_id=w.instance_id, address=w.address, block_size=w.block_size,
                num_running=load.num_running, num_waiting=load.num_waiting,
                kv_usage=load.kv_usage, in_flight=flight.get(w.instance_id, 0),
            ))
        return out

    def route(self, ctx: RouteContext) -> tuple[WorkerRecord, Decision]:
        """Chooses a worker for ``ctx``; see the module docstring."""
        serving = [w for w in self._workers.values() if w.model == ctx.model]
        if not serving:
            if ctx.model in self._known_models:
                raise NoWorkers(f"model {ctx.model!r} has no live worker")
            raise UnknownModel(f"model {ctx.model!r} is not served here")
        candidates = sorted(
            (w for w in serving if w.role in GENERATING_ROLES), key=lambda w: w.instance_id
        )
        if not candidates:
            raise NoWorkers(f"model {ctx.model!r} has no worker that can generate")
        decision = self.policy.select(ctx, self._states(candidates))
        if ctx.request_id in self._in_flight:
            raise RoutingError(f"request id {ctx.request_id!r} is already in flight")
        self._in_flight[ctx.request_id] = decision.worker_id
        return self._workers[decision.worker_id], decision

    def release(self, request_id: str) -> bool:
        """Stops counting ``request_id`` as load. False when it was not in flight."""
        return self._in_flight.pop(request_id, None) is not None
