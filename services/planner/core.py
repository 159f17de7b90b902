"""Planner pure core: observations in, desired replica counts and scaling actions out.

No I/O, no asyncio, no clock: the caller passes ``now`` (seconds, any monotonic origin).
Modelled on Dynamo's planner (ARCHITECTURE.md §3). Contract of :class:`PlannerCore`:

- ``tick(now, observations) -> ScalingDecision``: advances the state machine. Every tick
  returns the desired count per pool (``prefill``/``decode``, or ``agg`` in agg mode), the
  ready count (workers seen in discovery), the throughput floor and the actions this tick
  took (each with pool, direction, size, source and a human-readable reason). Actions
  describe changes of the *desired* count; actuators apply the absolute ``desired``, so
  repeating a decision is harmless.
- The first tick initialises desired = ready clamped to [min, max] (an action only when
  the clamp changes it) and starts both interval clocks.
- **Throughput mode**, every ``throughput_interval_s`` (0 = off): from the frontends'
  cumulative counters (:class:`TrafficCounters`, deltas taken here; a decrease counts as a
  counter reset) it derives the interval's request rate, mean ISL and OSL, feeds one
  predictor per series (:mod:`services.planner.predictors`), updates the correction
  factors ``prefill = actual TTFT / model TTFT`` and ``decode = actual ITL / model ITL``
  (clamped to ``correction_bounds``), and computes the predicted need:
  ``P = ceil(rate·ISL·min(1, prefill_corr) / prefill_tokens_per_s(ISL))`` and
  ``D = ceil(rate·OSL / decode_tokens_per_s(ISL + OSL/2, ITL_SLO / decode_corr))``
  (agg: ``ceil(P_frac + D_frac)``). The clamped result is the **floor**: desired is
  raised to it at once (ignoring cooldown); with load mode on, desired is never lowered
  by this step (load mode walks it down to the floor), with load mode off desired = floor.
- **Load mode**, every ``load_interval_s`` (0 = off), per pool, ±1 replica at most:
  up when any signal is high (mean waiting requests per worker > ``queue_high``, mean KV
  usage > ``kv_high``, observed TTFT (prefill/agg) or ITL (decode/agg) over the last load
  interval above its SLO, or the model's ITL at the pool's mean KV load × decode
  correction above the SLO); down only when *all* signals are comfortably low (queue <=
  ``queue_low``, KV usage < ``kv_low`` and still < ``kv_high`` spread over one replica
  fewer, observed latencies and the model's ITL < ``slo_low_fraction`` × SLO) and desired
  is above the floor. A pool is left alone while in cooldown (``cooldown_s`` after its
  last change), while its ready count differs from desired (a change is still being
  applied), or when no worker of it reported load.
- Desired counts always stay within the pool's [min_replicas, max_replicas].
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.common.perf_model import (
    PerfModel,
    decode_throughput,
    expected_itl_ms,
    prefill_throughput,
)
from services.planner.predictors import PREDICTORS, Predictor, make_predictor

DISAGG_POOLS = ("prefill", "decode")
AGG_POOLS = ("agg",)


@dataclass(frozen=True)
class WorkerLoad:
    """One worker as seen this tick: its role (pool) and its last load report."""

    worker_id: str
    role: str  # "prefill" | "decode" | "agg"
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    active_requests: int = 0
    reported: bool = True  # False: registered but no load report (counts as ready only)


@dataclass(frozen=True)
class TrafficCounters:
    """Cumulative frontend counters (summed over frontends)."""

    requests: float = 0.0
    input_tokens: float = 0.0
    output_tokens: float = 0.0
    ttft_sum_s: float = 0.0
    ttft_count: float = 0.0
    itl_sum_s: float = 0.0
    itl_count: float = 0.0
    # Requests that finished (their tokens are in the totals); ``requests`` also counts
    # rejected and failed ones, i.e. demand. ISL/OSL are observed per finished request.
    finished: float = 0.0

    def minus(self, base: TrafficCounters) -> TrafficCounters:
        """``self - base``; when any counter went down (a reset), ``self`` itself."""
        pairs = [(getattr(self, f.name), getattr(base, f.name))
                 for f in dataclasses.fields(self)]
        if any(a < b for a, b in pairs):
            return self
        return TrafficCounters(*(a - b for a, b in pairs))


@dataclass(frozen=True)
class Observations:
    """Everything the planner sees at one tick."""

    workers: Sequence[WorkerLoad] = ()
    traffic: TrafficCounters | None = None  # None: frontends' metrics unavailable


@dataclass(frozen=True)
class ScaleAction:
    """One change of a pool's desired count."""

    pool: str
    kind: str  # "scale_up" | "scale_down"
    n: int
    from_replicas: int
    to_replicas: int
    source: str  # "init" | "throughput" | "load"
    reason: str


