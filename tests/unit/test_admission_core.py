"""Admission decisions: Mooncake early rejection vs admission by current load."""

from __future__ import annotations

import pytest

from services.common.perf_model import PolynomialPerfModel
from services.router.admission.core import (
    AdmissionSettings,
    AlwaysAdmit,
    ClusterState,
    CurrentLoadAdmission,
    DecodeState,
    EarlyRejection,
    PendingJoin,
    PrefillState,
    RequestShape,
    RunningRequest,
    forecast_decode,
    make_policy,
)

MODEL = PolynomialPerfModel(capacity=65536)
SETTINGS = AdmissionSettings(itl_slo_ms=20.0, ttft_slo_ms=2000.0)
REQ = RequestShape(prompt_tokens=1000, output_tokens=100)


def policies() -> tuple[EarlyRejection, CurrentLoadAdmission]:
    return EarlyRejection(MODEL, SETTINGS), CurrentLoadAdmission(MODEL, SETTINGS)


def test_forecast_departures_and_arrivals() -> None:
    step_s = MODEL.decode_step_ms(1000) / 1000
    state = DecodeState("d", (RunningRequest(1000, 10),))
    fc = forecast_decode(state, 5 * step_s, MODEL)
    assert fc.batch == 1 and fc.contexts[0] == pytest.approx(1005)
    assert forecast_decode(state, 11 * step_s, MODEL).batch == 0  # finished
    joined = DecodeState("d", (), (PendingJoin(0.5, 800, 50),))
    assert forecast_decode(joined, 0.4, MODEL).batch == 0
    assert forecast_decode(joined, 0.5, MODEL).contexts == [800]
    assert forecast_decode(joined, 0.5, MODEL, include_pending=False).batch == 0


def test_accepts_under_light_load() -> None:
    cluster = ClusterState([DecodeState("d0", (RunningRequest(1000, 100),) * 2)],
                           [PrefillState("p0")])
    for policy in policies():
        dec = policy.decide(REQ, cluster)
        assert dec.admit and dec.reason == "ok" and dec.retry_after_s == 0
        assert dec.decode_worker == "d0" and dec.prefill_worker == "p0"
        assert dec.predicted_itl_ms < 20 and dec.predicted_ttft_ms < 2000


def test_rejects_when_queued_prefills_will_load_d_while_current_load_accepts() -> None:
    # D looks light now, but 20 prefills bound for it finish before this one does
    pending = tuple(PendingJoin(0.05 + 0.01 * i, 1500, 200) for i in range(20))
    d = DecodeState("d0", (RunningRequest(1000, 500),) * 2, pending)
    cluster = ClusterState([d], [PrefillState("p0", (2000,) * 4)])
    early, current = policies()
    now_view = current.decide(REQ, cluster)
    assert now_view.admit and now_view.predicted_itl_ms < 20
    dec = early.decide(REQ, cluster)
    assert not dec.admit and dec.reason == "predicted_itl"
    assert dec.predicted_itl_ms > 20
    assert "when its prefill finishes" in dec.detail
    # Retry-After: when the joined requests will have finished; consistent with the forecast
    assert 1.0 < dec.retry_after_s < SETTINGS.max_retry_after_s
    later = d.pending[-1].arrive_in_s + dec.retry_after_s
    fc = forecast_decode(d, later + 1.0, MODEL)
    assert MODEL.decode_step_ms(fc.kv_tokens + REQ.prompt_tokens) <= 20


def test_accepts_when_current_load_will_have_left_while_current_load_rejects() -> None:
    d = DecodeState("d0", (RunningRequest(1500, 2),) * 20)  # heavy now, finishing in 2 steps
    cluster = ClusterState([d], [PrefillState("p0", (2000,) * 4)])
    early, current = policies()
    assert not current.decide(REQ, cluster).admit
    assert early.decide(REQ, cluster).admit


