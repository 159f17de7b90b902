"""Admission control in the offline replay: simulation state → the admission core.

Contract of :class:`SimAdmission` (built by :meth:`SimConfig.make_admission`):

- ``admit(track, plan, tokens) -> bool`` asks :func:`services.router.admission.core.make_policy`
  (``early`` = Mooncake early rejection, ``current_load``) whether the request the router
  just placed may run, with the cluster state of the *routed* workers: the decode (or
  aggregated) worker's running requests (context tokens, tokens still to generate) and,
  as the prefill queue, the uncached prompt tokens queued on the worker that will
  prefill it (P when disaggregated, else the same worker). The request's cached tokens
  are the router's predicted overlap. Decisions are counted by reason in ``reasons``.
- The admission core's ``PerfModel`` for the mock engine is
  :class:`services.common.perf_model.ChunkedPerfModel` over
  :class:`bench.offline.policies.TimingPerfModel` (the engines' timing model, KV
  capacity and speedup): prefill time of ``n`` tokens is the chunked estimate (at most
  ``max_num_batched_tokens`` per step, as the engine runs it, each step with its decode
  term at KV usage 0), decode step time is the timing model at the KV usage ``active
  tokens / capacity`` (the same numbers the TTFT router policies use).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from bench.offline.policies import TimingPerfModel
from services.common.perf_model import ChunkedPerfModel
from services.router.admission.core import (
    AdmissionSettings,
    ClusterState,
    DecodeState,
    PrefillState,
    RequestShape,
    RunningRequest,
    make_policy,
)
from services.router.plan import RoutePlan


class SimAdmission:
    """See the module docstring."""

    def __init__(self, name: str, sim: Any) -> None:
        cfg = sim.cfg
        self.sim = sim
        self.model = ChunkedPerfModel(
            TimingPerfModel(cfg.timing(), cfg.num_blocks * cfg.block_size,
                            cfg.engine_speedup), cfg.max_num_batched_tokens)
        ms_per_token = (cfg.kv_bytes_per_token / cfg.transfer_bandwidth * 1000.0
                        if cfg.disaggregated else 0.0)
        self.policy = make_policy(name, self.model, AdmissionSettings(
            itl_slo_ms=cfg.slo_itl_s * 1000.0, ttft_slo_ms=cfg.slo_ttft_s * 1000.0,
            transfer_ms_per_token=ms_per_token))
        self.reasons: Counter[str] = Counter()

    def admit(self, track: Any, plan: RoutePlan, tokens: list[int]) -> bool:
        """Whether the routed request may run (see the module docstring)."""
        sim = self.sim
        d = sim.workers[plan.worker.instance_id]
        p = sim.workers[plan.prefill.instance_id] if plan.prefill is not None else d
        running = tuple(RunningRequest(len(r.tokens), max(r.max_tokens - r.num_output, 0))
                        for r in d.sched.running if r.num_computed >= r.num_prompt)
        cluster = ClusterState(
            decode=[DecodeState(d.wid, running)],
            prefill=[PrefillState(p.wid, (p.pending_prefill_tokens(),))])
        cached = (plan.prefill_overlap_blocks if plan.prefill is not None
                  else plan.overlap_blocks) * sim.cfg.block_size
        decision = self.policy.decide(
            RequestShape(len(tokens), track.osl, min(cached, len(tokens))), cluster)
        self.reasons[decision.reason] += 1
        return decision.admit