@dataclass(frozen=True)
class ScalingDecision:
    """The outcome of one tick."""

    at: float
    desired: dict[str, int]
    ready: dict[str, int]
    floor: dict[str, int]
    actions: tuple[ScaleAction, ...] = ()
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Prediction:
    """The last throughput step's inputs and result."""

    rate: float  # requests/s
    isl: float
    osl: float
    need: dict[str, float]  # fractional replicas per pool, before ceil and clamp
    prefill_correction: float
    decode_correction: float


@dataclass(frozen=True)
class PoolLimits:
    min_replicas: int = 1
    max_replicas: int = 8


@dataclass
class PlannerSettings:
    """Knobs of the core (the service's config maps onto these)."""

    mode: str = "disagg"  # "disagg" (prefill + decode pools) or "agg"
    throughput_interval_s: float = 180.0
    load_interval_s: float = 5.0
    ttft_slo_ms: float = 1000.0
    itl_slo_ms: float = 50.0
    limits: dict[str, PoolLimits] = field(default_factory=dict)  # missing pool: defaults
    cooldown_s: float = 30.0
    predictor: str = "constant"
    predictor_window: int = 8
    queue_high: float = 2.0
    queue_low: float = 0.0
    kv_high: float = 0.85
    kv_low: float = 0.4
    slo_low_fraction: float = 0.5
    correction_bounds: tuple[float, float] = (0.25, 4.0)

    @property
    def pools(self) -> tuple[str, ...]:
        return AGG_POOLS if self.mode == "agg" else DISAGG_POOLS

    def limit(self, pool: str) -> PoolLimits:
        return self.limits.get(pool, PoolLimits())

    def problems(self) -> list[str]:
        """Human-readable problems; empty when valid."""
        out: list[str] = []
        if self.mode not in ("disagg", "agg"):
            out.append(f"mode must be disagg or agg, got {self.mode!r}")
        if self.throughput_interval_s < 0 or self.load_interval_s < 0:
            out.append("intervals must be >= 0 (0 = mode off)")
        if self.throughput_interval_s == 0 and self.load_interval_s == 0:
            out.append("at least one of throughput and load mode must be on")
        if self.ttft_slo_ms <= 0 or self.itl_slo_ms <= 0:
            out.append("SLOs must be > 0")
        for pool, lim in self.limits.items():
            if not 0 <= lim.min_replicas <= lim.max_replicas:
                out.append(f"{pool}: need 0 <= min_replicas <= max_replicas")
        if self.cooldown_s < 0:
            out.append("cooldown_s must be >= 0")
        if self.predictor not in PREDICTORS:
            out.append(f"unknown predictor {self.predictor!r}")
        if self.predictor_window < 1:
            out.append("predictor_window must be >= 1")
        if not 0 <= self.kv_low <= self.kv_high <= 1:
            out.append("need 0 <= kv_low <= kv_high <= 1")
        if not 0 <= self.queue_low <= self.queue_high:
            out.append("need 0 <= queue_low <= queue_high")
        if not 0 < self.slo_low_fraction <= 1:
            out.append("slo_low_fraction must be in (0, 1]")
        lo, hi = self.correction_bounds
        if not 0 < lo <= 1 <= hi:
            out.append("correction_bounds must satisfy 0 < lo <= 1 <= hi")
        return out


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - 1e-9))


def _kv_with_one_fewer(loads: Sequence[WorkerLoad], kv: float) -> float:
    """Mean KV usage if the pool's load were spread over one worker fewer (a pool of one
    idle worker → 0, of one busy worker → inf)."""
    n = len(loads)
    if n > 1:
        return kv * n / (n - 1)
    idle = all(w.num_running == 0 and w.num_waiting == 0 and w.kv_usage == 0 for w in loads)
    return 0.0 if idle else math.inf


