"""The router's pure core: the candidate set, load tracking, P/D selection.

No grpc, etcd or asyncio here; the service feeds discovery changes and load reports in,
and asks for decisions.

Contract of :class:`RouterCore`:

- ``set_workers(records)`` replaces the candidate set with the live discovery records
  (workers whose lease expired are simply absent); state of vanished workers is dropped.
- ``update_load(worker_id, ...)`` stores the latest load report of a worker.
- ``route(ctx)`` returns a :class:`RoutePlan`:
  - with aggregated workers only: one of them, picked by ``policy``;
  - with decode workers: a decode worker, plus a prefill worker when the request is
    disaggregated. Order ``prefill_first`` (Dynamo) picks P, then a compatible D, then
    applies conditional disaggregation; ``decode_first`` (llm-d) picks D, then asks the
    prefix decider whether a remote P is needed and picks a compatible one.
  Raises :class:`UnknownModel` when no worker ever served the model, :class:`NoWorkers`
  when none can take it now, :class:`Incompatible` when prefill and decode workers exist
  but no pair can hand KV to each other (layout, block size or mode differ).
  The chosen workers count the request as in flight until ``release(request_id)``.
- Overlap predictions come from :class:`PrefixHistory` (the router's own decisions).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from services.common.block_hash import block_hashes
from services.router.disagg import (
    DisaggConfig,
    PairInfo,
    bypass_prefill,
    decode_first_needs_prefill,
    incompatibility,
)
from services.router.history import PrefixHistory
from services.router.policies.base import Policy, RouteContext, WorkerState


class RoutingError(Exception):
    """Base of routing failures."""


class UnknownModel(RoutingError):
    """No worker serves this model name."""


class NoWorkers(RoutingError):
    """The model is known but no worker can take the request now."""


class Incompatible(RoutingError):
    """Prefill and decode workers exist, but no pair can hand KV over."""


@dataclass(frozen=True)
class WorkerRecord:
    """What the router needs to know about a worker from discovery."""

    instance_id: str
    address: str
    model: str
    role: str
    block_size: int
    max_model_len: int
    handoff_mode: str = ""
    kv_layout: str = ""

    def pair_info(self) -> PairInfo:
        return PairInfo(self.instance_id, self.handoff_mode, self.block_size, self.kv_layout)


@dataclass(frozen=True)
class RoutePlan:
    """The decision for one request."""

    worker: WorkerRecord
    prefill: WorkerRecord | None
    policy: str
    reason: str
    overlap_blocks: int = 0
    prefill_overlap_blocks: int = 0

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None


@dataclass
class _Load:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0


@dataclass
class RouterCore:
    """Routing state; see the module docstring."""

    policy: Policy
    prefill_policy: Policy | None = None
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    history: PrefixHistory = field(default_factory=PrefixHistory)
    _workers: dict[str, WorkerRecord] = field(default_factory=dict)
    _loads: dict[str, _Load] = field(default_factory=dict)
    _in_flight: dict[str, tuple[str, ...]] = field(default_factory=dict)
    _known_models: set[str] = field(default_factory=set)

    def set_workers(self, records: Iterable[WorkerRecord]) -> None:
        """Replaces the candidate set."""
        self._workers = {r.instance_id: r for r in records}
        self._known_models.update(r.model for r in self._workers.values())
        for wid in [w for w in self._loads if w not in self._workers]:
            del self._loads[wid]
        self.history.keep_only(self._workers)

    def workers(self, model: str = "") -> list[WorkerRecord]:
        """Live workers, optionally only those serving ``model``, sorted by id."""
        return sorted(
            (w for w in self._workers.values() if not model or w.model == model),
            key=lambda w: w.instance_id,
        )

    def update_load(self, worker_id: str, num_running: int, num_waiting: int,
                    kv_usage: float) -> None:
        """Stores a worker's latest load report (ignored for unknown workers)."""
        if worker_id in self._workers:
            self._loads[worker_id] = _Load(num_running, num_waiting, kv_usage)

    def in_flight(self) -> Mapping[str, int]:
        """Requests routed and not yet released, per worker id."""
        counts: dict[str, int] = {}
        for wids in self._in_flight.values():
            for wid in wids:
                counts[wid] = counts.get(wid, 0) + 1
        return counts

    def _states(self, candidates: Iterable[WorkerRecord]) -> list[WorkerState]:
        flight = self.in_flight()
        out = []
        for w in sorted(candidates, key=lambda w: w.instance_id):
            load = self._loads.get(w.instance_id, _Load())
            out.append(WorkerState(
                instance_id=w.instance_id, address=w.address, block_size=w.block_size,
                num_running=load.num_running, num_waiting=load.num_waiting,
                kv_usage=load.kv_usage, in_flight=flight.get(w.instance_id, 0),
            ))
        return out

    def _pick(self, policy: Policy, ctx: RouteContext,
              candidates: list[WorkerRecord]) -> tuple[WorkerRecord, str]:
        decision = policy.select(ctx, self._states(candidates))
        return self._workers[decision.worker_id], decision.reason

    def _queue(self, w: WorkerRecord) -> int:
        load = self._loads.get(w.instance_id, _Load())
        return max(load.num_waiting + load.num_running, self.in_flight().get(w.instance_id, 0))

    def route(self, ctx: RouteContext) -> RoutePlan:
        """Chooses worker(s) for ``ctx``; see the module docstring."""
        if ctx.request_id in self._in_flight:
            raise RoutingError(f"request id {ctx.request_id!r} is already in flight")
        serving = [w for w in self._workers.values() if w.model == ctx.model]
        if not serving:
            if ctx.model in self._known_models:
                raise NoWorkers(f"model {ctx.model!r} has no live worker")
            raise UnknownModel(f"model {ctx.model!r} is not served here")
        decode = [w for w in serving if w.role == "decode"]
        if decode:
            plan = self._route_pd(ctx, [w for w in serving if w.role == "prefill"], decode)
        else:
            agg = [w for w in serving if w.role == "agg"]
            if not agg:
                raise NoWorkers(f"model {ctx.model!r} has no worker that can generate")
            worker, reason = self._pick(self.policy, ctx, agg)
            hashes = block_hashes(ctx.token_ids, worker.block_size)
            plan = RoutePlan(worker, None, self.policy.name, reason,
                             self.history.overlap(worker.instance_id, hashes))
        hashes = block_hashes(ctx.token_ids, plan.worker.block_size)
        self.history.record(plan.worker.instance_id, hashes)
        ids: tuple[str, ...] = (plan.worker.instance_id,)
        if plan.prefill is not None:
            self.history.record(plan.prefill.instance_id, hashes)
            ids += (plan.prefill.instance_id,)
        self._in_flight[ctx.request_id] = ids
        return plan

    def _compatible_pairs(self, prefill: list[WorkerRecord],
                          decode: list[WorkerRecord]) -> set[tuple[str, str]]:
        pairs = set()
        reasons = []
        for p in prefill:
            for d in decode:
                why = incompatibility(p.pair_info(), d.pair_info())
                if why is None:
                    pairs.add((p.instance_id, d.instance_id))
                else:
                    reasons.append(why)
        if prefill and not pairs:
            raise Incompatible("no prefill worker can hand KV to a decode worker: "
                               + "; ".join(sorted(set(reasons))))
        return pairs

    def _route_pd(self, ctx: RouteContext, prefill: list[WorkerRecord],
                  decode: list[WorkerRecord]) -> RoutePlan:
        pairs = self._compatible_pairs(prefill, decode)
        policy_p = self.prefill_policy or self.policy
        n = len(ctx.token_ids)
        if self.disagg.order == "decode_first" or not prefill:
            d, d_reason = self._pick(self.policy, ctx, decode)
            overlap = self.history.overlap(d.instance_id, block_hashes(ctx.token_ids,
                                                                       d.block_size))
            partners = [p for p in prefill if (p.instance_id, d.instance_id) in pairs]
            if not partners:
                why = "no prefill worker" if not prefill else f"no prefill worker pairs with " \
                    f"{d.instance_id}"
                return RoutePlan(d, None, self.policy.name, f"{d_reason}; {why}", overlap)
            need, why = decode_first_needs_prefill(n, overlap, d.block_size,
                                                   self.disagg.decode_first_threshold)
            if not need:
                return RoutePlan(d, None, self.policy.name, f"{d_reason}; {why}", overlap)
            p, p_reason = self._pick(policy_p, ctx, partners)
            return RoutePlan(d, p, self.policy.name, f"decode first: {d_reason}; {why}; "
                             f"prefill {p_reason}", overlap,
                             self.history.overlap(p.instance_id,
                                                  block_hashes(ctx.token_ids, p.block_size)))
        paired_p = [p for p in prefill if any((p.instance_id, d.instance_id) in pairs
                                              for d in decode)]
        p, p_reason = self._pick(policy_p, ctx, paired_p)
        partners = [d for d in decode if (p.instance_id, d.instance_id) in pairs]
        d, d_reason = self._pick(self.policy, ctx, partners)
        hashes = block_hashes(ctx.token_ids, d.block_size)
        overlap = self.history.overlap(d.instance_id, hashes)
        bypass, why = bypass_prefill(n, overlap, d.block_size, self._queue(p), self.disagg)
        if bypass:
            return RoutePlan(d, None, self.policy.name, f"{d_reason}; {why}", overlap)
        return RoutePlan(d, p, self.policy.name, f"prefill first: prefill {p_reason}; "
                         f"decode {d_reason}; {why}", overlap,
                         self.history.overlap(p.instance_id, hashes))

    def release(self, request_id: str) -> bool:
        """Stops counting ``request_id`` as load. False when it was not in flight."""
        return self._in_flight.pop(request_id, None) is not None
