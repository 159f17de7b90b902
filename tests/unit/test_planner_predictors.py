"""Predictors and performance models of the planner."""

from __future__ import annotations

import json
import math

import pytest

from services.common.perf_model import (
    PolynomialPerfModel,
    TablePerfModel,
    decode_throughput,
    load_perf_model,
    prefill_throughput,
)
from services.planner.predictors import (
    ArPredictor,
    ConstantPredictor,
    KalmanPredictor,
    MovingAveragePredictor,
    make_predictor,
)


def test_constant_is_last_value() -> None:
    p = ConstantPredictor()
    assert p.predict() is None
    for v in (3, 7, 5):
        p.add(v)
    assert p.predict() == 5


def test_moving_average_over_window() -> None:
    p = MovingAveragePredictor(window=3)
    for v in (100, 1, 2, 3):
        p.add(v)
    assert p.predict() == pytest.approx(2.0)


def test_predictions_are_never_negative() -> None:
    for p in (ConstantPredictor(), KalmanPredictor(), ArPredictor(p=1, window=8, d=1)):
        for v in (10, 6, 2, 0):
            p.add(v)
        assert p.predict() is not None and p.predict() >= 0  # type: ignore[operator]


def test_kalman_velocity_converges_on_a_ramp() -> None:
    p = KalmanPredictor(model="velocity")
    for k in range(40):
        p.add(10.0 + 2.0 * k)
    # next value of the ramp is 10 + 2·40 = 90: a constant-velocity filter has no lag
    assert p.predict() == pytest.approx(90.0, abs=0.5)
    lagging = MovingAveragePredictor(window=5)
    for k in range(40):
        lagging.add(10.0 + 2.0 * k)
    assert abs(lagging.predict() - 90.0) > 5  # type: ignore[operator]


def test_kalman_random_walk_smooths_noise() -> None:
    p = KalmanPredictor(model="random_walk", q=0.001, r=1.0)
    for k in range(200):
        p.add(50.0 + (5.0 if k % 2 else -5.0))
    assert p.predict() == pytest.approx(50.0, abs=1.0)


def test_ar_predicts_a_sinusoid() -> None:
    p = ArPredictor(p=2, window=64)
    period = 12
    series = [100 + 30 * math.sin(2 * math.pi * k / period) for k in range(60)]
    for v in series:
        p.add(v)
    expected = 100 + 30 * math.sin(2 * math.pi * 60 / period)
    assert p.predict() == pytest.approx(expected, abs=0.5)
    # the constant predictor is far off on the same series
    assert abs(series[-1] - expected) > 10


def test_ar_falls_back_to_last_value_without_enough_points() -> None:
    p = ArPredictor(p=3)
    p.add(4)
    p.add(6)
    assert p.predict() == 6


def test_registry() -> None:
    assert isinstance(make_predictor("moving_average", window=2), MovingAveragePredictor)
    assert isinstance(make_predictor("constant", window=2), ConstantPredictor)
    with pytest.raises(ValueError, match="unknown predictor"):
        make_predictor("prophet")


def test_polynomial_model_numbers() -> None:
    m = PolynomialPerfModel(capacity=1000)
    assert m.prefill_ms(1000) == pytest.approx(4.21e-7 * 1e6 + 15.18 + 16.5)
    assert m.decode_step_ms(0) == pytest.approx(5.74)
    assert m.decode_step_ms(500) == pytest.approx(-25.74 * 0.25 + 54.01 * 0.5 + 5.74)
    assert m.decode_step_ms(5000) == pytest.approx(-25.74 + 54.01 + 5.74)  # u capped at 1
    fast = PolynomialPerfModel(capacity=1000, speedup=2.0)
    assert fast.prefill_ms(1000) == pytest.approx(m.prefill_ms(1000) / 2)


def test_table_model_interpolates_and_extrapolates(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = {"kv_capacity_tokens": 4096, "prefill": [[100, 10], [1000, 100]],
            "decode": [{"kv_tokens": 0, "ms": 5}, {"kv_tokens": 4096, "ms": 25}]}
    path = tmp_path / "perf.json"
    path.write_text(json.dumps(data))
    m = load_perf_model(str(path))
    assert isinstance(m, TablePerfModel)
    assert m.prefill_ms(550) == pytest.approx(55)
    assert m.prefill_ms(2000) == pytest.approx(200)  # linear past the end
    assert m.decode_step_ms(2048) == pytest.approx(15)
    with pytest.raises(ValueError, match="misses"):
        TablePerfModel.from_dict({"prefill": [[1, 1]]})


def test_decode_throughput_respects_the_itl_slo() -> None:
    m = PolynomialPerfModel(capacity=100_000)
    cap = decode_throughput(m, context=1000, itl_slo_ms=20.0)
    assert cap.meets_slo and cap.step_ms <= 20.0
    assert m.decode_step_ms((cap.batch + 1) * 1000) > 20.0  # one more would break the SLO
    assert cap.tokens_per_s == pytest.approx(cap.batch * 1000 / cap.step_ms)
    tight = decode_throughput(m, context=1000, itl_slo_ms=1.0)
    assert not tight.meets_slo and tight.batch == 1
    assert prefill_throughput(m, 1000) == pytest.approx(1000 * 1000 / m.prefill_ms(1000))
