"""The P/D-aware TTFT policy (``ttft_pd``): P by its prefill queue, D by its decode load
(queued local prefills, its cache of the prompt, its decode step time at the added KV,
its KV headroom); RouterCore gives policies each worker's role."""

from __future__ import annotations

import random

import pytest

from services.common.perf_model import PolynomialPerfModel
from services.router.core import RouterCore
from services.router.disagg import DisaggConfig
from services.router.plan import WorkerRecord
from services.router.policies.base import RouteContext, WorkerOverlap, WorkerState
from services.router.policies.ttft import TtftPolicy
from services.router.policy_setup import default_registry

BS = 16
CAP_BLOCKS = 1000
POLY = PolynomialPerfModel(capacity=CAP_BLOCKS * BS)


def pd(**kw: float) -> TtftPolicy:
    args = {"own_weight": 1.0, "decode_itl_weight": 20.0} | kw
    return TtftPolicy(POLY, 8192, rng=random.Random(0), **args)  # type: ignore[arg-type]


def d(i: str, role: str = "decode", **kw: object) -> WorkerState:
    return WorkerState(i, f"addr-{i}", BS, role=role, kv_total_blocks=CAP_BLOCKS,
                       **kw)  # type: ignore[arg-type]


def ctx(n: int) -> RouteContext:
    return RouteContext("r", "m", tuple(range(n)))


def test_decode_workers_are_costed_by_their_decode_step_at_the_added_kv() -> None:
    p = pd()
    busy, idle = d("a", kv_usage=0.7), d("b", kv_usage=0.1)
    assert p.select(ctx(320), [busy, idle]).worker_id == "b"
    step = POLY.decode_step_ms
    own = 320
    want = p.prefill_ms(own, 0.1) + 20.0 * step(0.1 * CAP_BLOCKS * BS + own)
    assert p.last_costs["b"] == pytest.approx(want)
    # the router's own count of active blocks is used when it is above the last report
    fresh = d("c", kv_usage=0.1, active_blocks=700)
    assert p.cost(ctx(320), fresh) == pytest.approx(
        p.prefill_ms(own, 0.1) + 20.0 * step(700 * BS + own))


def test_decode_kv_headroom_outweighs_a_cache_hit() -> None:
    p = pd()
    full = d("a", kv_usage=0.93, overlap_blocks=20, prompt_blocks=20)  # holds the prompt
    roomy = d("b", kv_usage=0.3)
    assert p.select(ctx(320), [full, roomy]).worker_id == "b"
    assert p.last_costs["a"] > 1000.0  # past 90%: the penalty
    # without the pressure the cache hit wins
    cached = d("a", kv_usage=0.3, overlap_blocks=20, prompt_blocks=20)
    assert p.select(ctx(320), [cached, roomy]).worker_id == "a"


def test_local_prefills_queued_on_d_count() -> None:
    p = pd()
    stalled = d("a", kv_usage=0.2, pending_prefill_tokens=6000)
    assert p.select(ctx(320), [stalled, d("b", kv_usage=0.25)]).worker_id == "b"


def test_prefill_and_agg_workers_keep_the_prefill_queue_cost() -> None:
    p, plain = pd(), pd(decode_itl_weight=0.0)
    for role in ("prefill", "agg", ""):
        w = d("a", role=role, kv_usage=0.9, pending_prefill_tokens=3000)
        assert p.cost(ctx(500), w) == pytest.approx(plain.cost(ctx(500), w))
    # and with decode_itl_weight 0 a decode worker is costed as before too
    w = d("a", kv_usage=0.9, pending_prefill_tokens=3000)
    assert plain.cost(ctx(500), w) == pytest.approx(
        plain.prefill_ms(3500, 0.9) + plain.prefill_ms(500, 0.9))


def test_bad_pd_arguments_are_rejected() -> None:
    for bad in ({"kv_headroom": 1.0}, {"kv_headroom": 0.0}, {"decode_itl_weight": -1.0},
                {"kv_penalty_ms": -1.0}):
        with pytest.raises(ValueError):
            pd(**bad)