class PlannerCore:
    """The planner state machine; see the module docstring."""

    def __init__(self, settings: PlannerSettings, model: PerfModel) -> None:
        bad = settings.problems()
        if bad:
            raise ValueError("; ".join(bad))
        self.settings = settings
        self.model = model
        self._pools = settings.pools
        self._desired: dict[str, int] | None = None
        self._floor = {p: settings.limit(p).min_replicas for p in self._pools}
        self._last_change = {p: -math.inf for p in self._pools}
        self._next_throughput = math.inf
        self._next_load = math.inf
        self._tp_base: TrafficCounters | None = None
        self._tp_base_at = 0.0
        self._load_base: TrafficCounters | None = None
        w = settings.predictor_window
        self._rate: Predictor = make_predictor(settings.predictor, window=w)
        self._isl: Predictor = make_predictor(settings.predictor, window=w)
        self._osl: Predictor = make_predictor(settings.predictor, window=w)
        self.prefill_correction = 1.0
        self.decode_correction = 1.0
        self.last_prediction: Prediction | None = None

    # -- helpers ---------------------------------------------------------------------

    def _clamp(self, pool: str, n: int) -> int:
        lim = self.settings.limit(pool)
        return min(max(n, lim.min_replicas), lim.max_replicas)

    def _bound_corr(self, x: float) -> float:
        lo, hi = self.settings.correction_bounds
        return min(max(x, lo), hi)

    def _set(self, pool: str, n: int, now: float, source: str, reason: str,
             actions: list[ScaleAction]) -> None:
        assert self._desired is not None
        old = self._desired[pool]
        new = self._clamp(pool, n)
        if new == old:
            return
        self._desired[pool] = new
        self._last_change[pool] = now
        kind = "scale_up" if new > old else "scale_down"
        actions.append(ScaleAction(pool, kind, abs(new - old), old, new, source, reason))

    def _ready(self, obs: Observations) -> dict[str, int]:
        ready = dict.fromkeys(self._pools, 0)
        for w in obs.workers:
            if w.role in ready:
                ready[w.role] += 1
        return ready

    @property
    def desired(self) -> dict[str, int]:
        """Current desired counts (empty before the first tick)."""
        return dict(self._desired or {})

    @property
    def floor(self) -> dict[str, int]:
        """Current throughput floor per pool."""
        return dict(self._floor)

    # -- the state machine -----------------------------------------------------------

    def tick(self, now: float, obs: Observations) -> ScalingDecision:
        """Advances the state machine to ``now``; see the module docstring."""
        s = self.settings
        ready = self._ready(obs)
        actions: list[ScaleAction] = []
        notes: list[str] = []
        if self._desired is None:
            self._desired = dict(ready)
            for pool in self._pools:
                self._set(pool, ready[pool], now, "init", "outside [min_replicas, max_replicas]",
                          actions)
            self._tp_base, self._tp_base_at = obs.traffic, now
            self._load_base = obs.traffic
            if s.throughput_interval_s > 0:
                self._next_throughput = now + s.throughput_interval_s
            if s.load_interval_s > 0:
                self._next_load = now + s.load_interval_s
        else:
            if now >= self._next_throughput:
                self._throughput_step(now, obs, actions, notes)
                while self._next_throughput <= now:
                    self._next_throughput += s.throughput_interval_s
            if now >= self._next_load:
                self._load_step(now, obs, ready, actions, notes)
                while self._next_load <= now:
                    self._next_load += s.load_interval_s
        return ScalingDecision(now, dict(self._desired), ready, dict(self._floor),
                               tuple(actions), tuple(notes))

    def _throughput_step(self, now: float, obs: Observations, actions: list[ScaleAction],
                         notes: list[str]) -> None:
        s = self.settings
        base, base_at = self._tp_base, self._tp_base_at
        self._tp_base, self._tp_base_at = obs.traffic, now
        if obs.traffic is None or base is None or now <= base_at:
            notes.append("throughput: no traffic metrics this interval")
            return
        d = obs.traffic.minus(base)
        self._rate.add(d.requests / (now - base_at))
        if d.finished > 0:  # an interval of rejections only tells nothing about lengths
            isl_obs, osl_obs = d.input_tokens / d.finished, d.output_tokens / d.finished
            self._isl.add(isl_obs)
            self._osl.add(osl_obs)
            self._update_corrections(obs, d, isl_obs, osl_obs)
        rate, isl, osl = self._rate.predict(), self._isl.predict(), self._osl.predict()
        if rate is None or isl is None or osl is None:
            notes.append("throughput: no request seen yet; floor unchanged")
            return
        p_frac = 0.0
        if rate > 0:
            p_frac = rate * isl * min(1.0, self.prefill_correction) / prefill_throughput(
                self.model, isl)
        cap = decode_throughput(self.model, isl + osl / 2, s.itl_slo_ms / self.decode_correction)
        d_frac = rate * osl / cap.tokens_per_s if rate > 0 else 0.0
        if not cap.meets_slo:
            notes.append(f"throughput: ITL SLO {s.itl_slo_ms} ms unreachable at context "
                         f"{isl + osl / 2:.0f} (batch 1 takes {cap.step_ms:.1f} ms)")
        ttft = self.model.prefill_ms(isl) * self.prefill_correction
        if ttft > s.ttft_slo_ms:
            notes.append(f"throughput: TTFT SLO {s.ttft_slo_ms} ms unreachable by scaling at "
                         f"ISL {isl:.0f} (prefill alone {ttft:.0f} ms)")
        need = ({"agg": p_frac + d_frac} if s.mode == "agg"
                else {"prefill": p_frac, "decode": d_frac})
        self.last_prediction = Prediction(rate, isl, osl, need, self.prefill_correction,
                                          self.decode_correction)
        for pool in self._pools:
            floor = self._clamp(pool, _ceil(need[pool]))
            self._floor[pool] = floor
            assert self._desired is not None
            target = max(floor, self._desired[pool]) if s.load_interval_s > 0 else floor
            self._set(pool, target, now, "throughput",
                      f"predicted {rate:.3g} req/s, ISL {isl:.0f}, OSL {osl:.0f} → "
                      f"{need[pool]:.2f} replicas (floor {floor})", actions)

    def _update_corrections(self, obs: Observations, d: TrafficCounters, isl: float,
                            osl: float) -> None:
        if d.ttft_count > 0:
            actual = d.ttft_sum_s / d.ttft_count * 1000.0
            self.prefill_correction = self._bound_corr(actual / self.model.prefill_ms(isl))
        if d.itl_count > 0:
            pool = "agg" if self.settings.mode == "agg" else "decode"
            loads = [w for w in obs.workers if w.role == pool and w.reported]
            batch = (sum(w.num_running for w in loads) / len(loads)) if loads else 1.0
            expected = expected_itl_ms(self.model, batch, isl + osl / 2)
            actual = d.itl_sum_s / d.itl_count * 1000.0
            self.decode_correction = self._bound_corr(actual / expected)

    def _load_step(self, now: float, obs: Observations, ready: Mapping[str, int],
                   actions: list[ScaleAction], notes: list[str]) -> None:
        s = self.settings
        ttft_ms = itl_ms = None
        if obs.traffic is not None and self._load_base is not None:
            d = obs.traffic.minus(self._load_base)
            if d.ttft_count > 0:
                ttft_ms = d.ttft_sum_s / d.ttft_count * 1000.0
            if d.itl_count > 0:
                itl_ms = d.itl_sum_s / d.itl_count * 1000.0
        self._load_base = obs.traffic
        assert self._desired is not None
        for pool in self._pools:
            desired = self._desired[pool]
            if now - self._last_change[pool] < s.cooldown_s:
                notes.append(f"load: {pool} in cooldown")
                continue
            if ready[pool] != desired:
                notes.append(f"load: {pool} has {ready[pool]} ready of {desired} desired; "
                             f"waiting for the last change")
                continue
            loads = [w for w in obs.workers if w.role == pool and w.reported]
            if not loads:
                continue
            n = len(loads)
            queue = sum(w.num_waiting for w in loads) / n
            kv = sum(w.kv_usage for w in loads) / n
            latencies: list[tuple[str, float, float]] = []  # (name, observed, slo)
            if pool in ("prefill", "agg") and ttft_ms is not None:
                latencies.append(("TTFT", ttft_ms, s.ttft_slo_ms))
            if pool in ("decode", "agg") and itl_ms is not None:
                latencies.append(("ITL", itl_ms, s.itl_slo_ms))
            model_itl = model_itl_fewer = None
            if pool in ("decode", "agg"):
                cap = self.model.kv_capacity_tokens
                model_itl = self.model.decode_step_ms(kv * cap) * self.decode_correction
                kv_fewer = _kv_with_one_fewer(loads, kv)
                model_itl_fewer = (self.model.decode_step_ms(min(kv_fewer, 1.0) * cap)
                                   * self.decode_correction)
            high: list[str] = []
            if queue > s.queue_high:
                high.append(f"queue {queue:.1f}/worker > {s.queue_high:g}")
            if kv > s.kv_high:
                high.append(f"KV usage {kv:.2f} > {s.kv_high:g}")
            for name, val, slo in latencies:
                if val > slo:
                    high.append(f"{name} {val:.0f} ms > SLO {slo:g} ms")
            if model_itl is not None and model_itl > s.itl_slo_ms:
                high.append(f"model ITL {model_itl:.1f} ms > SLO {s.itl_slo_ms:g} ms")
            if high:
                if desired >= s.limit(pool).max_replicas:
                    notes.append(f"load: {pool} overloaded ({'; '.join(high)}) at max replicas")
                self._set(pool, desired + 1, now, "load", "; ".join(high), actions)
                continue
            if desired <= self._floor[pool]:
                continue
            kv_fewer = _kv_with_one_fewer(loads, kv)
            low = (queue <= s.queue_low and kv < s.kv_low and kv_fewer < s.kv_high
                   and all(val < s.slo_low_fraction * slo for _, val, slo in latencies)
                   and (model_itl_fewer is None
                        or model_itl_fewer < s.slo_low_fraction * s.itl_slo_ms))
            if low:
                lat = ", ".join(f"{name} {val:.0f} ms" for name, val, _ in latencies)
                self._set(pool, desired - 1, now, "load",
                          f"all signals low (queue {queue:.1f}, KV {kv:.2f}"
                          f"{', ' + lat if lat else ''}); floor {self._floor[pool]}", actions)
