"""The AFD break-even model's math (bench/afd/breakeven.py): shapes, FLOP/byte counts, the
non-negative fits recovering known constants, the split/unsplit predictions and the
interval arithmetic behind the overlap ratio."""

from __future__ import annotations

import math

import pytest

from bench.afd import breakeven as be


def test_llama_shape_matches_smollm2_and_refuses_bad_sizes() -> None:
    s = be.llama_shape(576)
    assert (s.q, s.kv, s.intermediate) == (576, 192, 1536)  # 9 heads, 3 KV heads, MLP 1536
    assert be.llama_shape(1024).kv == 4 * 64  # 16 heads: largest divisor <= 16/3
    assert be.llama_shape(128).kv == 64
    for bad in (0, 100, -64):
        with pytest.raises(ValueError, match="multiple of 64"):
            be.llama_shape(bad)


def test_flop_and_byte_counts() -> None:
    s = be.llama_shape(576)
    assert be.ffn_flops(s, 2) == 6 * 2 * 576 * 1536
    assert be.ffn_bytes(s) == 12 * 576 * 1536  # 3 float32 matrices
    assert be.attn_bytes(s) == 4 * (576 * (576 + 384) + 576 * 576)
    assert be.attn_flops(s, 1, 10) == 2 * 576 * 960 + 2 * 576 * 576 + 4 * 10 * 576
    with pytest.raises(ValueError, match="kind"):
        be.features("moe", s, 1, 1)


def test_fit_compute_recovers_known_constants() -> None:
    truth = {"c0": 50e-6, "c_seq": 10e-6, "c_byte": 2e-10, "c_flop": 1e-10}
    pts = [(b, h, 16.0, be.compute_time("attn", truth, b, h, 16.0))
           for h in (128, 256, 576, 1024) for b in (1, 4, 8, 32)]
    fit = be.fit_compute("attn", pts)
    for k, v in truth.items():
        assert fit[k] == pytest.approx(v, rel=1e-6), k
    # the FFN has no per-sequence term; a negative unconstrained fit is not allowed
    ffn_truth = {"c0": 20e-6, "c_seq": 0.0, "c_byte": 1e-10, "c_flop": 0.0}
    pts = [(b, h, 0.0, be.compute_time("ffn", ffn_truth, b, h, 0.0))
           for h in (128, 576) for b in (1, 8)]
    fit = be.fit_compute("ffn", pts)
    assert fit["c_seq"] == 0.0 and all(v >= 0 for v in fit.values())
    assert fit["c0"] == pytest.approx(20e-6, rel=1e-6)
    assert fit["c_byte"] == pytest.approx(1e-10, rel=1e-6)
    with pytest.raises(ValueError):
        be.fit_compute("ffn", [])


def test_fit_linear_non_negative_and_single_x() -> None:
    assert be.fit_linear([0, 1000, 2000], [1.0, 2.0, 3.0]) == pytest.approx(
        {"fixed": 1.0, "per_unit": 1e-3})
    # decreasing data: the slope is clamped to 0, the intercept is the mean
    assert be.fit_linear([1, 2], [3.0, 1.0]) == pytest.approx({"fixed": 2.0, "per_unit": 0.0})
    assert be.fit_linear([5, 5], [2.0, 4.0]) == pytest.approx({"fixed": 3.0, "per_unit": 0.0})
    with pytest.raises(ValueError):
        be.fit_linear([1], [])


def _model(rt_fixed: float, c_byte: float = 0.0, c_flop: float = 1e-9,
           c0: float = 0.0) -> be.Model:
    consts = {"c0": c0, "c_seq": 0.0, "c_byte": c_byte, "c_flop": c_flop}
    return be.Model(consts, consts, {"fixed": rt_fixed, "per_unit": 0.0}, ctx=0.0)


def test_predict_formulas() -> None:
    m = _model(rt_fixed=1e-3)
    h = 576
    a = {b: be.compute_time("attn", m.attn, b, h, 0.0) for b in (4, 8)}
    f = {b: be.compute_time("ffn", m.ffn, b, h, 0.0) for b in (4, 8)}
    p = be.predict(m, 8, h)
    assert p["unsplit"] == pytest.approx(a[8] + f[8])
    assert p["split_1mb"] == pytest.approx(a[8] + f[8] + 1e-3)
    assert p["split_2mb"] == pytest.approx(max(a[4] + f[4] + 1e-3, 2 * a[4], 2 * f[4]))
    assert p["speedup_2mb"] == pytest.approx(p["unsplit"] / p["split_2mb"])
    one = be.predict(m, 1, h)  # one request: no second microbatch
    assert one["split_2mb"] == one["split_1mb"]
    with pytest.raises(ValueError, match="batch"):
        be.predict(m, 0, h)


def test_break_even_compute_bound_vs_weight_bound() -> None:
    # pure FLOP-bound, free transfer: 2 microbatches overlap perfectly; speedup -> unsplit
    # over max(A, F) per microbatch pair, here A(B) + F(B) vs max(...)
    free = _model(rt_fixed=0.0)
    p = be.predict(free, 8, 1024)
    assert p["speedup_2mb"] > 1.0
    # a large fixed round trip loses at small hidden sizes and wins once compute dominates
    slow = _model(rt_fixed=5e-3)
    grid = list(range(128, 16384 + 1, 64))
    h = be.break_even_hidden(slow, 8, grid)
    assert h is not None and 128 < h < 16384
    below = be.predict(slow, 8, h - 64)
    assert below["speedup_2mb"] <= 1.0 < be.predict(slow, 8, h)["speedup_2mb"]
    # weight-streaming bound (time independent of batch): halving the batch saves nothing,
    # so 2 microbatches cost 2x the weights and never pay off
    bw = _model(rt_fixed=0.0, c_byte=1e-9, c_flop=0.0)
    assert be.break_even_hidden(bw, 8, grid) is None
    assert be.break_even_hidden(slow, 1, grid) is None  # B=1 can only add the round trip
    tab = be.table(slow, [1, 8], [576, 4096], grid)
    assert len(tab["rows"]) == 4 and tab["break_even_hidden"] == {"1": None, "8": h}
    assert {"unsplit_us", "split_1mb_us", "split_2mb_us", "speedup_2mb"} <= set(tab["rows"][0])


def test_intervals_cover_and_exposed_time() -> None:
    s, e = be.merge([(3, 4), (0, 1), (0.5, 2), (5, 5), (7, 6)])
    assert s.tolist() == [0, 3] and e.tolist() == [2, 4]
    c = be.Cover([(0, 2), (3, 4)])
    assert c.total == 3
    assert c.covered(1, 3.5) == pytest.approx(1.5)
    assert c.covered(-5, 10) == 3
    assert c.covered(2, 3) == 0 and c.covered(4, 3) == 0
    # the part of transfers inside attention compute is hidden (the rest exposed)
    compute = be.Cover([(10, 20)])
    assert be.covered_time([(0, 5), (12, 14), (18, 25)], compute) == pytest.approx(4)
    assert math.isclose(be.Cover([]).covered(0, 1), 0.0)
