"""The router's pure core: the candidate set, load tracking, P/D selection.

No grpc, etcd or asyncio here; the service feeds discovery changes, load reports and
(optionally) the indexer's overlaps in, and asks for decisions. The worker records,
route plans and routing errors it takes and gives are :mod:`services.router.plan`'s.

Contract of :class:`RouterCore`:

- ``set_workers(records)`` replaces the candidate set with the live discovery records
  (workers whose lease expired are simply absent); state of vanished workers is dropped
  (loads, history, and policy state through the policies' ``keep_only`` hook).
- ``update_load(worker_id, ..., kv_total_blocks=0)`` stores the latest load report;
  ``kv_usage_of(worker_id)`` reads its KV usage back (None before any report).
- ``route(ctx)`` returns a :class:`RoutePlan`:
  - with aggregated workers only: one of them, picked by ``policy``;
  - with decode workers: a decode worker, plus a prefill worker when the request is
    disaggregated. Order ``prefill_first`` (Dynamo) picks P with ``prefill_policy``, then
    a compatible D with ``policy``, then applies conditional disaggregation;
    ``decode_first`` (llm-d) picks D, then asks the prefix decider whether a remote P is
    needed and picks a compatible one. Both decisions use D's predicted overlap. With
    conditional disaggregation on, when Dynamo's rule keeps the remote prefill and the
    decode policy has a ``prefer_local_prefill(ctx, p_state, d_state)`` hook (e.g.
    ``ttft_pd``), its answer (``(local, reason)``, or None: no opinion) decides.
    "P serves whole" (``disagg.prefill_whole``, off by default; order ``prefill_first``
    only): when the chosen P can decode alone
    (:func:`~services.router.disagg.can_decode_alone` of its
    ``WorkerRecord.can_decode_alone``, never an SGLang P), the decode policy's
    ``prefer_prefill_whole(ctx, p_state, d_states)`` hook answers
    ``(whole, reason)`` (None: no opinion, and without the hook) or else the default rule
    :func:`~services.router.disagg.prefill_serves_whole` does, over the predicted KV
    fractions (:func:`~services.router.disagg.kv_after`) of P and of every D that pairs
    with it. A "whole" plan has ``worker`` = P and no ``prefill``: P is accounted as an
    aggregated worker (in flight and pending prefill until released). Live, the frontend
    runs such a plan as an aggregated one on P (see :mod:`services.router.disagg`).
  Raises :class:`AlreadyInFlight` when ``ctx.request_id`` is in flight (routed, not
  released), :class:`UnknownModel` when no worker ever served the model,
  :class:`InvalidRequest` when the prompt (+ ``max_tokens``) exceeds the model's context
  (``check_request``), :class:`NoWorkers` when none can take it now, :class:`Incompatible`
  when prefill and decode workers exist but no pair can hand KV to each other (layout,
  block size or mode differ). A decode worker that cannot prefill alone
  (:func:`~services.router.disagg.can_prefill_locally`: an SGLang decode server) is never
  planned without a P: conditional disaggregation's bypass and decode-first's "no P
  needed" keep the P (the reason says so), and with no P to pair it is
  :class:`Incompatible`.
  Candidates are the model's workers whose ``max_model_len`` (0: unknown, no limit) holds
  prompt + ``max_tokens``, minus ``exclude`` (instance ids never picked for this request,
  in any role; none left → :class:`NoWorkers`), minus the unroutable ones (below).
  The chosen workers count the request as in flight, and its ``ceil(prompt tokens /
  block_size)`` blocks as active, until ``release(request_id)`` (idempotent: False the
  second time) or the in-flight TTL (below).
- ``_commit(request_id, plan, n, max_tokens, hashes)`` admits and records a chosen plan
  (``route``'s last step; :mod:`services.router.plain`'s compact decision ends with it).
- ``check_request(model, prompt_tokens, max_tokens)`` raises :class:`InvalidRequest`
  naming ``token_ids`` (and ``max_tokens``) and the limit when prompt (+ max_tokens > 0)
  exceeds ``context_limit(model)``: the largest ``max_model_len`` of the model's live
  workers (0: no limit known). ``route`` applies it too.
- Failure marks: ``report_failure(worker_id, reason)`` (a caller's call to it failed)
  marks a live worker unroutable at ``clock()`` (a repeated report refreshes the time;
  False, and nothing marked, for an unknown worker). The mark ends when the worker's
  discovery record changes (``set_workers`` sees a different :class:`WorkerRecord`: a
  restart brings a new ``pid`` / ``started_at_ms``, or the worker vanished) or after
  ``failure_hold_s``. A marked worker is not a candidate, with one last resort: when
  every candidate decode worker (or, without decode workers, every aggregated one) is
  marked, the least recently marked ones stay candidates (a mark is a caller's guess and
  may be stale; refusing would turn it into a certain 503), and the plan's reason says
  so. Marked prefill workers have no such fallback: D prefills locally instead.
  ``unroutable()`` lists the live marks (worker id → marked-at); ``unroutable_count()``
  counts them.
- In-flight TTL: every in-flight entry carries its routed-at time. ``expire_in_flight()``
  releases (as ``release`` does: load, pending prefill, admission flight) every request
  routed more than ``inflight_ttl_s`` ago and returns their ids: a caller that never
  released (a bug) is bounded. ``in_flight_count()`` is the number of requests in
  flight (safe to call from another thread).
- Pending prefill: the worker that will prefill the request (the agg worker; P when
  disaggregated; D when it prefills locally) also counts the request's uncached prompt
  tokens (:func:`~services.router.policies.ttft.uncached_tokens`: prompt − its predicted
  overlap · block size) as ``WorkerState.pending_prefill_tokens`` until the prefill is
  over: ``release_prefill(request_id)`` (the first token arrived; idempotent) or
  ``release(request_id)``. For a disaggregated request ``release_prefill`` also ends
  P's share of it: P stops counting it as in flight and its blocks as active (P's part is
  over; counting it until the decode ends made every busy P look full, so conditional
  disaggregation's queue check sent the prompts to D). ``pending_prefill()`` lists the
  totals per worker; they are never negative, and a vanished worker's entries are
  dropped.
- Overlap predictions: ``ctx.overlaps`` when the service gives it (the indexer's answer,
  per worker, with tiers; absent workers hold nothing), else :class:`PrefixHistory` (the
  router's own decisions, counted as device blocks). ``ctx.block_hashes`` may carry the
  prompt's hashes per block size; otherwise the core hashes once per block size.
  The plan reports the source, the predicted overlap of D and P (with tiers) and the
  chosen workers' score and cost when the policy has them.
- Admission (``admission``, a :class:`~services.router.admission.live.RouterAdmission`, None =
  off): ``route(ctx, max_tokens)`` asks it, after the plan is chosen and before anything
  is recorded, whether the request may run on the chosen pair at ``clock()``; a
  rejection raises :class:`Rejected` (carrying the decision) and the request is neither
  in flight nor in the history. Admitted requests are kept as
  :class:`~services.router.admission.live.Flight` records (routed-at time, estimated prefill
  finish) until released; ``plan.admission`` holds the decision. ``flights()`` lists them.
- ``evict(now)`` forwards to the policies' ``evict`` hook (e.g. the approx trees);
  returns how many entries they evicted.
- Replica sync (:mod:`services.router.peers`): ``peers`` holds the other router
  replicas' in-flight shares. ``in_flight()``, ``active_blocks()``, ``pending_prefill()``,
  the policies' :class:`WorkerState` and P's prefill queue count them on top of this
  router's own; ``in_flight_count()`` and ``release`` stay this router's.
  ``local_shares()`` is this router's own part per worker (what it publishes);
  ``set_peer(replica_id, seq, shares)`` applies a peer's snapshot at ``clock()`` (False
  when older than the one applied; a worker whose peer count fell gets its load report
  treated as stale, as after a local release), ``drop_peer`` and
  ``expire_peers(timeout_s)`` forget peers. ``on_change`` (None: nobody) is called after
  every change of this router's own in-flight state (a route, a prefill done, a release).
- The clock (``clock=``, keyword-only, required) is injected: no wall clock is read here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from services.common.block_hash import block_hashes, mm_block_keys
from services.common.injected import Clock
from services.router.admission.core import RequestShape
from services.router.admission.live import DecodeLoadReport, Flight, RouterAdmission
from services.router.disagg import (
    DisaggConfig,
    bypass_prefill,
    can_decode_alone,
    can_prefill_locally,
    decode_first_needs_prefill,
    incompatibility,
    kv_after,
    prefill_serves_whole,
)
from services.router.history import PrefixHistory
from services.router.peers import PeerLoads, Share
from services.router.plan import (
    AlreadyInFlight,
    Incompatible,
    InvalidRequest,
    NoWorkers,
    Rejected,
    RoutePlan,
    RoutingError,
    UnknownModel,
    WorkerRecord,
)
from services.router.policies.base import (
    Decision,
    Policy,
    RouteContext,
    WorkerOverlap,
    WorkerState,
    uncached_tokens,
)


@dataclass(frozen=True)
class _Entry:
    """One in-flight request: ((worker id, active blocks), ...) and when it was routed."""

    workers: tuple[tuple[str, int], ...]
    routed_at: float


@dataclass(frozen=True)
class _Mark:
    """A failure report: when, and the record it was made against."""

    at: float
    record: WorkerRecord
    reason: str


@dataclass(frozen=True)
class _Load:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    kv_total_blocks: int = 0


_NO_LOAD = _Load()  # a worker without a load report yet


class _Prompt:
    """One request's prompt: hashes per block size (computed once) and overlaps."""

    def __init__(self, ctx: RouteContext, history: PrefixHistory) -> None:
        self.ctx = ctx
        self._history = history
        self._hashes: dict[int, Sequence[int]] = dict(ctx.block_hashes or {})
        self.source = "indexer" if ctx.overlaps is not None else "history"

    def hashes(self, block_size: int) -> Sequence[int]:
        if block_size not in self._hashes:
            self._hashes[block_size] = block_hashes(
                self.ctx.token_ids, block_size, salt=self.ctx.cache_salt,
                mm_keys=mm_block_keys(self.ctx.mm_spans, len(self.ctx.token_ids),
                                      block_size) if self.ctx.mm_spans else None)
        return self._hashes[block_size]

    def overlap(self, w: WorkerRecord) -> WorkerOverlap:
        total = len(self.hashes(w.block_size))
        if self.ctx.overlaps is not None:
            got = self.ctx.overlaps.get(w.instance_id)
            if got is None:
                return WorkerOverlap(w.instance_id, 0, {})
            return WorkerOverlap(w.instance_id, min(got.blocks, total),
                                 {t: min(n, total) for t, n in got.by_tier.items() if n})
        n = self._history.overlap(w.instance_id, self.hashes(w.block_size))
        return WorkerOverlap(w.instance_id, n, {"device": n} if n else {})


