"""Mock engine timing models: Dynamo's polynomial, tables, zero, transfer time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.engines.mock.timing import (
    EXAMPLE_TABLE,
    PolynomialTiming,
    TableTiming,
    ZeroTiming,
    make_timing,
    transfer_ms,
)


def test_dynamo_polynomial_numbers() -> None:
    p = PolynomialTiming()
    assert p.prefill_ms(1000) == pytest.approx(4.21e-7 * 1e6 + 15.18 + 16.5)  # 32.101
    assert p.prefill_ms(4096) == pytest.approx(4.21e-7 * 4096**2 + 1.518e-2 * 4096 + 16.5)
    assert p.decode_ms(0.0) == pytest.approx(5.74)
    assert p.decode_ms(0.5) == pytest.approx(-25.74 * 0.25 + 54.01 * 0.5 + 5.74)  # 26.31
    assert p.decode_ms(1.0) == pytest.approx(34.01)
    assert p.decode_ms(7.0) == p.decode_ms(1.0)  # usage is clamped to [0, 1]
    assert PolynomialTiming(decode_c=-10.0).decode_ms(0.0) == 1.0  # at least 1 ms
    # empty, prefill-only, decode-only and mixed (= sum) steps
    assert p.step_ms(0, 0, 0.3) == 0.0
    assert p.step_ms(1000, 0, 0.3) == pytest.approx(p.prefill_ms(1000))
    assert p.step_ms(0, 8, 0.5) == pytest.approx(26.31)
    assert p.step_ms(1000, 8, 0.5) == pytest.approx(p.prefill_ms(1000) + 26.31)


def test_table_interpolates_and_extrapolates(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"prefill": [[100, 10.0], [200, 30.0]],
                                "decode": [[1, 2.0], [5, 6.0]]}))
    t = TableTiming.from_json(path)
    assert t.step_ms(150, 0, 0.0) == pytest.approx(20.0)
    assert t.step_ms(300, 0, 0.0) == pytest.approx(50.0)  # along the last segment
    assert t.step_ms(0, 3, 0.9) == pytest.approx(4.0)
    assert t.step_ms(150, 3, 0.0) == pytest.approx(24.0)
    assert t.step_ms(1, 0, 0.0) >= 0.0  # never negative below the first point
    assert make_timing(f"table:{path}").step_ms(150, 0, 0.0) == pytest.approx(20.0)


def test_table_validation_and_shipped_example() -> None:
    with pytest.raises(ValueError):
        TableTiming.from_dict({"prefill": [], "decode": [[1, 1.0]]})
    with pytest.raises(ValueError):
        TableTiming.from_dict({"prefill": [[1, 1.0], [1, 2.0]], "decode": [[1, 1.0]]})
    with pytest.raises(ValueError):
        TableTiming.from_dict({"prefill": [[1, -1.0]], "decode": [[1, 1.0]]})
    example = make_timing("table")
    assert EXAMPLE_TABLE.is_file()
    assert example.step_ms(0, 1, 0.0) == pytest.approx(20.0)


def test_zero_and_factory() -> None:
    assert ZeroTiming().step_ms(10_000, 100, 1.0) == 0.0
    assert isinstance(make_timing("poly"), PolynomialTiming)
    assert isinstance(make_timing("dynamo"), PolynomialTiming)
    assert isinstance(make_timing("zero"), ZeroTiming)
    with pytest.raises(ValueError):
        make_timing("nope")


def test_transfer_time_is_bytes_over_bandwidth() -> None:
    assert transfer_ms(25_000_000, 25e9) == pytest.approx(1.0)
    assert transfer_ms(0, 1.0) == 0.0
    assert transfer_ms(10, float("inf")) == 0.0
    with pytest.raises(ValueError):
        transfer_ms(10, 0.0)
