"""bench.store's kvmesh / Mooncake ratios: matched by (size, batch), error rows skipped."""

from __future__ import annotations

import pytest

from bench.store.run import ratios


def row(size: int, batch: int, gbps: float, ops: float) -> dict[str, float]:
    return {"size": size, "batch": batch, "put_gbps": gbps, "get_gbps": 2 * gbps,
            "put_ops": ops, "get_ops": 2 * ops}


def test_ratios_pair_rows_by_shape_and_skip_errors() -> None:
    ours = [row(64, 8, 1.0, 100.0), row(1024, 8, 3.0, 30.0), row(64, 1, 0.5, 50.0)]
    theirs = [row(64, 1, 0.25, 10.0), row(64, 8, 2.0, 400.0),
              {"size": 1024, "batch": 8, "error": "put failed"}]
    out = ratios(ours, theirs)
    assert [(r["size"], r["batch"]) for r in out] == [(64, 8), (64, 1)]
    assert out[0]["put_gbps"] == pytest.approx(0.5) and out[0]["get_ops"] == pytest.approx(0.25)
    assert out[1]["put_ops"] == pytest.approx(5.0)


def test_no_ratios_when_mooncake_failed_as_a_whole() -> None:
    assert ratios([row(64, 8, 1.0, 1.0)], {"error": "mooncake node did not start"}) == []
    assert ratios([row(64, 8, 1.0, 1.0)], None) == []
