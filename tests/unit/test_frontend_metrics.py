"""``observe_many`` records what as many ``observe`` calls would: every bucket, the count
and the sum, in the exposition format."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from services.frontend.metrics import FrontendMetrics, observe_many


def exposition(values: list[tuple[float, int]], many: bool) -> dict[str, float]:
    r = CollectorRegistry()
    h = Histogram("t_seconds", "t", buckets=(0.001, 0.01, 0.1, 1.0), registry=r)
    for amount, n in values:
        if many:
            observe_many(h, amount, n)
        else:
            for _ in range(n):
                h.observe(amount)
    out = {}
    for line in generate_latest(r).decode().splitlines():
        if line.startswith("t_seconds_") and not line.startswith("t_seconds_created"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.mark.parametrize("values", [
    [(0.0005, 3)], [(0.05, 15), (2.0, 4), (0.01, 1)], [(0.3, 0)], [(1.0, 7), (0.001, 2)]])
def test_observe_many_equals_as_many_observes(values: list[tuple[float, int]]) -> None:
    one_by_one, at_once = exposition(values, False), exposition(values, True)
    assert one_by_one.keys() == at_once.keys()
    for name, value in one_by_one.items():
        assert at_once[name] == pytest.approx(value), name


def test_a_chunk_gap_is_one_itl_sample_per_token() -> None:
    m = FrontendMetrics()
    m.observe_chunk_gap(0.03, 3)
    m.observe_chunk_gap(0.5, 0)  # no token: nothing
    lines = m.render().decode().splitlines()
    count = next(x for x in lines if x.startswith("kvmesh_itl_seconds_count"))
    total = next(x for x in lines if x.startswith("kvmesh_itl_seconds_sum"))
    assert float(count.split()[1]) == 3
    assert float(total.split()[1]) == pytest.approx(0.03)


def test_a_remembered_child_is_the_labelled_one() -> None:
    m = FrontendMetrics()
    first = m.child(m.requests, "agg", "length")
    assert first is m.requests.labels("agg", "length")
    assert m.child(m.requests, "agg", "length") is first
    assert m.child(m.requests, "agg", "stop") is not first
    assert m.child(m.ttft, "agg") is not m.child(m.requests, "agg", "length")
    first.inc()
    m.child(m.requests, "agg", "length").inc()
    assert m.registry.get_sample_value(
        "kvmesh_requests_total", {"path": "agg", "outcome": "length"}) == 2
    with pytest.raises(ValueError):  # a wrong label count is still refused
        m.child(m.requests, "agg")
