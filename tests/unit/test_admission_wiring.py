"""Admission control wired into the router core: flights, state building, decisions.

The clock is injected, so every estimate is checked at exact times without sleeping.
Numbers: Dynamo's mocker model with a 10k-token KV (step ≈ 5.7 ms empty, ≈ 19.6 ms at
30 % KV, ≈ 23.2 ms at 40 %); prompts of 1000 tokens prefill in ≈ 32 ms.
"""

from __future__ import annotations

import random

import pytest

from services.common.config import ConfigError, load_config
from services.common.perf_model import PolynomialPerfModel
from services.router.admission.core import AdmissionSettings
from services.router.admission.live import DecodeLoadReport, Flight, RouterAdmission, tokens_for_ms
from services.router.core import RouterCore
from services.router.disagg import DisaggConfig
from services.router.main import RouterConfig
from services.router.plan import Rejected, WorkerRecord
from services.router.policies.base import RouteContext
from services.router.policy_setup import default_registry
from tests.manual_clock import Clock

BS = 16
CAP = 10_000
MODEL = PolynomialPerfModel(CAP)


def admission(policy: str, itl_ms: float = 20.0, ttft_ms: float = 2000.0) -> RouterAdmission:
    return RouterAdmission(policy, lambda cap: PolynomialPerfModel(cap or CAP),
                           AdmissionSettings(itl_slo_ms=itl_ms, ttft_slo_ms=ttft_ms),
                           kv_capacity_tokens=CAP)


def w(i: str, role: str) -> WorkerRecord:
    return WorkerRecord(i, f"addr-{i}", "m", role, BS, 8192, "mock" if role != "agg" else "",
                        "L")


def core(policy: str, roles: tuple[str, ...] = ("agg",), **kw: object) -> tuple[RouterCore,
                                                                                 Clock]:
    reg = default_registry()
    clock = Clock(100.0)
    rng = random.Random(0)
    c = RouterCore(policy=reg.create("least_loaded", rng),
                   prefill_policy=reg.create("least_loaded", rng),
                   disagg=DisaggConfig(conditional=False),
                   admission=admission(policy, **kw) if policy != "none" else None,  # type: ignore[arg-type]
                   clock=clock)
    c.set_workers([w(f"{r[0]}1", r) for r in roles])
    return c, clock


def ctx(rid: str, n: int = 1000, start: int = 0) -> RouteContext:
    return RouteContext(rid, "m", tuple(range(start, start + n)))


def burst(c: RouterCore, n: int, prefix: str = "r") -> list[bool]:
    out = []
    for i in range(n):
        try:
            c.route(ctx(f"{prefix}{i}", start=100_000 * (i + 1)), max_tokens=100)
            out.append(True)
        except Rejected:
            out.append(False)
    return out


def test_tokens_for_ms_inverts_the_prefill_model() -> None:
    assert tokens_for_ms(MODEL, 0) == 0
    assert tokens_for_ms(MODEL, MODEL.prefill_ms(0) / 2) == 0
    t = tokens_for_ms(MODEL, MODEL.prefill_ms(1000))
    assert 999 <= t <= 1001


def test_flight_is_pending_until_its_estimated_prefill_finishes_then_generates() -> None:
    c, clock = core("early")
    plan = c.route(ctx("a"), max_tokens=100)
    assert plan.admission is not None and plan.admission.admit
    (f,) = c.flights()
    assert f.request_id == "a" and f.decode == "a1" and f.prefill is None
    assert f.output_tokens == 100 and f.routed_at == 100.0
    assert f.prefill_done_at == pytest.approx(100.0 + MODEL.prefill_ms(1000) / 1000)
    adm = c.admission
    assert adm is not None
    st = adm.decode_state(MODEL, "a1", c.flights(), clock.t, None)
    assert not st.running and len(st.pending) == 1
    assert st.pending[0].arrive_in_s == pytest.approx(MODEL.prefill_ms(1000) / 1000)
    clock.t = f.prefill_done_at + 0.5  # 0.5 s of decoding at ~11 ms a step: ~45 tokens
    st = adm.decode_state(MODEL, "a1", c.flights(), clock.t, None)
    assert not st.pending and len(st.running) == 1
    r = st.running[0]
    step = MODEL.decode_step_ms(r.context_tokens) / 1000
    assert r.context_tokens - 1000 == pytest.approx(0.5 / step, abs=2)
    assert r.remaining_tokens == pytest.approx(100 - 0.5 / step, abs=2)
    clock.advance(60)  # long past its expected end but not released: 1 token left
    assert adm.decode_state(MODEL, "a1", c.flights(), clock.t, None).running[0] \
        .remaining_tokens == 1
    assert c.release("a") and not c.flights()


def test_prefills_on_one_worker_queue_one_after_another() -> None:
    c, _ = core("early", roles=("prefill", "decode"))
    c.route(ctx("a"), max_tokens=10)
    c.route(ctx("b", start=50_000), max_tokens=10)
    fa, fb = sorted(c.flights(), key=lambda f: f.request_id)
    assert fa.prefill == "p1" and fa.decode == "d1"
    own = MODEL.prefill_ms(1000) / 1000
    assert fb.prefill_done_at == pytest.approx(fa.prefill_done_at + own)
    adm = c.admission
    assert adm is not None
    assert adm.prefill_wait_s(c.flights(), "p1", 100.0) == pytest.approx(2 * own)
    cluster = adm.cluster(MODEL, "d1", "p1", c.flights(), 100.0, {})
    (p,) = cluster.prefill
    assert MODEL.prefill_ms(p.queued_prompt_tokens[0]) == pytest.approx(2000 * own, rel=0.01)
    assert len(cluster.decode[0].pending) == 2


