"""bench.pd_overhead.stages: the stage points and segments of one P/D request, from
workers.kv.nixl_quiet's stamps; and the report's stage table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.pd_overhead.report import engine_free_table, stage_table, summary_rows
from bench.pd_overhead.stages import (
    SEGMENTS,
    load_stamps,
    mesh_share,
    request_points,
    segment_medians,
    segments,
)

SENT = 1000.0


def _stamps(d_req: str = "cmpl-d", p_req: str = "cmpl-p", base: float = SENT) -> list[dict]:
    """One pull handoff: P 10-50 ms, D 60 ms on, READ polled twice, handshake first."""
    def s(dt: float, ev: str, req: str | None, **kw: object) -> dict:
        return {"t": base + dt, "ev": ev, "req": req, "pid": 1, **kw}

    return [
        s(0.011, "p_seen", p_req, arrival=base + 0.010),
        s(0.050, "p_finished", p_req),
        s(0.061, "d_seen", d_req, arrival=base + 0.060),
        s(0.062, "d_admitted", d_req, external=63),
        s(0.063, "w_handshake_start", None, engine="P1"),
        s(0.070, "w_handshake_done", None, engine="P1"),
        s(0.071, "w_start_load", d_req),
        s(0.072, "w_read_posted", d_req, posted=True),
        s(0.073, "w_poll", None, pending=[d_req]),
        s(0.074, "w_poll", None, pending=[d_req, "other"]),
        s(0.075, "w_xfer", None, xfer_us=500, post_us=20, bytes=4096),
        s(0.076, "w_recv_done", d_req, failed=False),
        s(0.077, "d_recv_reported", d_req),
        s(0.080, "d_first_step_scheduled", d_req, tokens=1),
        s(0.090, "d_first_step_done", d_req),
        s(0.200, "d_finished", d_req),
    ]


def test_points_and_segments_of_one_request() -> None:
    pts = request_points(_stamps(), SENT, SENT + 0.100, SENT + 0.200)
    assert pts["d_req"] == "cmpl-d" and pts["p_req"] == "cmpl-p"
    assert pts["p_arrival"] == pytest.approx(0.010)
    assert pts["d_admitted"] == pytest.approx(0.062)
    assert pts["read_posted"] == pytest.approx(0.072)
    assert pts["recv_done"] == pytest.approx(0.076)
    assert pts["first_step_done"] == pytest.approx(0.090)
    assert pts["first_token"] == pytest.approx(0.100)
    assert pts["read_polls"] == 2
    assert pts["read_done_after"] == pytest.approx(0.074)
    assert pts["handshake_s"] == pytest.approx(0.007)
    assert pts["xfer_s"] == pytest.approx(0.0005)
    seg = segments(pts)
    assert seg["first_step"] == pytest.approx(0.010)
    assert seg["to_client"] == pytest.approx(0.010)
    assert sum(v for v in seg.values() if v is not None) == pytest.approx(0.100)


def test_the_request_is_picked_by_its_arrival_window() -> None:
    both = _stamps("d-early", "p-early") + _stamps("d-late", "p-late", base=SENT + 1.0)
    both.sort(key=lambda r: r["t"])
    pts = request_points(both, SENT + 1.0, SENT + 1.1, SENT + 1.2)
    assert pts["d_req"] == "d-late" and pts["p_req"] == "p-late"
    assert pts["read_polls"] == 2  # the other request's polls are not counted


def test_missing_stages_are_none_not_guessed() -> None:
    pts = request_points([], SENT, SENT + 0.1, SENT + 0.2)  # e.g. agg: nothing stamped
    assert pts["d_req"] is None and pts["read_posted"] is None
    seg = segments(pts)
    assert set(seg) == {s[0] for s in SEGMENTS}
    assert all(v is None for v in seg.values())
    assert segment_medians([seg, seg]) == dict.fromkeys(seg)


def test_medians_skip_missing_values() -> None:
    a = {s[0]: None for s in SEGMENTS} | {"read": 0.002}
    b = {s[0]: None for s in SEGMENTS} | {"read": 0.004, "first_step": 0.01}
    med = segment_medians([a, b])
    assert med["read"] == pytest.approx(0.003)
    assert med["first_step"] == pytest.approx(0.01)
    assert med["to_p"] is None


def test_load_stamps_skips_torn_lines(tmp_path: Path) -> None:
    recs = _stamps()
    (tmp_path / "stamps-1.jsonl").write_text(
        "\n".join(json.dumps(r) for r in recs[:3]) + '\n{"t": 1, "ev"')
    (tmp_path / "stamps-2.jsonl").write_text(json.dumps(recs[3]) + "\n")
    (tmp_path / "other.txt").write_text("not stamps")
    got = load_stamps(tmp_path)
    assert [r["ev"] for r in got] == [r["ev"] for r in recs[:4]]
    assert load_stamps(tmp_path / "missing") == []


def test_stage_table_lists_stamped_modes_only() -> None:
    med = segment_medians([segments(request_points(_stamps(), SENT, SENT + 0.1,
                                                   SENT + 0.2))])
    modes: dict[str, dict[str, Any]] = {"agg": {"lengths": {"64": {}}},
             "pull": {"lengths": {"64": {"stages_median_s": med}}}}
    text = stage_table([64], modes)
    assert "pull" in text and " agg " not in text
    assert stage_table([64], {"agg": modes["agg"]}) == ""


def test_second_token_table_shows_what_moved_to_token_two() -> None:
    from bench.pd_overhead.report import second_token_table

    modes = {"pull": {"lengths": {"128": {"ttft_s": {"median": 0.25},
                                          "second_s": {"median": 0.4}}}},
             "agg": {"lengths": {"128": {"ttft_s": {"median": 0.2}}}}}
    text = second_token_table([128, 512], modes)
    rows = text.splitlines()
    assert rows[1].split()[:3] == ["L", "pull", "t1"]  # header order follows the modes
    assert rows[2].split() == ["128", "250.0", "400.0", "200.0", "-"]
    assert rows[3].split() == ["512", "-", "-", "-", "-"]


def test_ttft_stages_leave_ds_stages_out_when_ps_token_went_first() -> None:
    from bench.pd_overhead.report import ttft_stages

    d_first = {"to_p": 0.01, "p_prefill": 0.5, "first_step": 0.1, "to_client": 0.002}
    assert ttft_stages(d_first, 0.7) is d_first
    p_first = {**d_first, "to_client": -0.1}
    assert ttft_stages(p_first, 0.52) == pytest.approx(
        {"to_p": 0.01, "p_prefill": 0.5, "p_to_client": 0.01})
    assert ttft_stages(p_first, None)["p_to_client"] is None


def _e(dt: float, role: str, engine_ttft: float, base: float = SENT) -> dict:
    return {"t": base + dt, "ev": "e_first_token", "req": f"r-{role}", "pid": 2, "role": role,
            "arrival": base + 0.005, "queue_s": 0.001, "prefill_s": engine_ttft - 0.003,
            "engine_ttft_s": engine_ttft}


def test_the_first_engines_ttft_is_taken_out_of_the_clients() -> None:
    """P's engine stamp (role p) is the one whose token goes out first; D's is not used."""
    stamps = sorted([*_stamps(), _e(0.049, "p", 0.040), _e(0.091, "d", 0.030)],
                    key=lambda r: r["t"])
    pts = request_points(stamps, SENT, SENT + 0.060, SENT + 0.200)
    assert pts["engine_role"] == "p"
    assert pts["engine_ttft_s"] == pytest.approx(0.040)
    assert pts["engine_queue_prefill_s"] == pytest.approx(0.038)
    assert mesh_share(pts) == pytest.approx(0.020)
    # agg: only the worker's stamp, no connector's
    agg = request_points([_e(0.045, "a", 0.035)], SENT, SENT + 0.050, SENT + 0.100)
    assert agg["engine_role"] == "a" and mesh_share(agg) == pytest.approx(0.015)
    # no stamp (toy's plain vLLM servers): nothing is guessed
    none = request_points([], SENT, SENT + 0.050, SENT + 0.100)
    assert none["engine_ttft_s"] is None and mesh_share(none) is None


def test_summary_rows_give_the_engine_free_overhead_and_the_goal() -> None:
    def mode(share: float | None) -> dict[str, Any]:
        return {"lengths": {"128": {"ttft_s": {"median": 0.5, "p90": 0.6},
                                    "mesh_share_s": None if share is None
                                    else {"median": share}}}}

    anchor = {"by_length": {"128": {"raw_transfer_s": 0.002, "kv_bytes": 1}}}
    (row,) = summary_rows([128], {"agg": mode(0.018), "pull": mode(0.024),
                                  "toy": mode(None)}, anchor)
    assert row["goal_s"] == pytest.approx(1.2 * 0.002 + 0.005)
    assert row["engine_free_overhead_s"]["pull"] == pytest.approx(0.006)
    assert row["meets_goal"] == {"pull": True, "toy": None}
    text = engine_free_table([row], ["agg", "pull", "toy"])
    assert "ovh pull" in text and "6.0" in text
