"""Live admission control in the router (pure): in-flight requests → the admission core.

No grpc, etcd or asyncio; every time is a number from the clock the router core injects.
Contract of :class:`RouterAdmission`:

- It wraps one :mod:`services.router.admission.core` policy (``early``, ``current_load``; ``none``
  never gets here) with its :class:`~services.router.admission.core.AdmissionSettings` and a
  performance model factory: ``model_for(capacity_tokens)`` (the capacity of the chosen
  decode worker: ``kv_capacity_tokens`` when > 0, else the worker's load report
  ``kv_total_blocks × block_size``, else the model's default).
- :class:`Flight` is what the router keeps per admitted request: the worker producing
  tokens (``decode``: D or the aggregated worker), the prefill worker when
  disaggregated, prompt and uncached tokens, the expected output (``max_tokens``, or
  ``default_output_tokens`` when unknown), when it was routed and when its prefill (and
  KV transfer) is estimated to finish (``prefill_done_at``).
- ``prefill_wait_s(flights, p, now)``: how long a new prefill on worker ``p`` waits: the
  prefills queued there are served one after another, so it is the latest estimated
  finish of those not finished yet, minus ``now`` (0 when idle).
- ``horizon_s(...)``: the new request's ``prefill_done_at − now``: wait + its own prefill
  (uncached tokens) + KV transfer (``transfer_ms_per_token`` × prompt when disaggregated).
- ``cluster(...)`` builds the core's :class:`ClusterState` for the routed pair only (the
  request runs there, whatever another worker could offer): for D, each flight whose
  prefill has finished is *running* with ``prompt + generated`` context tokens and
  ``max(expected − generated, 1)`` left, where ``generated`` = time since its prefill
  finished / the model's step time at D's current KV (× ``decode_correction``); each
  flight whose prefill has not finished is a *pending join* arriving at its estimate.
  When D's load report shows more KV than the running flights hold (another router's
  requests, slower than modelled), the difference is added as one running request with
  the flights' mean remaining tokens. The prefill state is P's wait (disaggregated) or
  D's own (aggregated / prefill on D), expressed as the uncached tokens whose prefill
  takes that long under the model.
- ``decide(...)`` calls the policy on that state and returns its
  :class:`~services.router.admission.core.AdmissionDecision`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from services.common.perf_model import PerfModel
from services.router.admission.core import (
    AdmissionDecision,
    AdmissionPolicy,
    AdmissionSettings,
    ClusterState,
    DecodeState,
    PendingJoin,
    PrefillState,
    RequestShape,
    RunningRequest,
    make_policy,
)


@dataclass(frozen=True)
class Flight:
    """One admitted request, as the router tracks it (times from the router's clock)."""

    request_id: str
    decode: str
    prefill: str | None
    prompt_tokens: int
    uncached_tokens: int
    output_tokens: int
    routed_at: float
    prefill_done_at: float

    def prefill_worker(self) -> str:
        """Where its prefill runs: P when disaggregated, else the decode/agg worker."""
        return self.prefill or self.decode


@dataclass(frozen=True)
class DecodeLoadReport:
    """The parts of a worker's load report admission uses."""

    kv_usage: float = 0.0
    kv_total_blocks: int = 0
    block_size: int = 0

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_total_blocks * self.block_size

    @property
    def kv_tokens(self) -> float:
        return self.kv_usage * self.kv_capacity_tokens


def tokens_for_ms(model: PerfModel, ms: float) -> int:
    """The uncached prompt tokens whose prefill takes about ``ms`` under ``model`` (0 when
    even an empty prefill takes longer); bisection, the model being monotonic."""
    if ms <= 0 or model.prefill_ms(0) >= ms:
        return 0
    lo, hi = 0, 1
    while model.prefill_ms(hi) < ms and hi < 1 << 30:
        hi *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if model.prefill_ms(mid) < ms:
            lo = mid
        else:
            hi = mid
    return hi


class RouterAdmission:
    """See the module docstring."""

    def __init__(self, policy: str, model_factory: Callable[[int], PerfModel],
                 settings: AdmissionSettings | None = None, kv_capacity_tokens: int = 0,
                 default_output_tokens: int = 256) -> None:
        self.policy_name = policy
        self.settings = settings or AdmissionSettings()
        bad = self.settings.problems()
        if bad:
            raise ValueError("; ".join(bad))
        if default_output_tokens < 1 or kv_capacity_tokens < 0:
            raise ValueError("default_output_tokens must be >= 1, kv_capacity_tokens >= 0")
        self._factory = model_factory
        self._capacity = kv_capacity_tokens
        self.default_output_tokens = default_output_tokens
        self._models: dict[int, tuple[PerfModel, AdmissionPolicy]] = {}
        self.model_for(kv_capacity_tokens)  # fail early on a bad policy or model

    def _entry(self, capacity: int) -> tuple[PerfModel, AdmissionPolicy]:
        got = self._models.get(capacity)
        if got is None:
            model = self._factory(capacity)
            got = (model, make_policy(self.policy_name, model, self.settings))
            self._models[capacity] = got
        return got

    def model_for(self, capacity_tokens: int) -> PerfModel:
        """The performance model for a decode worker of ``capacity_tokens`` (0: default)."""
        return self._entry(self._capacity or max(capacity_tokens, 0))[0]

    def _policy_for(self, capacity_tokens: int) -> AdmissionPolicy:
        return self._entry(self._capacity or max(capacity_tokens, 0))[1]

    def output_tokens(self, max_tokens: int) -> int:
        """Expected output length: ``max_tokens``, or the default when unknown."""
        return max_tokens if max_tokens > 0 else self.default_output_tokens

    def prefill_wait_s(self, flights: Iterable[Flight], worker: str, now: float) -> float:
        """Seconds until ``worker`` has finished the prefills queued on it."""
        ends = [f.prefill_done_at for f in flights
                if f.prefill_worker() == worker and f.prefill_done_at > now]
        return max(ends) - now if ends else 0.0

    def horizon_s(self, model: PerfModel, wait_s: float, prompt_tokens: int,
                  uncached_tokens: int, disaggregated: bool) -> float:
        """Seconds from now until a new request's KV is on its decode worker."""
        transfer = prompt_tokens * self.settings.transfer_ms_per_token if disaggregated else 0.0
        return wait_s + (model.prefill_ms(uncached_tokens) + transfer) / 1000.0

    def decode_state(self, model: PerfModel, worker: str, flights: Iterable[Flight],
                     now: float, load: DecodeLoadReport | None = None) -> DecodeState:
        """The core's view of decode worker ``worker`` at ``now`` (see the docstring)."""
        mine = [f for f in flights if f.decode == worker]
        pending = tuple(PendingJoin(f.prefill_done_at - now, f.prompt_tokens, f.output_tokens)
                        for f in mine if f.prefill_done_at > now)
        started = [f for f in mine if f.prefill_done_at <= now]
        corr = self.settings.decode_correction
        kv = float(sum(f.prompt_tokens for f in started))
        generated = [0.0] * len(started)
        for _ in range(2):  # step time at the KV the batch holds (prompts, then + outputs)
            step_s = model.decode_step_ms(kv) * corr / 1000.0
            generated = [min((now - f.prefill_done_at) / step_s, float(f.output_tokens))
                         for f in started]
            kv = sum(f.prompt_tokens + g for f, g in zip(started, generated, strict=True))
        running = [RunningRequest(int(f.prompt_tokens + g), max(int(f.output_tokens - g), 1))
                   for f, g in zip(started, generated, strict=True)]
        if load is not None and load.kv_capacity_tokens > 0:
            extra = load.kv_tokens - sum(r.context_tokens for r in running)
            if extra > max(load.block_size, 1):
                left = (sum(r.remaining_tokens for r in running) // len(running) if running
                        else self.default_output_tokens)
                running.append(RunningRequest(int(extra), max(left, 1)))
        return DecodeState(worker, tuple(running), pending)

    def cluster(self, model: PerfModel, decode: str, prefill: str | None,
                flights: Iterable[Flight], now: float,
                loads: Mapping[str, DecodeLoadReport]) -> ClusterState:
        """The routed pair as the core's ClusterState (see the module docstring)."""
        flights = list(flights)
        wait_ms = self.prefill_wait_s(flights, prefill or decode, now) * 1000.0
        queue = tokens_for_ms(model, wait_ms)
        return ClusterState(
            decode=[self.decode_state(model, decode, flights, now, loads.get(decode))],
            prefill=[PrefillState(prefill or decode, (queue,) if queue else ())])

    def decide(self, request: RequestShape, decode: str, prefill: str | None,
               flights: Iterable[Flight], now: float,
               loads: Mapping[str, DecodeLoadReport]) -> AdmissionDecision:
        """The policy's decision for ``request`` routed to ``decode`` (and ``prefill``)."""
        load = loads.get(decode)
        capacity = load.kv_capacity_tokens if load is not None else 0
        model = self.model_for(capacity)
        cluster = self.cluster(model, decode, prefill, flights, now, loads)
        return self._policy_for(capacity).decide(request, cluster)