def test_burst_oscillation() -> None:
    """A burst arrives while D is idle: current-load admission lets all of it through (D is
    still empty while the burst prefills) and D then runs far over the ITL SLO; early
    rejection stops admitting once the predicted load reaches the SLO."""

    def run(policy: EarlyRejection | CurrentLoadAdmission) -> tuple[int, float]:
        d = DecodeState("d0")
        p = PrefillState("p0")
        admitted = 0
        for _ in range(40):
            dec = policy.decide(RequestShape(1000, 200), ClusterState([d], [p]))
            if not dec.admit:
                continue
            admitted += 1
            arrive = dec.predicted_ttft_ms / 1000 - dec.predicted_itl_ms / 1000
            d = DecodeState("d0", d.running, (*d.pending, PendingJoin(arrive, 1000, 200)))
            p = PrefillState("p0", (*p.queued_prompt_tokens, 1000))
        last = max(j.arrive_in_s for j in d.pending)
        return admitted, MODEL.decode_step_ms(forecast_decode(d, last, MODEL).kv_tokens)

    early, current = policies()
    n_current, itl_current = run(current)
    n_early, itl_early = run(early)
    assert n_current == 40 and itl_current > 20
    assert 0 < n_early < 40 and itl_early <= 20


def test_rejects_on_predicted_ttft_with_retry_after() -> None:
    cluster = ClusterState([DecodeState("d0")], [PrefillState("p0", (2000,) * 60)])
    for policy in policies():
        dec = policy.decide(REQ, cluster)
        assert not dec.admit and dec.reason == "predicted_ttft"
        assert dec.retry_after_s == pytest.approx(
            max((dec.predicted_ttft_ms - 2000) / 1000, 1.0))


def test_kv_full_and_no_workers() -> None:
    early, _ = policies()
    dec = early.decide(RequestShape(70_000, 10), ClusterState([DecodeState("d0")]))
    assert not dec.admit and dec.reason in ("kv_full", "predicted_ttft")
    huge_ttft = AdmissionSettings(itl_slo_ms=50, ttft_slo_ms=1e9)
    dec = EarlyRejection(MODEL, huge_ttft).decide(RequestShape(70_000, 10),
                                                  ClusterState([DecodeState("d0")]))
    assert dec.reason == "kv_full"
    dec = early.decide(REQ, ClusterState([]))
    assert not dec.admit and dec.reason == "no_decode_workers" and dec.retry_after_s >= 1


def test_picks_the_decode_worker_that_meets_the_slo() -> None:
    busy = DecodeState("busy", (RunningRequest(1500, 500),) * 20)
    idle = DecodeState("idle")
    dec = EarlyRejection(MODEL, SETTINGS).decide(REQ, ClusterState([busy, idle]))
    assert dec.admit and dec.decode_worker == "idle"
    assert dec.prefill_worker is None  # no P pool: prefill on D
    assert dec.predicted_ttft_ms == pytest.approx(MODEL.prefill_ms(1000) + dec.predicted_itl_ms)


def test_cached_prefix_shortens_prefill() -> None:
    early, _ = policies()
    cluster = ClusterState([DecodeState("d0")], [PrefillState("p0")])
    cold = early.decide(RequestShape(4000, 10), cluster)
    warm = early.decide(RequestShape(4000, 10, cached_tokens=3000), cluster)
    assert warm.predicted_ttft_ms < cold.predicted_ttft_ms


def test_from_aggregate_and_registry() -> None:
    d = DecodeState.from_aggregate("d", active_requests=4, kv_tokens=8000,
                                   mean_remaining_tokens=50)
    assert len(d.running) == 4 and d.running[0] == RunningRequest(2000, 50)
    assert DecodeState.from_aggregate("d", 0, 0, 50).running == ()
    assert isinstance(make_policy("none", MODEL), AlwaysAdmit)
    assert make_policy("none", MODEL).decide(REQ, ClusterState([])).admit
    assert make_policy("early", MODEL).name == "early"
    with pytest.raises(ValueError, match="unknown admission policy"):
        make_policy("random", MODEL)
    with pytest.raises(ValueError, match="SLOs"):
        EarlyRejection(MODEL, AdmissionSettings(itl_slo_ms=0))
