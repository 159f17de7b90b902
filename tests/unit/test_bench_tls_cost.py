"""bench.tls_cost: the --tls modes, ABBA order, per-call interleaving, the per-RPC table
(ratio, cost, the 10 % flag only on data-path RPCs) and the verdict."""

from __future__ import annotations

import pytest

from bench.tls_cost import (
    cpu_s,
    interleaved,
    interleaved_sync,
    modes_of,
    round_order,
    summarize,
    verdict,
)


def test_modes_and_abba_order() -> None:
    assert modes_of("off") == ("insecure",)
    assert modes_of("on") == ("tls",)
    assert modes_of("both") == ("insecure", "tls")
    assert [round_order(["a", "b"], i) for i in range(3)] == [["a", "b"], ["b", "a"],
                                                               ["a", "b"]]


def test_interleaved_alternates_call_by_call() -> None:
    seen: list[tuple[str, int]] = []
    got = interleaved_sync(3, {"insecure": lambda i: seen.append(("insecure", i)),
                               "tls": lambda i: seen.append(("tls", i))})
    assert seen == [("insecure", 0), ("tls", 0), ("tls", 1), ("insecure", 1),
                    ("insecure", 2), ("tls", 2)]
    assert {m: len(v) for m, v in got.items()} == {"insecure": 3, "tls": 3}
    assert all(s >= 0 for v in got.values() for s in v)


async def test_interleaved_async() -> None:
    seen: list[str] = []

    def call(mode: str):  # type: ignore[no-untyped-def]
        async def run(_: int) -> None:
            seen.append(mode)
        return run
    got = await interleaved(2, {"insecure": call("insecure"), "tls": call("tls")})
    assert seen == ["insecure", "tls", "tls", "insecure"]
    assert len(got["tls"]) == 2


def test_summarize_ratio_cost_and_flag() -> None:
    us = 1e-6
    rows = summarize({
        "Route": {"insecure": [100 * us] * 3, "tls": [105 * us] * 3},
        "Ping": {"insecure": [100 * us], "tls": [150 * us]},
        "Put": {"insecure": [100 * us], "tls": [120 * us]},
    }, data_path=("Route", "Put"))
    by = {r["rpc"]: r for r in rows}
    assert by["Route"]["ratio"] == pytest.approx(1.05)
    assert by["Route"]["cost_us"] == pytest.approx(5.0)
    assert by["Route"]["insecure"]["n"] == 3 and by["Route"]["within_10pct"] is True
    assert by["Put"]["within_10pct"] is False
    assert "within_10pct" not in by["Ping"] and by["Ping"]["data_path"] is False
    assert verdict(rows) is False
    assert verdict([by["Route"], by["Ping"]]) is True


def test_one_mode_has_no_ratio_and_no_verdict() -> None:
    rows = summarize({"Route": {"insecure": [1e-4]}}, data_path=("Route",))
    assert "ratio" not in rows[0] and "within_10pct" not in rows[0]
    assert verdict(rows) is None


def test_cpu_figures_join_the_rows() -> None:
    rows = summarize({"Put": {"insecure": [1e-4], "tls": [1e-4]}}, data_path=("Put",),
                     cpu={"Put": {"insecure": {"client_us": 30.0, "servers_us": 70.0},
                                  "tls": {"client_us": 33.0, "servers_us": 82.0}}})
    [row] = rows
    assert row["tls"]["cpu_us"] == pytest.approx(115.0)
    assert row["cpu_ratio"] == pytest.approx(1.15) and row["cpu_cost_us"] == pytest.approx(15)
    assert row["within_10pct"] is True and row["cpu_within_10pct"] is False
    assert verdict(rows) is True and verdict(rows, "cpu_within_10pct") is False


def test_cpu_s_counts_this_process() -> None:
    import os

    before = cpu_s([os.getpid()])
    sum(i * i for i in range(300_000))
    assert cpu_s([os.getpid()]) >= before > 0
