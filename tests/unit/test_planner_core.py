"""Planner state machine: decisions for given tick sequences (injected clock, no sleeps)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import pytest

from services.common.perf_model import PolynomialPerfModel, decode_throughput, prefill_throughput
from services.planner.core import (
    Observations,
    PlannerCore,
    PlannerSettings,
    PoolLimits,
    ScalingDecision,
    TrafficCounters,
    WorkerLoad,
)

MODEL = PolynomialPerfModel(capacity=100_000)


@dataclass
class Traffic:
    """Cumulative frontend counters, advanced interval by interval."""

    c: TrafficCounters = field(default_factory=TrafficCounters)

    def add(self, requests: float, isl: float = 1000, osl: float = 200,
            ttft_s: float | None = None, itl_s: float | None = None) -> TrafficCounters:
        c = self.c
        ttft_n = requests if ttft_s is not None else 0
        itl_n = requests * osl if itl_s is not None else 0
        self.c = TrafficCounters(
            c.requests + requests, c.input_tokens + requests * isl,
            c.output_tokens + requests * osl, c.ttft_sum_s + ttft_n * (ttft_s or 0),
            c.ttft_count + ttft_n, c.itl_sum_s + itl_n * (itl_s or 0), c.itl_count + itl_n,
            c.finished + requests)
        return self.c


def pool(n_p: int, n_d: int, **load: float) -> list[WorkerLoad]:
    return ([WorkerLoad(f"p{i}", "prefill", **load) for i in range(n_p)]  # type: ignore[arg-type]
            + [WorkerLoad(f"d{i}", "decode", **load) for i in range(n_d)])  # type: ignore[arg-type]


def settings(**kw: object) -> PlannerSettings:
    base: dict[str, object] = dict(throughput_interval_s=60, load_interval_s=0, cooldown_s=0,
                                   itl_slo_ms=20, ttft_slo_ms=1000,
                                   limits={"prefill": PoolLimits(1, 20),
                                           "decode": PoolLimits(1, 20)})
    base.update(kw)
    return PlannerSettings(**base)  # type: ignore[arg-type]


def expected_need(rate: float, isl: float, osl: float, itl_slo: float = 20) -> tuple[int, int]:
    p = rate * isl / prefill_throughput(MODEL, isl)
    d = rate * osl / decode_throughput(MODEL, isl + osl / 2, itl_slo).tokens_per_s
    return math.ceil(p), math.ceil(d)


def test_first_tick_clamps_to_min_replicas() -> None:
    core = PlannerCore(settings(), MODEL)
    dec = core.tick(0.0, Observations(pool(0, 1)))
    assert dec.desired == {"prefill": 1, "decode": 1}
    assert dec.ready == {"prefill": 0, "decode": 1}
    [a] = dec.actions
    assert (a.pool, a.kind, a.n, a.source) == ("prefill", "scale_up", 1, "init")


def test_throughput_scales_up_on_rising_rate() -> None:
    core = PlannerCore(settings(), MODEL)
    t = Traffic()
    core.tick(0.0, Observations(pool(1, 1), t.c))
    # nothing happens between interval boundaries
    assert core.tick(30.0, Observations(pool(1, 1), t.add(1000))).actions == ()
    dec = core.tick(60.0, Observations(pool(1, 1), t.add(1400)))  # 2400 req / 60 s = 40 req/s
    p5, d5 = expected_need(40, 1000, 200)
    assert dec.desired == {"prefill": p5, "decode": d5} and p5 > 1 and d5 > 1
    assert {a.pool for a in dec.actions} == {"prefill", "decode"}
    assert all(a.source == "throughput" and a.kind == "scale_up" for a in dec.actions)
    assert "40 req/s" in dec.actions[0].reason
    dec = core.tick(120.0, Observations(pool(p5, d5), t.add(6000)))  # 100 req/s
    p20, d20 = expected_need(100, 1000, 200)
    assert dec.desired == {"prefill": p20, "decode": d20}
    assert p20 > p5 and d20 > d5
    assert core.last_prediction is not None and core.last_prediction.rate == pytest.approx(100)


def test_without_load_mode_throughput_also_scales_down() -> None:
    core = PlannerCore(settings(), MODEL)
    t = Traffic()
    core.tick(0.0, Observations(pool(1, 1), t.c))
    up = core.tick(60.0, Observations(pool(1, 1), t.add(6000)))
    down = core.tick(120.0, Observations(pool(1, 1), t.add(60)))  # 1 req/s
    assert down.desired["decode"] < up.desired["decode"]
    assert any(a.kind == "scale_down" and a.source == "throughput" for a in down.actions)


def test_max_and_min_replicas_bound_every_decision() -> None:
    lim = {"prefill": PoolLimits(2, 3), "decode": PoolLimits(1, 4)}
    core = PlannerCore(settings(limits=lim), MODEL)
    t = Traffic()
    assert core.tick(0.0, Observations(pool(1, 1), t.c)).desired == {"prefill": 2, "decode": 1}
    dec = core.tick(60.0, Observations(pool(2, 1), t.add(60_000)))  # 1000 req/s
    assert dec.desired == {"prefill": 3, "decode": 4}
    dec = core.tick(120.0, Observations(pool(3, 4), t.add(0)))  # idle
    assert dec.desired == {"prefill": 2, "decode": 1}
    assert dec.floor == {"prefill": 2, "decode": 1}


def test_load_correction_is_one_replica_per_interval_and_waits_for_ready() -> None:
    core = PlannerCore(settings(throughput_interval_s=0, load_interval_s=5), MODEL)
    core.tick(0.0, Observations(pool(1, 1)))
    busy = pool(1, 0, num_waiting=5) + pool(0, 1)
    dec = core.tick(5.0, Observations(busy))
    [a] = dec.actions
    assert (a.pool, a.kind, a.n, a.source) == ("prefill", "scale_up", 1, "load")
    assert "queue 5.0/worker" in a.reason
    # the new prefill worker is not ready yet: no second step on stale signals
    dec = core.tick(10.0, Observations(busy))
    assert dec.actions == () and any("waiting for the last change" in n for n in dec.notes)
    dec = core.tick(15.0, Observations(pool(2, 0, num_waiting=4) + pool(0, 1)))
    assert [(a.pool, a.to_replicas) for a in dec.actions] == [("prefill", 3)]


def test_load_scale_up_on_kv_usage_and_itl() -> None:
    core = PlannerCore(settings(throughput_interval_s=0, load_interval_s=5), MODEL)
    t = Traffic()
    core.tick(0.0, Observations(pool(1, 1), t.c))
    dec = core.tick(5.0, Observations(pool(1, 0) + pool(0, 1, kv_usage=0.9), t.c))
    assert [(a.pool, a.kind) for a in dec.actions] == [("decode", "scale_up")]
    assert "KV usage 0.90" in dec.actions[0].reason
    core2 = PlannerCore(settings(throughput_interval_s=0, load_interval_s=5), MODEL)
    core2.tick(0.0, Observations(pool(1, 1), t.c))
    dec = core2.tick(5.0, Observations(pool(1, 1), t.add(10, ttft_s=0.1, itl_s=0.045)))
    assert [(a.pool, a.kind) for a in dec.actions] == [("decode", "scale_up")]
    assert "ITL 45 ms > SLO 20 ms" in dec.actions[0].reason


def test_cooldown_blocks_load_changes() -> None:
    core = PlannerCore(settings(throughput_interval_s=0, load_interval_s=5, cooldown_s=30), MODEL)
    core.tick(0.0, Observations(pool(1, 1)))
    assert core.tick(5.0, Observations(pool(1, 1, num_waiting=9))).desired["prefill"] == 2
    for now in (10.0, 15.0, 20.0, 25.0, 30.0):
        dec = core.tick(now, Observations(pool(2, 1, num_waiting=9)))
        assert dec.desired["prefill"] == 2, now
        assert any("prefill in cooldown" in n for n in dec.notes)
    # 30 s after the change the pool may move again
    dec = core.tick(35.0, Observations(pool(2, 1, num_waiting=9)))
    assert dec.desired["prefill"] == 3


def test_scale_down_only_when_all_signals_are_comfortably_low() -> None:
    core = PlannerCore(settings(throughput_interval_s=0, load_interval_s=5, itl_slo_ms=50), MODEL)
    core.tick(0.0, Observations(pool(1, 4)))
    # KV usage moderate: 0.5 > kv_low → hold
    dec = core.tick(5.0, Observations(pool(1, 4, kv_usage=0.5)))
    assert dec.actions == ()
    # queue non-empty → hold
    dec = core.tick(10.0, Observations(pool(1, 4, kv_usage=0.1, num_waiting=1)))
    assert dec.actions == ()
    # all low → −1 per interval down to min
    seen = []
    for i, n in enumerate((4, 3, 2, 1, 1)):
        dec = core.tick(15.0 + 5 * i, Observations(pool(1, n, kv_usage=0.1)))
        seen.append(dec.desired["decode"])
    assert seen == [3, 2, 1, 1, 1]


def test_throughput_floor_holds_during_a_short_idle_period() -> None:
    core = PlannerCore(settings(throughput_interval_s=180, load_interval_s=5,
                                predictor="moving_average", predictor_window=3), MODEL)
    t = Traffic()
    core.tick(0.0, Observations(pool(1, 1), t.c))
    dec = core.tick(180.0, Observations(pool(1, 1), t.add(180 * 30)))  # 30 req/s
    floor = dec.floor
    assert floor["decode"] > 1 and dec.desired == floor
    # load spikes: one more decode replica above the floor
    dec = core.tick(185.0, Observations(pool(floor["prefill"], floor["decode"], num_waiting=5),
                                        t.c))
    assert dec.desired["decode"] == floor["decode"] + 1
    # then a short idle period (< throughput interval): load mode walks back to the floor only
    desired: list[int] = []
    for now in range(190, 356, 5):
        d = core.desired
        dec = core.tick(float(now), Observations(pool(d["prefill"], d["decode"]), t.c))
        desired.append(dec.desired["decode"])
    assert min(desired) == floor["decode"] and desired[-1] == floor["decode"]
    # the next throughput tick sees one idle interval; the moving average keeps a floor > 1
    d = core.desired
    dec = core.tick(360.0, Observations(pool(d["prefill"], d["decode"]), t.c))
    assert 1 < dec.floor["decode"] <= floor["decode"]
    assert dec.desired["decode"] >= dec.floor["decode"]


def test_load_scale_up_at_max_is_a_note_not_an_action() -> None:
    lim = {"prefill": PoolLimits(1, 1), "decode": PoolLimits(1, 1)}
    core = PlannerCore(settings(throughput_interval_s=0, load_interval_s=5, limits=lim), MODEL)
    core.tick(0.0, Observations(pool(1, 1)))
    dec = core.tick(5.0, Observations(pool(1, 1, num_waiting=9)))
    assert dec.actions == ()
    assert any("at max replicas" in n for n in dec.notes)


def test_decode_correction_raises_the_decode_count() -> None:
    def run(itl_s: float | None) -> ScalingDecision:
        core = PlannerCore(settings(), MODEL)
        t = Traffic()
        core.tick(0.0, Observations(pool(1, 1), t.c))
        loads = pool(1, 1, num_running=8)
        return core.tick(60.0, Observations(loads, t.add(600, itl_s=itl_s)))

    plain = run(None)
    ctx = 1000 + 200 / 2
    slow = run(2 * MODEL.decode_step_ms(8 * ctx) / 1000)  # engine twice as slow as the model
    assert slow.desired["decode"] > plain.desired["decode"]


def test_prefill_correction_never_raises_the_prefill_count() -> None:
    # Dynamo: P uses min(1, correction), since queueing inflates TTFT
    core = PlannerCore(settings(ttft_slo_ms=100), MODEL)
    t = Traffic()
    core.tick(0.0, Observations(pool(1, 1), t.c))
    dec = core.tick(60.0, Observations(pool(1, 1), t.add(3000, ttft_s=5.0)))
    assert dec.desired["prefill"] == expected_need(50, 1000, 200)[0] > 1
    assert core.prefill_correction == 4.0  # clamped to correction_bounds
    assert any("TTFT SLO" in n for n in dec.notes)


def test_counter_reset_and_missing_metrics() -> None:
    core = PlannerCore(settings(), MODEL)
    core.tick(0.0, Observations(pool(1, 1), TrafficCounters(requests=10_000, input_tokens=1e7,
                                                            output_tokens=1e6,
                                                            finished=10_000)))
    dec = core.tick(60.0, Observations(pool(1, 1), None))
    assert any("no traffic metrics" in n for n in dec.notes)
    # a frontend restarted: counters went down → the new values are the interval's delta
    t = Traffic()
    core.tick(120.0, Observations(pool(1, 1), t.c))
    dec = core.tick(180.0, Observations(pool(1, 1), t.add(300)))
    assert core.last_prediction is not None
    assert core.last_prediction.rate == pytest.approx(5)


def test_agg_mode_has_one_pool() -> None:
    core = PlannerCore(settings(mode="agg", limits={"agg": PoolLimits(1, 50)}), MODEL)
    t = Traffic()
    workers = [WorkerLoad("a0", "agg")]
    core.tick(0.0, Observations(workers, t.c))
    dec = core.tick(60.0, Observations(workers, t.add(600)))
    need = core.last_prediction.need["agg"]  # type: ignore[union-attr]
    assert set(dec.desired) == {"agg"} and dec.desired["agg"] == math.ceil(need)


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="at least one"):
        PlannerCore(PlannerSettings(throughput_interval_s=0, load_interval_s=0), MODEL)
    with pytest.raises(ValueError, match="min_replicas"):
        PlannerCore(settings(limits={"decode": PoolLimits(3, 2)}), MODEL)


def test_an_interval_of_rejections_only_leaves_the_length_predictions_alone() -> None:
    core = PlannerCore(settings(), MODEL)
    t = Traffic()
    core.tick(0.0, Observations(pool(1, 1), t.c))
    core.tick(60.0, Observations(pool(1, 1), t.add(300, isl=1000, osl=200)))
    isl, osl = core._isl.predict(), core._osl.predict()
    assert isl == pytest.approx(1000) and osl == pytest.approx(200)
    rejected = dataclasses.replace(t.c, requests=t.c.requests + 500)  # no tokens, none done
    core.tick(120.0, Observations(pool(1, 1), rejected))
    assert (core._isl.predict(), core._osl.predict()) == (isl, osl)