def test_core_gives_roles_and_ttft_pd_splits_p_and_d_by_their_own_loads() -> None:
    reg = default_registry(context={"perf_model": POLY})
    policy = reg.create("ttft_pd", random.Random(0))
    assert policy.name == "ttft_pd"
    c = RouterCore(policy=policy, disagg=DisaggConfig(conditional=False), clock=lambda: 0.0)
    recs = [WorkerRecord(i, f"addr-{i}", "m", role, BS, 1 << 20, "push", "L")
            for i, role in (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"),
                            ("d2", "decode"))]
    c.set_workers(recs)
    c.update_load("d1", 40, 0, 0.85, CAP_BLOCKS)  # d1 decodes a lot
    c.update_load("d2", 2, 0, 0.05, CAP_BLOCKS)
    c.update_load("p1", 0, 0, 0.0, CAP_BLOCKS)
    c.update_load("p2", 0, 0, 0.0, CAP_BLOCKS)
    first = c.route(RouteContext("a", "m", tuple(range(4000))))
    assert first.prefill is not None and first.worker.instance_id == "d2"
    busy_p = first.prefill.instance_id  # a tie (both idle): at random
    # busy_p now has 4000 tokens queued: the next prompt goes to the other P, D by load
    nxt = c.route(RouteContext("b", "m", tuple(range(10_000, 14_000)),
                               overlaps={"d1": WorkerOverlap("d1", 200)}))
    assert nxt.prefill is not None and nxt.prefill.instance_id != busy_p
    assert nxt.worker.instance_id == "d2"


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def local_pd(clock: FakeClock | None, **kw: float) -> TtftPolicy:
    args = {"local_duty": 0.5, "local_burst_ms": 400.0} | kw
    return TtftPolicy(POLY, 8192, own_weight=1.0, decode_itl_weight=20.0, clock=clock,
                      rng=random.Random(0), **args)  # type: ignore[arg-type]


def test_local_prefill_hook_is_off_without_duty_or_clock() -> None:
    p_state, d_state = d("p", role="prefill", pending_prefill_tokens=50_000), d("d")
    assert pd().prefer_local_prefill(ctx(2000), p_state, d_state) is None
    assert local_pd(None).prefer_local_prefill(ctx(2000), p_state, d_state) is None


def test_local_prefill_when_p_is_backed_up_within_ds_budget() -> None:
    clock = FakeClock()
    pol = local_pd(clock)
    idle_p, busy_p = d("p", role="prefill"), d("p", role="prefill",
                                                pending_prefill_tokens=40_000)
    dw = d("d", kv_usage=0.2)
    local, why = pol.prefer_local_prefill(ctx(2000), idle_p, dw) or (None, "")
    assert local is False and "remote prefill" in why  # P is as quick and idle
    grants = []
    for _ in range(4):  # each grant books prefill_ms(2000) / 0.5 of D's time
        local, why = pol.prefer_local_prefill(ctx(2000), busy_p, dw) or (None, "")
        grants.append(local)
    step_s = pol.prefill_ms(2000, 0.2) / 1000.0 / 0.5
    allowed = sum(1 for k in range(4) if k * step_s <= 0.4)  # burst 400 ms ahead
    assert grants == [True] * allowed + [False] * (4 - allowed)
    assert "budget" in why
    clock.t += 10.0  # the budget refills with time
    assert (pol.prefer_local_prefill(ctx(2000), busy_p, dw) or (None,))[0] is True
    pol.keep_only({"p"})
    assert pol._local_until == {}


def test_core_asks_the_hook_only_under_conditional_disaggregation() -> None:
    clock = FakeClock()
    for conditional in (True, False):
        pol = local_pd(clock)
        c = RouterCore(policy=pol, disagg=DisaggConfig(conditional=conditional),
                       clock=clock)
        c.set_workers([WorkerRecord(i, f"addr-{i}", "m", role, BS, 1 << 20, "push", "L")
                       for i, role in (("p1", "prefill"), ("d1", "decode"))])
        first = c.route(RouteContext("r0", "m", tuple(range(8000))))
        assert first.disaggregated  # both idle: P is as quick, no reason to load D
        plan = c.route(RouteContext("r1", "m", tuple(range(10_000, 18_000))))
        assert plan.disaggregated is not conditional, plan.reason  # P is backed up
        if conditional:
            assert "local prefill on D" in plan.reason
            assert c.pending_prefill() == {"p1": 8000, "d1": 8000}


def test_local_prefill_only_when_p_is_backed_up_past_local_min_ms() -> None:
    pol = local_pd(FakeClock(), local_min_ms=1500.0, local_burst_ms=10_000.0)
    dw = d("d", kv_usage=0.2)
    short = d("p", role="prefill", pending_prefill_tokens=20_000)
    remote = pol.prefill_ms(20_000 + 2000, 0.0)
    assert 300.0 < remote < 1500.0  # D would be quicker, but P is not backed up enough
    local, why = pol.prefer_local_prefill(ctx(2000), short, dw) or (None, "")
    assert local is False and "< 1500 ms" in why
    long = d("p", role="prefill", pending_prefill_tokens=80_000)
    assert (pol.prefer_local_prefill(ctx(2000), long, dw) or (None,))[0] is True
    with pytest.raises(ValueError):
        local_pd(FakeClock(), local_min_ms=-1.0)
