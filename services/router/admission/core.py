"""Admission pure core: early rejection (Mooncake) vs admission by current load.

No I/O, no clock: every time is relative to "now" = the moment of the decision. Contract of
:class:`AdmissionPolicy` (a ``typing.Protocol``):

- ``name``: the registry name.
- ``decide(request, cluster) -> AdmissionDecision``: admit or reject one request given
  the state of the prefill and decode pools. A rejection carries a ``reason``
  (``predicted_itl``, ``predicted_ttft``, ``kv_full``, ``no_decode_workers``) and a
  ``retry_after_s`` estimate (>= ``min_retry_after_s``); an admission names the decode
  (and prefill) worker the prediction was best for. The frontend maps a rejection to
  HTTP 503 + ``Retry-After`` / gRPC RESOURCE_EXHAUSTED.

Policies (:func:`make_policy` is the registry):

- :class:`EarlyRejection` (``early``): the request's prefill would finish at
  ``h = P queue + own prefill + KV transfer`` (the least-loaded P, or on D itself when the
  cluster has no P pool). :func:`forecast_decode` simulates each D forward to ``h`` with
  the performance model: running requests generate tokens at the model's step time (so
  those with few tokens left leave), and prefills already queued for this D join at their
  own finish times. The request is admitted when on some D the predicted step time with
  it added (× ``decode_correction``) meets the ITL SLO, its KV fits, and the predicted
  TTFT (``h`` + one step) meets the TTFT SLO. Retry-After is the first probed delay at
  which the forecast would admit it (capped at ``max_retry_after_s``).
- :class:`CurrentLoadAdmission` (``current_load``): the baseline. The same checks on the
  *current* D state only (no departures, no arrivals) and the current P queue: it admits
  a surge whose prefills have not reached D yet, then rejects everything once they land
  — the oscillation Mooncake describes.
- :class:`AlwaysAdmit` (``none``): admission control off.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.common.perf_model import PerfModel


@dataclass(frozen=True)
class RunningRequest:
    """A request decoding on D."""

    context_tokens: int  # KV tokens it holds now
    remaining_tokens: int  # output tokens still to generate (estimate)


@dataclass(frozen=True)
class PendingJoin:
    """A request whose prefill is queued or running, bound for this D."""

    arrive_in_s: float  # when its prefill (and transfer) finishes, from now
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class DecodeState:
    """One decode (or agg) worker."""

    worker_id: str
    running: tuple[RunningRequest, ...] = ()
    pending: tuple[PendingJoin, ...] = ()

    @classmethod
    def from_aggregate(cls, worker_id: str, active_requests: int, kv_tokens: float,
                       mean_remaining_tokens: int,
                       pending: tuple[PendingJoin, ...] = ()) -> DecodeState:
        """Approximates a worker known only by counts (GetLoad): ``active_requests``
        equal requests sharing ``kv_tokens``, each with ``mean_remaining_tokens`` left."""
        if active_requests <= 0:
            return cls(worker_id, (), pending)
        each = int(kv_tokens / active_requests)
        run = tuple(RunningRequest(each, mean_remaining_tokens) for _ in range(active_requests))
        return cls(worker_id, run, pending)


@dataclass(frozen=True)
class PrefillState:
    """One prefill worker: the uncached prompt tokens of each request ahead in its queue."""

    worker_id: str
    queued_prompt_tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class ClusterState:
    decode: Sequence[DecodeState]
    prefill: Sequence[PrefillState] = ()  # empty: prefill runs on the decode worker


@dataclass(frozen=True)
class RequestShape:
    prompt_tokens: int
    output_tokens: int  # expected OSL (max_tokens or a prediction)
    cached_tokens: int = 0  # prefix already cached where it prefills

    @property
    def uncached_tokens(self) -> int:
        return max(self.prompt_tokens - self.cached_tokens, 0)


@dataclass(frozen=True)
class AdmissionDecision:
    admit: bool
    reason: str  # "ok" or the rejection reason
    retry_after_s: float  # 0 when admitted
    policy: str
    decode_worker: str | None = None
    prefill_worker: str | None = None
    predicted_itl_ms: float = 0.0
    predicted_ttft_ms: float = 0.0
    detail: str = ""


@dataclass(frozen=True)
class AdmissionSettings:
    itl_slo_ms: float = 50.0
    ttft_slo_ms: float = 2000.0
    transfer_ms_per_token: float = 0.0  # KV transfer P→D (0: agg or negligible)
    decode_correction: float = 1.0  # actual / model ITL (the planner's decode correction)
    min_retry_after_s: float = 1.0
    max_retry_after_s: float = 30.0
    retry_probe_s: float = 0.5

    def problems(self) -> list[str]:
        out = []
        if self.itl_slo_ms <= 0 or self.ttft_slo_ms <= 0:
            out.append("SLOs must be > 0")
        if self.transfer_ms_per_token < 0 or self.decode_correction <= 0:
            out.append("transfer_ms_per_token must be >= 0 and decode_correction > 0")
        if not 0 < self.min_retry_after_s <= self.max_retry_after_s or self.retry_probe_s <= 0:
            out.append("need 0 < min_retry_after_s <= max_retry_after_s, retry_probe_s > 0")
        return out


class AdmissionPolicy(Protocol):
    """Decides whether to admit one request; see the module docstring."""

    name: str

    def decide(self, request: RequestShape, cluster: ClusterState) -> AdmissionDecision:
        """Admit or reject ``request`` given ``cluster``."""
        ...


@dataclass
class DecodeForecast:
    """A decode worker's predicted batch at some time."""

    contexts: list[float] = field(default_factory=list)  # KV tokens per running request

    @property
    def kv_tokens(self) -> float:
        return sum(self.contexts)

    @property
    def batch(self) -> int:
        return len(self.contexts)


