"""The offline replay's discrete-event simulation on a virtual clock (pure: no sockets,
no sleeps, no threads).

It drives the same pure cores the live services run:

- one :class:`workers.engines.mock.scheduler.Scheduler` per worker (the mock engine's
  block manager, continuous batching, chunked prefill, preemption, timing model and
  simulated P→D KV reception);
- :class:`services.router.core.RouterCore` with any policy or profile of the live
  router's registry (built by :mod:`bench.offline.policies` with the engines' facts), P/D
  orders and conditional disaggregation; the router's pending-prefill accounting is told
  a prefill is over exactly when the live frontend tells it (``PrefillDone``): at the
  request's first token, or when the prefill half of a disaggregated request finishes;
- :class:`services.indexer.core.KvIndex`, fed with the engines' KV events translated by
  :class:`workers.kv.event_translate.EventTranslator` exactly as the live relay does,
  delivered ``event_delay_s`` after the step that produced them;
- "P serves whole" (``cfg.prefill_whole``): P workers advertise ``can_decode_alone``; a
  plan whose worker is a P and has no prefill runs whole on that P's scheduler, exactly
  as on an aggregated worker (its KV, its decode steps, mixed with P's prefill chunks);
  counted in ``served_whole_on_prefill``;
- optionally an admission policy of :mod:`services.router.admission.core` (early rejection);
  a rejected request is a miss.

Contract of :func:`simulate(trace, cfg)`: replays ``trace`` (Mooncake requests; arrival
= ``(timestamp - first timestamp) / 1000 / cfg.speedup`` s) and returns a
:class:`SimRun`: one :class:`bench.replay.stats.Result` per request (TTFT, E2E, prompt,
cached and completion tokens; status ``ok`` or ``rejected``) plus counters. The same
trace, config and seed always give the same result. Events at equal times run in the
order they were scheduled (a sequence number breaks ties), so nothing depends on hash or
heap order.

Event kinds: ``ARRIVAL`` (route, admit, queue on the worker), ``STEP`` (an engine step
ends: apply it, publish KV events, report load, start the next step), ``WAKE`` (a KV
reception may have finished), ``KV`` (KV events reach the indexer), ``DECODE`` (a
prefill finished: its decode half is queued on D), ``TICK`` (every ``tick_s`` virtual
seconds while other events remain, ``on_tick(sim)`` is called: the hook for a planner core,
which may read ``sim.workers`` / ``sim.router`` and change the worker set through
``sim.router.set_workers``; no planner is wired by default).

Prompts: each trace hash id stands for ``trace_block_size`` tokens; hash id ``h`` is the
token run ``h·B .. h·B + B − 1`` (B = trace block size), so equal ids are equal blocks and
different ids never collide; the prompt is cut to ``input_length``. (The live replay draws
random tokens per id instead; only equality matters for caching and routing.)
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.offline.config import SimConfig
from bench.offline.policies import sim_registry
from bench.replay.stats import Result
from bench.replay.trace import TraceRequest
from services.common.block_hash import block_hashes
from services.indexer.core import KvEvent, KvIndex
from services.router.core import RouterCore
from services.router.disagg import DisaggConfig
from services.router.plan import WorkerRecord
from services.router.policies.base import RouteContext, WorkerOverlap
from workers.engines.mock.scheduler import (
    Batch,
    Scheduler,
    SchedulerConfig,
    SimRequest,
)
from workers.kv.event_translate import EventTranslator

ARRIVAL, STEP, WAKE, KV, DECODE, TICK = range(6)
MODEL = "sim"
TOKEN_BASE = 1 << 20  # output tokens are < vocab (32000): keep prompt tokens apart


def prompt_tokens(req: TraceRequest, trace_block_size: int) -> list[int]:
    """The prompt of ``req`` (see the module docstring)."""
    out: list[int] = []
    n = req.input_length
    b = trace_block_size
    for h in req.hash_ids:
        if len(out) >= n:
            break
        start = TOKEN_BASE + h * b
        out.extend(range(start, start + b))
    if len(out) < n:  # longer than its blocks (not in the shared trace): unique padding
        start = TOKEN_BASE + (1 << 30) + len(out)
        out.extend(range(start, start + n - len(out)))
    return out[:n]


@dataclass
class _Track:
    """One trace request during the run."""

    index: int
    arrival: float
    isl: int
    osl: int
    tokens: list[int] | None = None
    decode_worker: str = ""
    prefill_worker: str = ""
    first_token: float | None = None
    last_token: float | None = None
    n_out: int = 0
    cached: int = -1
    status: str = "ok"
    predicted_overlap: int = 0
    done: bool = False


@dataclass
class SimWorker:
    """One simulated engine: its scheduler, step state and KV event relay."""

    record: WorkerRecord
    sched: Scheduler
    translator: EventTranslator
    busy: bool = False
    batch: Batch | None = None
    next_event_id: int = 0
    wake_at: float | None = None
    busy_s: float = 0.0

    @property
    def wid(self) -> str:
        return self.record.instance_id

    def pending_prefill_tokens(self) -> int:
        """Prompt tokens queued or still being prefilled (not yet computed)."""
        s = self.sched
        n = 0
        for r in s.waiting:
            if not r.remote_prefill:
                n += len(r.tokens) - r.num_computed if r.num_computed else len(r.tokens)
        for r in s.running:
            if r.num_computed < r.num_prompt:
                n += r.num_prompt - r.num_computed
        return n


@dataclass
class SimRun:
    """What one simulation produced."""

    results: list[Result]
    duration_s: float
    counters: dict[str, Any] = field(default_factory=dict)


class Simulation:
    """See the module docstring."""

    def __init__(self, trace: Sequence[TraceRequest], cfg: SimConfig,
                 on_tick: Callable[[Simulation], None] | None = None,
                 tick_s: float = 5.0) -> None:
        cfg.validate()
        self.on_tick = on_tick
        self.tick_s = tick_s
        self.cfg = cfg
        self.trace = trace
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.rng = random.Random(cfg.seed)
        self.index = KvIndex()
        self.workers: dict[str, SimWorker] = {}
        roles = (["agg"] * cfg.workers if not cfg.disaggregated
                 else ["prefill"] * cfg.prefill_workers + ["decode"] * cfg.decode_workers)
        for i, role in enumerate(roles):
            wid = f"{role[0]}{i:03d}"
            rec = WorkerRecord(wid, f"sim://{wid}", MODEL, role, cfg.block_size,
                               cfg.max_model_len, handoff_mode="push" if cfg.disaggregated
                               else "", kv_layout="sim",
                               can_decode_alone=role == "prefill" and cfg.prefill_whole)
            sched = Scheduler(SchedulerConfig(
                num_blocks=cfg.num_blocks, block_size=cfg.block_size,
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_model_len=cfg.max_model_len, timing=cfg.timing(),
                speedup_ratio=cfg.engine_speedup,
                kv_bytes_per_block=cfg.kv_bytes_per_token * cfg.block_size,
                transfer_bandwidth=cfg.transfer_bandwidth, seed=cfg.seed, engine_id=wid))
            self.workers[wid] = SimWorker(rec, sched, EventTranslator(cfg.block_size))
        registry = sim_registry(self)
        policy = registry.create(cfg.policy, self.rng)
        prefill_policy = (registry.create(cfg.prefill_policy, self.rng)
                          if cfg.prefill_policy else None)
        self.router = RouterCore(policy, prefill_policy, DisaggConfig(
            order=cfg.disagg_order, conditional=cfg.conditional_disagg,
            prefill_whole=cfg.prefill_whole),
            clock=lambda: self.now)
        self.router.set_workers(w.record for w in self.workers.values())
        self.use_index = cfg.uses_index()
        self.admission = cfg.make_admission(self)
        self.tracks: list[_Track] = []
        self.counters: dict[str, Any] = {"routed_disaggregated": 0, "rejected": 0,
                                         "served_whole_on_prefill": 0,
                                         "kv_events": 0, "predicted_overlap_tokens": 0,
                                         "steps": 0}

    # -- the event loop --------------------------------------------------------------

    def push(self, t: float, kind: int, payload: Any) -> None:
        """Schedules an event (ties keep scheduling order)."""
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    def run(self) -> SimRun:
        """Replays the whole trace; see :func:`simulate`."""
        cfg = self.cfg
        if not self.trace:
            return SimRun([], 0.0, dict(self.counters))
        t0 = self.trace[0].timestamp_ms
        for i, req in enumerate(self.trace):
            at = (req.timestamp_ms - t0) / 1000.0 / cfg.speedup
            self.tracks.append(_Track(i, at, req.input_length, max(1, req.output_length)))
            self.push(at, ARRIVAL, i)
        if self.on_tick is not None:
            self.push(0.0, TICK, None)
        handlers: dict[int, Callable[[Any], None]] = {
            ARRIVAL: self._arrival, STEP: self._step_end, WAKE: self._wake,
            KV: self._deliver, DECODE: self._start_decode, TICK: self._tick}
        heap = self._heap
        while heap:
            t, _, kind, payload = heapq.heappop(heap)
            self.now = t
            handlers[kind](payload)
        for w in self.workers.values():
            for k, v in w.sched.counters.items():
                self.counters[k] = self.counters.get(k, 0) + v
        self.counters["worker_busy_s"] = {w.wid: round(w.busy_s, 3)
                                          for w in self.workers.values()}
        if self.admission is not None:
            self.counters["admission_reasons"] = dict(self.admission.reasons)
        results = [self._result(tr) for tr in self.tracks]
        end = max((tr.last_token or tr.arrival) for tr in self.tracks)
        return SimRun(results, end, dict(self.counters))

    def _tick(self, _: Any) -> None:
        assert self.on_tick is not None
        self.on_tick(self)
        if self._heap:  # something else can still happen
            self.push(self.now + self.tick_s, TICK, None)

    def _result(self, tr: _Track) -> Result:
        r = Result(tr.index, tr.arrival, status=tr.status, prompt_tokens=tr.isl,
                   cached_tokens=max(tr.cached, 0), completion_tokens=tr.n_out)
        if tr.status == "ok":
            if tr.first_token is None or tr.last_token is None or not tr.done:
                r.status, r.error = "error", "did not finish"
            else:
                r.ttft_s = tr.first_token - tr.arrival
                r.e2e_s = tr.last_token - tr.arrival
        return r

    # -- requests ----------------------------------------------------------------------

    def _arrival(self, i: int) -> None:
        cfg = self.cfg
        tr = self.tracks[i]
        tokens = prompt_tokens(self.trace[i], cfg.trace_block_size)
        hashes = block_hashes(tokens, cfg.block_size)
        overlaps: dict[str, WorkerOverlap] | None = None
        if self.use_index:
            found = self.index.find_matches(hashes)
            overlaps = {w: WorkerOverlap(w, o.blocks, o.by_tier) for w, o in found.items()}
        rid = str(i)
        plan = self.router.route(RouteContext(rid, MODEL, tokens, overlaps=overlaps,
                                              block_hashes={cfg.block_size: hashes}))
        tr.predicted_overlap = plan.overlap_blocks * cfg.block_size
        self.counters["predicted_overlap_tokens"] += tr.predicted_overlap
        if self.admission is not None and not self.admission.admit(tr, plan, tokens):
            self.router.release(rid)
            tr.status = "rejected"
            self.counters["rejected"] += 1
            return
        tr.tokens = tokens
        tr.decode_worker = plan.worker.instance_id
        if plan.prefill is not None:
            self.counters["routed_disaggregated"] += 1
            tr.prefill_worker = plan.prefill.instance_id
            self._submit(self.workers[tr.prefill_worker],
                         SimRequest(rid + "#p", tokens, 1, ignore_eos=True, remote_decode=True))
        else:  # an agg worker, D prefilling locally, or P serving the request whole
            if plan.worker.role == "prefill":
                self.counters["served_whole_on_prefill"] += 1
            self._submit(self.workers[tr.decode_worker],
                         SimRequest(rid, tokens, tr.osl, ignore_eos=True))

    def _start_decode(self, i: int) -> None:
        tr = self.tracks[i]
        assert tr.tokens is not None
        self._submit(self.workers[tr.decode_worker],
                     SimRequest(str(i), tr.tokens, tr.osl, ignore_eos=True,
                                remote_prefill=True))

    def _submit(self, w: SimWorker, req: SimRequest) -> None:
        w.sched.add(req, self.now)
        if not w.busy:
            self._start_step(w)

    # -- engine steps ------------------------------------------------------------------

    def _start_step(self, w: SimWorker) -> None:
        batch = w.sched.schedule(self.now)
        if batch.empty:
            w.busy, w.batch = False, None
            ready = w.sched.next_ready_at()
            if ready is not None and (w.wake_at is None or ready < w.wake_at
                                      or w.wake_at < self.now):
                w.wake_at = max(ready, self.now)
                self.push(w.wake_at, WAKE, w.wid)
            return
        w.busy, w.batch = True, batch
        w.busy_s += batch.duration_s
        self.push(self.now + batch.duration_s, STEP, w.wid)

    def _wake(self, wid: str) -> None:
        w = self.workers[wid]
        if w.wake_at is not None and w.wake_at <= self.now:
            w.wake_at = None
        if not w.busy:
            self._start_step(w)

    def _step_end(self, wid: str) -> None:
        w = self.workers[wid]
        batch = w.batch
        assert batch is not None
        self.counters["steps"] += 1
        now = self.now
        for out in w.sched.complete(batch, now):
            rid = out.request_id
            if rid.endswith("#p"):  # the prefill half of a disaggregated request
                if out.finished:
                    i = int(rid[:-2])
                    tr = self.tracks[i]
                    tr.cached = out.cached_tokens
                    self.router.release_prefill(str(i))
                    self.push(now, DECODE, i)
                continue
            tr = self.tracks[int(rid)]
            if tr.first_token is None:
                tr.first_token = now
                self.router.release_prefill(rid)
                if tr.cached < 0:
                    tr.cached = out.cached_tokens
            tr.n_out += len(out.token_ids)
            tr.last_token = now
            if out.finished:
                tr.done = True
                tr.tokens = None
                self.router.release(rid)
        self._publish(w)
        s = w.sched
        self.router.update_load(wid, len(s.running), len(s.waiting) + len(s.receiving),
                                s.blocks.usage, s.blocks.num_blocks)
        self._start_step(w)

    def _publish(self, w: SimWorker) -> None:
        raw = w.sched.drain_events()
        if not raw or not self.use_index:
            return  # nobody reads the index: the relay has no consumer
        events: list[KvEvent] = []
        for ev in raw:
            for t in w.translator.translate(ev):
                events.append(KvEvent(w.wid, w.next_event_id, t.kind, t.block_hashes, t.tier))
                w.next_event_id += 1
        if not events:
            return
        self.counters["kv_events"] += len(events)
        if self.cfg.event_delay_s > 0:
            self.push(self.now + self.cfg.event_delay_s, KV, events)
        else:
            self._deliver(events)

    def _deliver(self, events: list[KvEvent]) -> None:
        for ev in events:
            gap = self.index.apply(ev)
            if gap is not None:  # cannot happen in order; resync as the indexer would
                w = self.workers[ev.worker_id]
                self.index.resync(ev.worker_id, ev.event_id,
                                  {k: v for k, v in w.translator.state().items()})


def simulate(trace: Sequence[TraceRequest], cfg: SimConfig) -> SimRun:
    """Runs one offline replay; see the module docstring."""
    return Simulation(trace, cfg).run()