@dataclass
class RouterCore:
    """Routing state; see the module docstring."""

    policy: Policy
    prefill_policy: Policy | None = None
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    history: PrefixHistory = field(default_factory=PrefixHistory)
    _workers: dict[str, WorkerRecord] = field(default_factory=dict)
    _loads: dict[str, _Load] = field(default_factory=dict)
    _in_flight: dict[str, _Entry] = field(default_factory=dict)
    # _in_flight's totals per worker id (requests, active blocks), kept as entries come
    # and go: a route reads them in O(workers), not O(requests in flight)
    _flight_counts: dict[str, int] = field(default_factory=dict)
    _flight_blocks: dict[str, int] = field(default_factory=dict)
    _known_models: set[str] = field(default_factory=set)
    admission: RouterAdmission | None = None
    # Required, keyword-only: monotonic seconds (the live router's, or a virtual clock).
    clock: Clock = field(kw_only=True)
    _flights: dict[str, Flight] = field(default_factory=dict)
    # request id → (prefilling worker id, uncached tokens); totals per worker id.
    _prefills: dict[str, tuple[str, int]] = field(default_factory=dict)
    _pending: dict[str, int] = field(default_factory=dict)
    # Workers released on since their latest load report: that report still counts the
    # released request (until the next report, only the router's own count is used).
    _stale: set[str] = field(default_factory=set)
    # Seconds a failure report keeps a worker unroutable (unless it re-registers), and
    # after which an in-flight request no one released is dropped.
    failure_hold_s: float = 5.0
    inflight_ttl_s: float = 1800.0
    _marks: dict[str, _Mark] = field(default_factory=dict)
    # Replica sync: the other replicas' shares, and who hears of this one's changes.
    peers: PeerLoads = field(default_factory=PeerLoads)
    on_change: Callable[[], None] | None = None

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _policies(self) -> list[Policy]:
        out = [self.policy]
        if self.prefill_policy is not None and self.prefill_policy is not self.policy:
            out.append(self.prefill_policy)
        return out

    def set_workers(self, records: Iterable[WorkerRecord]) -> None:
        """Replaces the candidate set."""
        self._workers = {r.instance_id: r for r in records}
        self._known_models.update(r.model for r in self._workers.values())
        for wid in [w for w in self._loads if w not in self._workers]:
            del self._loads[wid]
        for rid in [r for r, (w, _) in self._prefills.items() if w not in self._workers]:
            del self._prefills[rid]
        for wid in [w for w in self._pending if w not in self._workers]:
            del self._pending[wid]
        self._stale &= set(self._workers)
        for wid in [w for w, m in self._marks.items() if self._workers.get(w) != m.record]:
            del self._marks[wid]  # re-registered (new record) or vanished
        self.history.keep_only(self._workers)
        self.peers.keep_only(self._workers)
        for policy in self._policies():
            keep_only = getattr(policy, "keep_only", None)
            if callable(keep_only):
                keep_only(set(self._workers))

    def workers(self, model: str = "") -> list[WorkerRecord]:
        """Live workers, optionally only those serving ``model``, sorted by id."""
        return sorted(
            (w for w in self._workers.values() if not model or w.model == model),
            key=lambda w: w.instance_id,
        )

    def update_load(self, worker_id: str, num_running: int, num_waiting: int,
                    kv_usage: float, kv_total_blocks: int = 0) -> None:
        """Stores a worker's latest load report (ignored for unknown workers)."""
        if worker_id in self._workers:
            self._loads[worker_id] = _Load(num_running, num_waiting, kv_usage,
                                           kv_total_blocks)
            self._stale.discard(worker_id)

    def kv_usage_of(self, worker_id: str) -> float | None:
        """The KV usage of ``worker_id``'s latest load report (None before any)."""
        load = self._loads.get(worker_id)
        return load.kv_usage if load is not None else None

    def in_flight(self) -> Mapping[str, int]:
        """Requests routed and not yet released, per worker id (peers' included)."""
        counts = {wid: s.in_flight for wid, s in self.peers.totals().items() if s.in_flight}
        for wid, n in self._flight_counts.items():
            counts[wid] = counts.get(wid, 0) + n
        return counts

    def active_blocks(self) -> Mapping[str, int]:
        """Prompt blocks of requests routed and not yet released, per worker id (peers'
        included)."""
        blocks = {wid: s.active_blocks for wid, s in self.peers.totals().items()
                  if s.active_blocks}
        for wid, n in self._flight_blocks.items():
            blocks[wid] = blocks.get(wid, 0) + n
        return blocks

    def _tally(self, workers: Iterable[tuple[str, int]], sign: int) -> None:
        """Adds (``sign`` 1) or takes (-1) an in-flight entry's workers to or from the
        per-worker totals; a total that reaches 0 is dropped."""
        for wid, blocks in workers:
            for totals, n in ((self._flight_counts, 1), (self._flight_blocks, blocks)):
                left = totals.get(wid, 0) + sign * n
                if left > 0:
                    totals[wid] = left
                else:
                    totals.pop(wid, None)

    def local_shares(self) -> dict[str, Share]:
        """This router's own in-flight load per worker (what replica sync publishes)."""
        flight: dict[str, list[int]] = {}
        for rid, entry in self._in_flight.items():
            alone = len(entry.workers) == 1 and rid not in self._prefills
            for wid, n in entry.workers:
                f = flight.setdefault(wid, [0, 0, 0])
                f[0] += 1
                f[1] += n
                f[2] += alone
        out = {wid: Share(f[0], f[1], self._pending.get(wid, 0), f[2])
               for wid, f in flight.items()}
        for wid, tokens in self._pending.items():
            if wid not in out:
                out[wid] = Share(pending_prefill_tokens=tokens)
        return out

    def _peers_released(self, before: Mapping[str, Share]) -> None:
        """Workers whose peer in-flight count fell since ``before`` (a peers' release):
        their latest load report may still count it, as after a local release."""
        after = self.peers.totals()
        self._stale.update(w for w, s in before.items()
                           if s.in_flight > after.get(w, Share()).in_flight)

    def set_peer(self, replica_id: str, seq: int, shares: Mapping[str, Share]) -> bool:
        """Applies a peer replica's snapshot (see the module docstring)."""
        before = self.peers.totals()
        # shares of workers not (yet) discovered here are kept until the next discovery
        # change: a worker the peer saw first counts as soon as it registers here
        if not self.peers.update(replica_id, seq, shares, self.clock()):
            return False
        self._peers_released(before)
        return True

    def drop_peer(self, replica_id: str, seq: int = 0) -> bool:
        """Forgets a peer replica's shares (it left, ``seq``: its leaving message's); False
        when unknown."""
        before = self.peers.totals()
        if not self.peers.drop(replica_id, seq):
            return False
        self._peers_released(before)
        return True

    def expire_peers(self, timeout_s: float) -> list[str]:
        """Forgets the peers not heard from for more than ``timeout_s``; their ids."""
        before = self.peers.totals()
        gone = self.peers.expire(self.clock(), timeout_s)
        if gone:
            self._peers_released(before)
        return gone

    def in_flight_count(self) -> int:
        """Requests routed and not yet released (one ``len``: safe from another thread)."""
        return len(self._in_flight)

    def expire_in_flight(self) -> list[str]:
        """Releases every request routed more than ``inflight_ttl_s`` ago; their ids."""
        cutoff = self.clock() - self.inflight_ttl_s
        old = [rid for rid, e in self._in_flight.items() if e.routed_at < cutoff]
        for rid in old:
            self.release(rid)
        return old

    def report_failure(self, worker_id: str, reason: str = "") -> bool:
        """Marks a live worker unroutable now (see the module docstring); False when the
        worker is unknown."""
        w = self._workers.get(worker_id)
        if w is None:
            return False
        self._marks[worker_id] = _Mark(self.clock(), w, reason)
        return True

    def unroutable(self) -> dict[str, float]:
        """Live failure marks: worker id → when it was marked (expired ones are dropped)."""
        cutoff = self.clock() - self.failure_hold_s
        for wid in [w for w, m in self._marks.items() if m.at <= cutoff]:
            del self._marks[wid]
        return {w: m.at for w, m in self._marks.items()}

    def unroutable_count(self) -> int:
        """Live failure marks, counted without changing anything (safe from another
        thread: one snapshot of the marks)."""
        cutoff = self.clock() - self.failure_hold_s
        return sum(1 for m in tuple(self._marks.values()) if m.at > cutoff)

    def context_limit(self, model: str) -> int:
        """The largest ``max_model_len`` of ``model``'s live workers (0: none known)."""
        return max([w.max_model_len for w in self._workers.values() if w.model == model],
                   default=0)

    def check_request(self, model: str, prompt_tokens: int, max_tokens: int = 0) -> None:
        """Raises InvalidRequest when the prompt (+ ``max_tokens``) exceeds the model's
        context (see the module docstring)."""
        limit = self.context_limit(model)
        if limit <= 0:
            return
        if prompt_tokens > limit:
            raise InvalidRequest(f"token_ids has {prompt_tokens} tokens, more than the "
                                 f"model's context of {limit} (max_model_len)")
        if max_tokens > 0 and prompt_tokens + max_tokens > limit:
            raise InvalidRequest(f"token_ids ({prompt_tokens}) + max_tokens ({max_tokens}) "
                                 f"exceed the model's context of {limit} (max_model_len)")

    def _last_resort(self, pool: list[WorkerRecord], marks: Mapping[str, float]
                     ) -> tuple[list[WorkerRecord], bool]:
        """The unmarked workers of ``pool``; when all are marked, the least recently
        marked ones (and True)."""
        unmarked = [w for w in pool if w.instance_id not in marks]
        if unmarked or not pool:
            return unmarked, False
        oldest = min(marks[w.instance_id] for w in pool)
        return [w for w in pool if marks[w.instance_id] == oldest], True

    def pending_prefill(self) -> Mapping[str, int]:
        """Uncached prompt tokens whose prefill is not over, per worker id (peers'
        included)."""
        out = {wid: s.pending_prefill_tokens for wid, s in self.peers.totals().items()
               if s.pending_prefill_tokens}
        for wid, n in self._pending.items():
            out[wid] = out.get(wid, 0) + n
        return out

    def evict(self, now: float) -> int:
        """Calls the policies' ``evict(now)`` hooks; returns the entries they evicted."""
        n = 0
        for policy in self._policies():
            evict = getattr(policy, "evict", None)
            if callable(evict):
                n += int(evict(now) or 0)
        return n

    def _states(self, prompt: _Prompt, candidates: Iterable[WorkerRecord]) -> list[WorkerState]:
        flight, active, pending = self.in_flight(), self.active_blocks(), \
            self.pending_prefill()
        trees = prompt.ctx.tree_blocks
        out = []
        for w in sorted(candidates, key=lambda w: w.instance_id):
            load = self._loads.get(w.instance_id, _Load())
            ov = prompt.overlap(w)
            out.append(WorkerState(
                instance_id=w.instance_id, address=w.address, block_size=w.block_size,
                num_running=load.num_running, num_waiting=load.num_waiting,
                kv_usage=load.kv_usage, in_flight=flight.get(w.instance_id, 0),
                active_blocks=active.get(w.instance_id, 0),
                kv_total_blocks=load.kv_total_blocks,
                load_fresh=w.instance_id not in self._stale,
                prompt_blocks=len(prompt.hashes(w.block_size)),
                overlap_blocks=ov.blocks, overlap_by_tier=ov.by_tier,
                tree_blocks=(trees.get(w.instance_id, 0) if trees is not None
                             else self.history.size(w.instance_id)),
                pending_prefill_tokens=pending.get(w.instance_id, 0),
                role=w.role,
            ))
        return out

    def _pick(self, policy: Policy, prompt: _Prompt,
              candidates: list[WorkerRecord]) -> tuple[WorkerRecord, Decision]:
        states = self._states(prompt, candidates)
        ctx = prompt.ctx.for_policies(
            {s.instance_id: WorkerOverlap(s.instance_id, s.overlap_blocks, s.overlap_by_tier)
             for s in states}, states[0].prompt_blocks, prompt.source)
        decision = policy.select(ctx, states)
        if decision.worker_id not in {s.instance_id for s in states}:
            raise RoutingError(f"policy {policy.name!r} chose {decision.worker_id!r}, "
                               "which is not a candidate")
        return self._workers[decision.worker_id], decision

    def _queue(self, w: WorkerRecord) -> int:
        """P's prefill queue for conditional disaggregation: queued + running requests
        (engine report or the router's count, the larger), less the requests P serves
        whole that are past their prefill (they decode there; not P's prefill queue)."""
        load = self._loads.get(w.instance_id, _Load())
        # a P's in-flight entry with P alone is one it serves whole (a P/D entry holds D)
        decoding = sum(1 for rid, entry in self._in_flight.items()
                       if len(entry.workers) == 1 and entry.workers[0][0] == w.instance_id
                       and rid not in self._prefills) \
            + self.peers.totals().get(w.instance_id, Share()).decoding_alone
        return max(load.num_waiting + load.num_running - decoding,
                   self.in_flight().get(w.instance_id, 0) - decoding, 0)

    def flights(self) -> list[Flight]:
        """Admitted requests not yet released (tracked only with admission on)."""
        return list(self._flights.values())

    def _worker_loads(self) -> dict[str, DecodeLoadReport]:
        return {wid: DecodeLoadReport(load.kv_usage, load.kv_total_blocks,
                                self._workers[wid].block_size)
                for wid, load in self._loads.items() if wid in self._workers}

    def _admit(self, plan: RoutePlan, n: int, uncached: int, max_tokens: int
               ) -> tuple[RoutePlan, Flight | None]:
        """Asks admission control; raises Rejected. Returns the plan with the decision and
        the flight to record (None with admission off)."""
        adm = self.admission
        if adm is None:
            return plan, None
        now = self.clock()
        d = plan.worker.instance_id
        p = plan.prefill.instance_id if plan.prefill is not None else None
        shape = RequestShape(n, adm.output_tokens(max_tokens), n - uncached)
        flights = list(self._flights.values())
        loads = self._worker_loads()
        decision = adm.decide(shape, d, p, flights, now, loads)
        plan = dataclasses.replace(plan, admission=decision)
        if not decision.admit:
            raise Rejected(decision, plan)
        load = loads.get(d)
        model = adm.model_for(load.kv_capacity_tokens if load is not None else 0)
        wait = adm.prefill_wait_s(flights, p or d, now)
        done = now + adm.horizon_s(model, wait, n, shape.uncached_tokens, p is not None)
        return plan, Flight("", d, p, n, shape.uncached_tokens, shape.output_tokens, now,
                            done)

    def _candidates(self, ctx: RouteContext, max_tokens: int,
                    exclude: Collection[str]) -> list[WorkerRecord]:
        """The model's workers that fit the request and are not excluded; raises."""
        serving = [w for w in self._workers.values() if w.model == ctx.model]
        if not serving:
            if ctx.model in self._known_models:
                raise NoWorkers(f"model {ctx.model!r} has no live worker")
            raise UnknownModel(f"model {ctx.model!r} is not served here")
        n = len(ctx.token_ids)
        self.check_request(ctx.model, n, max_tokens)
        serving = [w for w in serving if w.fits(n + max(max_tokens, 0))]
        left = [w for w in serving if w.instance_id not in exclude]
        if not left:
            raise NoWorkers(f"model {ctx.model!r} has no live worker left after excluding "
                            f"{sorted(set(exclude))}")
        return left

    def route(self, ctx: RouteContext, max_tokens: int = 0,
              exclude: Collection[str] = ()) -> RoutePlan:
        """Chooses worker(s) for ``ctx``; see the module docstring. ``max_tokens`` is the
        request's output limit (0: unknown), used by admission control and the context
        check; ``exclude``: instance ids not to pick."""
        if ctx.request_id in self._in_flight:
            raise AlreadyInFlight(f"request_id {ctx.request_id} is already in flight")
        skip = frozenset(exclude)
        serving = self._candidates(ctx, max_tokens, skip)
        marks = self.unroutable() if self._marks else {}
        prompt = _Prompt(ctx, self.history)
        decode, fallback = self._last_resort([w for w in serving if w.role == "decode"], marks)
        if decode:
            prefill = [w for w in serving if w.role == "prefill" and w.instance_id not in marks]
            plan = self._route_pd(prompt, prefill, decode)
        else:
            agg, fallback = self._last_resort([w for w in serving if w.role == "agg"], marks)
            if not agg:
                raise NoWorkers(f"model {ctx.model!r} has no worker that can generate"
                                + (f" after excluding {sorted(skip)}" if skip else ""))
            worker, d = self._pick(self.policy, prompt, agg)
            ov = prompt.overlap(worker)
            plan = RoutePlan(worker, None, self.policy.name, d.reason, ov.blocks,
                             overlap_by_tier=ov.by_tier, overlap_source=prompt.source,
                             prompt_blocks=len(prompt.hashes(worker.block_size)),
                             score=d.score, cost=d.cost)
        if fallback:
            plan = dataclasses.replace(plan, reason=f"{plan.reason}; every candidate was "
                                       "reported failed: least recently failed kept")
        return self._commit(ctx.request_id, plan, len(ctx.token_ids), max_tokens,
                            prompt.hashes)

    def _commit(self, request_id: str, plan: RoutePlan, n: int, max_tokens: int,
                hashes: Callable[[int], Sequence[int]]) -> RoutePlan:
        """Admits and records a chosen plan for a prompt of ``n`` tokens (``hashes``: its
        block hashes per block size); returns the plan (with admission's decision)."""
        doer, overlap = ((plan.prefill, plan.prefill_overlap_blocks) if plan.prefill is not None
                         else (plan.worker, plan.overlap_blocks))  # predicted before recording
        tokens = uncached_tokens(n, overlap, doer.block_size)
        flight = None
        if self.admission is not None:
            plan, flight = self._admit(plan, n, tokens, max_tokens)
        if flight is not None:
            self._flights[request_id] = dataclasses.replace(flight, request_id=request_id)
        chosen = [plan.worker] + ([plan.prefill] if plan.prefill is not None else [])
        for w in chosen:
            self.history.record(w.instance_id, hashes(w.block_size))
        entry = _Entry(tuple([
            (w.instance_id, math.ceil(n / w.block_size) if w.block_size > 0 else 0)
            for w in chosen]), self.clock())
        self._in_flight[request_id] = entry
        self._tally(entry.workers, 1)
        if tokens > 0:
            self._prefills[request_id] = (doer.instance_id, tokens)
            self._pending[doer.instance_id] = self._pending.get(doer.instance_id, 0) + tokens
        self._changed()
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

    def _plan(self, prompt: _Prompt, d: WorkerRecord, dd: Decision, p: WorkerRecord | None,
              pd: Decision | None, reason: str) -> RoutePlan:
        ov = prompt.overlap(d)
        pov = prompt.overlap(p) if p is not None else WorkerOverlap("", 0, {})
        return RoutePlan(d, p, self.policy.name, reason, ov.blocks, pov.blocks, ov.by_tier,
                         pov.by_tier, prompt.source, len(prompt.hashes(d.block_size)),
                         dd.score, dd.cost, pd.score if pd else None, pd.cost if pd else None)

    def _route_pd(self, prompt: _Prompt, prefill: list[WorkerRecord],
                  decode: list[WorkerRecord]) -> RoutePlan:
        pairs = self._compatible_pairs(prefill, decode)
        policy_p = self.prefill_policy or self.policy
        n = len(prompt.ctx.token_ids)
        if self.disagg.order == "decode_first" or not prefill:
            d, dd = self._pick(self.policy, prompt, decode)
            overlap = prompt.overlap(d).blocks
            partners = [p for p in prefill if (p.instance_id, d.instance_id) in pairs]
            local = can_prefill_locally(d.pair_info())
            if not partners:
                why = "no prefill worker" if not prefill else f"no prefill worker pairs with " \
                    f"{d.instance_id}"
                if not local:
                    raise Incompatible(f"decode worker {d.instance_id} cannot prefill alone "
                                       f"(SGLang decode server) and {why}")
                return self._plan(prompt, d, dd, None, None, f"{dd.reason}; {why}")
            need, why = decode_first_needs_prefill(n, overlap, d.block_size,
                                                   self.disagg.decode_first_threshold)
            if not need and local:
                return self._plan(prompt, d, dd, None, None, f"{dd.reason}; {why}")
            if not need:  # so D cannot prefill alone
                why = f"{why}, but {d.instance_id} cannot prefill alone"
            p, pd = self._pick(policy_p, prompt, partners)
            return self._plan(prompt, d, dd, p, pd, f"decode first: {dd.reason}; {why}; "
                              f"prefill {pd.reason}")
        paired_p = [p for p in prefill if any((p.instance_id, d.instance_id) in pairs
                                              for d in decode)]
        p, pd = self._pick(policy_p, prompt, paired_p)
        partners = [d for d in decode if (p.instance_id, d.instance_id) in pairs]
        d, dd = self._pick(self.policy, prompt, partners)
        overlap = prompt.overlap(d).blocks
        bypass, why = bypass_prefill(n, overlap, d.block_size, self._queue(p), self.disagg)
        hook = getattr(self.policy, "prefer_local_prefill", None)
        if not bypass and self.disagg.conditional and callable(hook):
            asked = hook(prompt.ctx, self._states(prompt, [p])[0],
                         self._states(prompt, [d])[0])
            if asked is not None:
                bypass, why = asked[0], f"{why}; {asked[1]}"
        whole = self._serve_whole(prompt, p, partners)
        if whole is not None:
            return self._plan(prompt, p, pd, None, None, f"prefill {pd.reason}; {whole}")
        if bypass and can_prefill_locally(d.pair_info()):
            return self._plan(prompt, d, dd, None, None, f"{dd.reason}; {why}")
        if bypass:
            why = f"{why}, but {d.instance_id} cannot prefill alone"
        return self._plan(prompt, d, dd, p, pd, f"prefill first: prefill {pd.reason}; "
                          f"decode {dd.reason}; {why}")

    def _serve_whole(self, prompt: _Prompt, p: WorkerRecord,
                     decode: list[WorkerRecord]) -> str | None:
        """The reason P serves the request whole, or None (see "P serves whole")."""
        if not self.disagg.prefill_whole or not can_decode_alone(p.pair_info(),
                                                                 p.can_decode_alone):
            return None
        p_state = self._states(prompt, [p])[0]
        d_states = self._states(prompt, decode)
        hook = getattr(self.policy, "prefer_prefill_whole", None)
        asked = hook(prompt.ctx, p_state, d_states) if callable(hook) else None
        if asked is None:
            n = len(prompt.ctx.token_ids)

            def after(w: WorkerState) -> float | None:
                return kv_after(w.kv_usage, w.active_blocks, w.block_size,
                                w.kv_total_blocks,
                                uncached_tokens(n, w.overlap_blocks, w.block_size))

            asked = prefill_serves_whole(after(p_state), [after(d) for d in d_states],
                                         self.disagg)
        return asked[1] if asked[0] else None

    def release_prefill(self, request_id: str) -> bool:
        """The request's prefill is over: its uncached tokens stop counting as the
        worker's pending prefill. False when nothing was pending for it."""
        flight = self._in_flight.get(request_id)
        if flight is not None and len(flight.workers) > 1:  # P/D: (D, P); P's part is over
            self._in_flight[request_id] = dataclasses.replace(flight,
                                                              workers=flight.workers[:1])
            self._tally(flight.workers[1:], -1)
            self._stale.add(flight.workers[1][0])
        entry = self._prefills.pop(request_id, None)
        if entry is None:
            if flight is not None and len(flight.workers) > 1:
                self._changed()
            return False
        wid, tokens = entry
        left = self._pending.get(wid, 0) - tokens
        if left > 0:
            self._pending[wid] = left
        else:
            self._pending.pop(wid, None)
        self._changed()
        return True

    def release(self, request_id: str) -> bool:
        """Stops counting ``request_id`` as load (and as pending prefill). False when it
        was not in flight."""
        self._flights.pop(request_id, None)
        self.release_prefill(request_id)
        entry = self._in_flight.pop(request_id, None)
        if entry is None:
            return False
        self._tally(entry.workers, -1)
        self._stale.update([wid for wid, _ in entry.workers])
        self._changed()
        return True