def forecast_decode(state: DecodeState, horizon_s: float, model: PerfModel,
                    correction: float = 1.0, include_pending: bool = True) -> DecodeForecast:
    """Simulates ``state`` forward ``horizon_s`` seconds (event by event: between a
    departure and an arrival the step time is constant)."""
    reqs = [[float(r.context_tokens), float(r.remaining_tokens)] for r in state.running
            if r.remaining_tokens > 0]
    pend = sorted(state.pending, key=lambda p: p.arrive_in_s) if include_pending else []
    t, i = 0.0, 0
    while True:
        while i < len(pend) and pend[i].arrive_in_s <= t + 1e-12:
            reqs.append([float(pend[i].prompt_tokens), float(max(pend[i].output_tokens, 1))])
            i += 1
        if t >= horizon_s:
            break
        next_arrival = pend[i].arrive_in_s if i < len(pend) else math.inf
        if not reqs:
            t = min(next_arrival, horizon_s)
            continue
        step_s = model.decode_step_ms(sum(r[0] for r in reqs)) * correction / 1000.0
        first_done = min(r[1] for r in reqs) * step_s
        dt = min(first_done, next_arrival - t, horizon_s - t)
        tokens = dt / step_s
        for r in reqs:
            r[0] += tokens
            r[1] -= tokens
        reqs = [r for r in reqs if r[1] > 1e-9]
        t += dt
    return DecodeForecast([r[0] for r in reqs])


@dataclass(frozen=True)
class _Fit:
    worker: str
    itl_ms: float
    kv_ok: bool


def _prefill_plan(request: RequestShape, cluster: ClusterState, model: PerfModel,
                  settings: AdmissionSettings) -> tuple[str | None, float]:
    """(chosen P, seconds until this request's KV is on D)."""
    own = model.prefill_ms(request.uncached_tokens)
    transfer = request.prompt_tokens * settings.transfer_ms_per_token
    if not cluster.prefill:
        return None, own / 1000.0
    waits = [(sum(model.prefill_ms(t) for t in p.queued_prompt_tokens), p.worker_id)
             for p in cluster.prefill]
    wait, worker = min(waits)
    return worker, (wait + own + transfer) / 1000.0


def _fit(forecast: DecodeForecast, request: RequestShape, model: PerfModel,
         correction: float, worker: str) -> _Fit:
    kv = forecast.kv_tokens + request.prompt_tokens
    itl = model.decode_step_ms(kv) * correction
    return _Fit(worker, itl, kv <= model.kv_capacity_tokens)