def test_early_rejects_a_burst_current_load_does_not_until_it_lands() -> None:
    early, _ = core("early")
    cur, _ = core("current_load")
    got_early, got_cur = burst(early, 8), burst(cur, 8)
    assert got_early[:3] == [True] * 3 and not any(got_early[3:])
    assert all(got_cur)  # nothing has reached D yet: current load is 0
    assert early.in_flight() == {"a1": 3}  # rejected requests are not counted
    assert len(early.flights()) == 3


def test_rejection_carries_reason_retry_after_and_the_plan() -> None:
    c, clock = core("early")
    burst(c, 3)
    with pytest.raises(Rejected) as info:
        c.route(ctx("x", start=9_000_000), max_tokens=100)
    d = info.value.decision
    assert not d.admit and d.reason == "predicted_itl" and d.policy == "early"
    assert d.retry_after_s >= 1.0 and d.predicted_itl_ms > 20.0
    assert info.value.plan.worker.instance_id == "a1"
    assert "x" not in {f.request_id for f in c.flights()}
    clock.advance(30)  # the admitted ones are (estimated) done: early admits again
    assert c.route(ctx("y", start=8_000_000), max_tokens=100).admission.admit  # type: ignore[union-attr]


def test_current_load_keeps_rejecting_what_early_knows_has_left() -> None:
    early, ce = core("early")
    cur, cc = core("current_load")
    burst(early, 3)
    burst(cur, 3)
    ce.advance(30)
    cc.advance(30)
    assert early.route(ctx("late", start=7_000_000), max_tokens=100).admission.admit  # type: ignore[union-attr]
    # current_load sees 3 x ~1100 tokens still on D (not released) and no departures
    with pytest.raises(Rejected):
        cur.route(ctx("late", start=7_000_000), max_tokens=100)


def test_load_report_adds_kv_the_router_does_not_know() -> None:
    c, _ = core("early")
    c.update_load("a1", num_running=4, num_waiting=0, kv_usage=0.5, kv_total_blocks=CAP // BS)
    with pytest.raises(Rejected):  # 5000 foreign tokens + 1000 → ~29 ms
        c.route(ctx("a"), max_tokens=100)
    adm = c.admission
    assert adm is not None
    st = adm.decode_state(MODEL, "a1", [], 0.0, DecodeLoadReport(0.5, CAP // BS, BS))
    assert [r.context_tokens for r in st.running] == [5000]


def test_capacity_comes_from_the_load_report_when_not_configured() -> None:
    adm = RouterAdmission("early", lambda cap: PolynomialPerfModel(cap or 262_144))
    assert adm.model_for(0).kv_capacity_tokens == 262_144
    assert adm.model_for(4096).kv_capacity_tokens == 4096


def test_admission_off_tracks_nothing() -> None:
    c, _ = core("none")
    assert all(burst(c, 20))
    assert not c.flights() and c.in_flight() == {"a1": 20}
    assert c.route(ctx("z", start=1), max_tokens=5).admission is None


def test_router_config_flags_build_the_admission() -> None:
    cfg = load_config(RouterConfig, ["--admission", "early", "--admission-itl-slo-ms", "12",
                                     "--admission-ttft-slo-ms", "900",
                                     "--admission-perf-speedup", "4",
                                     "--admission-kv-capacity-tokens", "8192"], {})
    adm = cfg.make_admission()
    assert adm is not None and adm.policy_name == "early"
    assert adm.settings.itl_slo_ms == 12 and adm.settings.ttft_slo_ms == 900
    m = adm.model_for(0)
    assert m.kv_capacity_tokens == 8192
    assert m.decode_step_ms(0) == pytest.approx(5.74 / 4)
    env = load_config(RouterConfig, [], {"KVMESH_ADMISSION": "current_load"})
    assert env.make_admission().policy_name == "current_load"  # type: ignore[union-attr]
    assert load_config(RouterConfig, [], {}).make_admission() is None
    with pytest.raises(ConfigError):
        load_config(RouterConfig, ["--admission", "maybe"], {})
    with pytest.raises(ConfigError):
        load_config(RouterConfig, ["--admission", "early", "--admission-perf-model",
                                   "/nonexistent.json"], {})
    with pytest.raises(ConfigError):
        load_config(RouterConfig, ["--admission-itl-slo-ms", "0"], {})


def test_flight_prefill_worker() -> None:
    assert Flight("a", "d", "p", 1, 1, 1, 0, 0).prefill_worker() == "p"
    assert Flight("a", "d", None, 1, 1, 1, 0, 0).prefill_worker() == "d"


def test_cli_and_launcher_pass_admission_and_planner(capsys: pytest.CaptureFixture[str]) -> None:
    from services.launcher.cli import main
    from services.launcher.up import LocalMesh, MeshSpec

    env = LocalMesh(MeshSpec(admission="early", admission_itl_slo_ms=12.0)).admission_env()
    assert env == {"KVMESH_ADMISSION": "early", "KVMESH_ADMISSION_TTFT_SLO_MS": "2000.0",
                   "KVMESH_ADMISSION_ITL_SLO_MS": "12.0"}
    assert load_config(RouterConfig, [], env).make_admission() is not None
    assert main(["planner", "--actuator", "nope"]) == 2  # dispatched to the planner's main
    assert "actuator" in capsys.readouterr().err
