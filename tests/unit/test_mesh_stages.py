"""bench.mesh_profile's stage timeline: the stamps runner's wrappers (sync and async,
only while recording) and the timeline built from two processes' stamps."""

from __future__ import annotations

import asyncio

import pytest

from bench.mesh_profile import stamps
from bench.mesh_profile.stages import timeline


def test_stamped_records_entry_and_exit_only_while_on() -> None:
    def add(a: int, b: int) -> int:
        return a + b

    async def twice(x: int) -> int:
        await asyncio.sleep(0)
        return 2 * x

    sync, coro = stamps.stamped("add", add), stamps.stamped("twice", twice)
    before = len(stamps.recorded())
    assert sync(1, 2) == 3 and asyncio.run(coro(4)) == 8
    assert len(stamps.recorded()) == before  # off: nothing recorded
    stamps.set_recording(True)
    try:
        assert sync(1, 2) == 3 and asyncio.run(coro(4)) == 8
        with pytest.raises(TypeError):
            sync(1, "x")  # the exit is stamped on the way out of an exception too
    finally:
        stamps.set_recording(False)
    got = [(name, edge) for _, name, edge in stamps.recorded()[before:]]
    assert got == [("add", "+"), ("add", "-"), ("twice", "+"), ("twice", "-"),
                   ("add", "+"), ("add", "-")]
    times = [ns for ns, _, _ in stamps.recorded()[before:]]
    assert times == sorted(times)


def test_install_skips_what_is_missing() -> None:
    assert stamps.install((("bench.mesh_profile.stages", "NoSuchThing.step"),
                           ("no_such_module_here", "f"))) == []


def test_timeline_places_each_stamp_at_its_offset_in_its_request() -> None:
    requests = [(1_000, 9_000), (20_000, 30_000), (50_000, 51_000)]
    logs = {
        "F": [(2_000, "parse", "+"), (3_000, "parse", "-"), (21_000, "parse", "+"),
              (23_000, "parse", "-"), (4_000, "write", "+"), (4_500, "write", "+"),
              (15_000, "idle_work", "+")],  # between requests: in none
        "W": [(5_000, "engine", "+"), (26_000, "engine", "+")],
    }
    got = timeline(requests, logs)
    rows = {r["stamp"]: (r["median_us"], r["requests"]) for r in got["timeline"]}
    assert rows["F:parse+#1"] == (1.0, 2)  # offsets 1 and 1 µs
    assert rows["F:parse-#1"] == (2.5, 2)  # 2 and 3 µs
    assert rows["W:engine+#1"] == (5.0, 2)  # 4 and 6 µs
    assert rows["F:write+#1"] == (3.0, 1) and rows["F:write+#2"] == (3.5, 1)
    assert "F:idle_work+#1" not in rows
    assert [r["median_us"] for r in got["timeline"]] == sorted(rows[k][0] for k in rows)
    assert got["answer_us"] == 8.0  # median of 8, 10 and 1 µs


def test_wrap_function_rebinds_importers_and_timers_refuse_async() -> None:
    from bench.mesh_profile import timers
    from bench.mesh_profile.prof import wrap_function
    from services.frontend import http_api, openai_schema

    original = openai_schema.parse_completion
    try:
        wrap_function("services.frontend.openai_schema", "parse_completion",
                      lambda f: stamps.stamped("parse", f))
        assert openai_schema.parse_completion is not original
        assert http_api.parse_completion is openai_schema.parse_completion  # its importer
        assert openai_schema.parse_completion.__wrapped__ is original  # type: ignore[attr-defined]
    finally:
        openai_schema.parse_completion = original
        http_api.parse_completion = original
    async_step = (("services.frontend.pipeline", "Pipeline.prepare"),)
    with pytest.raises(TypeError, match="asynchronous"):
        timers.install("services.frontend", async_step)
    from services.frontend.pipeline import Pipeline
    assert not hasattr(Pipeline.prepare, "__wrapped__")  # nothing replaced


def test_paired_summary_takes_round_by_round_differences() -> None:
    from bench.mesh_profile.paired import paired_summary

    base = [100.0, 200.0, 300.0, 400.0]
    cur = [90.0, 150.0, 310.0, 380.0]  # per round: -10, -50, +10, -20
    out = paired_summary(base, cur)
    assert out["diff_p50_us"] == -15.0  # the median of the differences
    assert out["baseline_p50_us"] == 250.0 and out["current_p50_us"] == 230.0
    with pytest.raises(ValueError):
        paired_summary(base, cur[:3])  # rounds must pair up
    with pytest.raises(ValueError):
        paired_summary([], [])


def test_paired_latencies_fail_the_bench_on_a_failed_request() -> None:
    from collections import Counter

    from bench.frontend_vs_dynamo.client import Paced
    from bench.mesh_profile.paired import _latencies_us

    ok = Paced({"baseline": [0.001], "current": [0.002]}, {"baseline": Counter(),
               "current": Counter()}, {}, 0.0)
    assert _latencies_us(ok) == {"baseline": [1000.0], "current": [2000.0]}
    bad = Paced({"baseline": [0.001], "current": [None]}, {"baseline": Counter(),
                "current": Counter({"HTTP 500": 1})}, {}, 0.0)
    with pytest.raises(RuntimeError, match="HTTP 500"):
        _latencies_us(bad)