class _Base:
    name = "base"
    include_future = True

    def __init__(self, model: PerfModel, settings: AdmissionSettings | None = None) -> None:
        self.model = model
        self.settings = settings or AdmissionSettings()
        bad = self.settings.problems()
        if bad:
            raise ValueError("; ".join(bad))

    def _best(self, request: RequestShape, cluster: ClusterState, horizon: float) -> _Fit:
        s = self.settings
        fits = []
        for d in cluster.decode:
            fc = forecast_decode(d, horizon if self.include_future else 0.0, self.model,
                                 s.decode_correction, include_pending=self.include_future)
            fits.append(_fit(fc, request, self.model, s.decode_correction, d.worker_id))
        return min(fits, key=lambda f: (not f.kv_ok, f.itl_ms))

    def _ok(self, fit: _Fit) -> bool:
        return fit.kv_ok and fit.itl_ms <= self.settings.itl_slo_ms

    def _retry_after(self, request: RequestShape, cluster: ClusterState,
                     horizon: float) -> float:
        return self.settings.min_retry_after_s

    def decide(self, request: RequestShape, cluster: ClusterState) -> AdmissionDecision:
        s = self.settings
        if not cluster.decode:
            return AdmissionDecision(False, "no_decode_workers", s.min_retry_after_s,
                                     self.name)
        p_worker, horizon = _prefill_plan(request, cluster, self.model, s)
        best = self._best(request, cluster, horizon)
        ttft_ms = horizon * 1000.0 + best.itl_ms

        def decision(admit: bool, reason: str, retry: float, detail: str = "") -> AdmissionDecision:
            return AdmissionDecision(admit, reason, retry, self.name, best.worker, p_worker,
                                     best.itl_ms, ttft_ms, detail)

        if ttft_ms > s.ttft_slo_ms:
            retry = min(max((ttft_ms - s.ttft_slo_ms) / 1000.0, s.min_retry_after_s),
                        s.max_retry_after_s)
            return decision(False, "predicted_ttft", retry,
                            f"predicted TTFT {ttft_ms:.0f} ms > SLO {s.ttft_slo_ms:g} ms")
        if not self._ok(best):
            return decision(False, "kv_full" if not best.kv_ok else "predicted_itl",
                            self._retry_after(request, cluster, horizon),
                            f"predicted ITL {best.itl_ms:.1f} ms (SLO {s.itl_slo_ms:g} ms) on "
                            f"{best.worker} when its prefill finishes in {horizon:.2f} s")
        return decision(True, "ok", 0.0)


class EarlyRejection(_Base):
    """Mooncake early rejection: judge D's load when this prefill would finish."""

    name = "early"
    include_future = True

    def _retry_after(self, request: RequestShape, cluster: ClusterState,
                     horizon: float) -> float:
        s = self.settings
        delay = s.retry_probe_s
        while delay < s.max_retry_after_s:
            if self._ok(self._best(request, cluster, horizon + delay)):
                return max(delay, s.min_retry_after_s)
            delay += s.retry_probe_s
        return s.max_retry_after_s


class CurrentLoadAdmission(_Base):
    """Baseline: judge D's current load only."""

    name = "current_load"
    include_future = False


class AlwaysAdmit:
    """Admission control off."""

    name = "none"

    def __init__(self, model: PerfModel | None = None,
                 settings: AdmissionSettings | None = None) -> None:
        self.settings = settings or AdmissionSettings()

    def decide(self, request: RequestShape, cluster: ClusterState) -> AdmissionDecision:
        return AdmissionDecision(True, "ok", 0.0, self.name)


POLICIES = ("early", "current_load", "none")


def make_policy(name: str, model: PerfModel,
                settings: AdmissionSettings | None = None) -> AdmissionPolicy:
    """An admission policy by registry name."""
    if name == "early":
        return EarlyRejection(model, settings)
    if name == "current_load":
        return CurrentLoadAdmission(model, settings)
    if name == "none":
        return AlwaysAdmit(model, settings)
    raise ValueError(f"unknown admission policy {name!r}; known: {', '.join(POLICIES)}")
