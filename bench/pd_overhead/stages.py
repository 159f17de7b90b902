"""Per-request stages of a P/D handoff, from the connector's stamps (pure: no I/O but
:func:`load_stamps`).

The stamps are :mod:`workers.kv.nixl_quiet`'s and :mod:`workers.engines.vllm_engine`'s JSON
lines (``KVMESH_PD_STAMPS``, :mod:`workers.kv.stamps`), on the
same host clock (``time.time()``) as the client's ``sent_wall``.

Contracts:

- :func:`load_stamps` reads every ``stamps-*.jsonl`` of a folder (a line cut short by a
  process still writing is skipped); missing folder: ``[]``.
- :func:`request_points` picks, for one client request (``sent``, ``first_token``,
  ``done``: wall seconds), D's request: the first ``d_seen`` whose ``arrival`` lies in
  ``[sent, done]``; P's likewise (``p_seen``). From that request id's events it returns
  :data:`POINTS` as seconds after ``sent`` (None when not stamped, e.g. no READ in push
  mode, nothing at all in agg), plus ``read_polls`` (worker polls that still saw the
  READ pending), ``read_done_after`` (the last of them: the READ finished in
  ``(read_done_after, recv_done]``), ``handshake_s`` (a NIXL handshake of D's worker
  between ``d_arrival`` and ``recv_done``: first contact with that P; None if none),
  ``xfer_s`` (NIXL's own duration of the READs that finished in that interval, summed;
  from its telemetry) and ``d_req`` / ``p_req``; and, from the worker's
  ``e_first_token`` stamp of the engine whose token reaches the client first (P's in
  pull and push, ``role`` ``p``; the aggregated worker's in agg, ``a``; the first such
  stamp with ``arrival`` in ``[sent, done]``), ``engine_ttft_s`` (vLLM's own TTFT of that
  request: its arrival in the worker's engine to its first token there),
  ``engine_queue_prefill_s`` (EngineCore's queue + prefill), ``engine_role``,
  ``engine_arrival`` (its ``arrival``) and ``engine_first_token`` (when the worker saw
  the first token), both seconds after ``sent``; None when not stamped.
- :func:`mesh_share` is what the mesh adds to a request's TTFT outside that engine:
  the client's TTFT minus ``engine_ttft_s`` (None when either is missing).
- :func:`segments` turns the points into :data:`SEGMENTS`, the consecutive intervals
  from ``sent`` to ``first_token`` (None where an end is missing); with every point
  present they sum to the client's TTFT.
- :func:`segment_medians` gives each segment's median over several requests (None when
  no request has it).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

POINTS = ("sent", "p_arrival", "p_finished", "d_arrival", "d_admitted", "read_posted",
          "recv_done", "recv_reported", "first_step_scheduled", "first_step_done",
          "first_token")
# (name, from point, to point, what happens in between)
SEGMENTS: tuple[tuple[str, str, str, str], ...] = (
    ("to_p", "sent", "p_arrival", "client to P's engine (frontend+router or proxy, P's server)"),
    ("p_prefill", "p_arrival", "p_finished", "P: queue and prefill (max_tokens 1)"),
    ("p_to_d", "p_finished", "d_arrival", "P's answer back to the caller, then D's call"),
    ("d_admit", "d_arrival", "d_admitted", "D's scheduler admits it, allocates its blocks"),
    ("to_read", "d_admitted", "read_posted",
     "until the worker posts the READ (after that step's forward; a handshake)"),
    ("read", "read_posted", "recv_done", "READ in flight until a worker poll sees it done"),
    ("recv_report", "recv_done", "recv_reported", "worker -> scheduler (update_connector_output)"),
    ("resched", "recv_reported", "first_step_scheduled",
     "next schedule(): back to WAITING, last prompt token rescheduled"),
    ("first_step", "first_step_scheduled", "first_step_done",
     "the step that recomputes the last prompt token and samples"),
    ("to_client", "first_step_done", "first_token",
     "first token to the client (output processor, server, frontend or proxy)"),
)
_EVENT_POINT = {"d_admitted": "d_admitted", "w_read_posted": "read_posted",
                "w_recv_done": "recv_done", "d_recv_reported": "recv_reported",
                "d_first_step_scheduled": "first_step_scheduled",
                "d_first_step_done": "first_step_done", "p_finished": "p_finished"}


def load_stamps(folder: Path) -> list[dict[str, Any]]:
    """Every stamp of ``folder`` (see the module docstring)."""
    out: list[dict[str, Any]] = []
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("stamps-*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "t" in rec and "ev" in rec:
                out.append(rec)
    out.sort(key=lambda r: r["t"])
    return out


def _pick(stamps: list[dict[str, Any]], ev: str, lo: float,
          hi: float) -> dict[str, Any] | None:
    for r in stamps:
        arrival = r.get("arrival")
        if r["ev"] == ev and arrival is not None and lo <= arrival <= hi:
            return r
    return None


def request_points(stamps: list[dict[str, Any]], sent: float, first_token: float | None,
                   done: float) -> dict[str, Any]:
    """The points of one client request (see the module docstring)."""
    abs_pts: dict[str, float | None] = dict.fromkeys(POINTS)
    abs_pts["sent"], abs_pts["first_token"] = sent, first_token
    out: dict[str, Any] = {"d_req": None, "p_req": None, "read_polls": None,
                           "read_done_after": None, "handshake_s": None, "xfer_s": None}
    p = _pick(stamps, "p_seen", sent, done)
    if p is not None:
        out["p_req"] = p["req"]
        abs_pts["p_arrival"] = p["arrival"]
        fin = next((r for r in stamps if r["ev"] == "p_finished" and r["req"] == p["req"]
                    and r["t"] >= p["arrival"]), None)
        abs_pts["p_finished"] = fin["t"] if fin else None
    d = _pick(stamps, "d_seen", sent, done)
    if d is not None:
        req = out["d_req"] = d["req"]
        abs_pts["d_arrival"] = d["arrival"]
        mine = [r for r in stamps if r.get("req") == req and r["t"] >= d["arrival"]
                and not r["ev"].startswith("p_")]
        for r in mine:
            point = _EVENT_POINT.get(r["ev"])
            if point is not None and abs_pts[point] is None:
                abs_pts[point] = r["t"]
        recv = abs_pts["recv_done"]
        posted = abs_pts["read_posted"]
        if recv is not None:
            polls = [r["t"] for r in stamps if r["ev"] == "w_poll"
                     and req in (r.get("pending") or ()) and r["t"] <= recv]
            out["read_polls"] = len(polls)
            out["read_done_after"] = polls[-1] - sent if polls else None
            starts = [r for r in stamps if r["ev"] == "w_handshake_start"
                      and d["arrival"] <= r["t"] <= recv]
            if starts:
                end = next((r["t"] for r in stamps if r["ev"] == "w_handshake_done"
                            and r["t"] >= starts[0]["t"]
                            and r.get("engine") == starts[0].get("engine")), None)
                out["handshake_s"] = end - starts[0]["t"] if end is not None else None
            if posted is not None:
                xfers = [r.get("xfer_us") or 0 for r in stamps if r["ev"] == "w_xfer"
                         and posted <= r["t"] <= recv]
                out["xfer_s"] = sum(xfers) / 1e6 if xfers else None
    for name in POINTS:
        v = abs_pts[name]
        out[name] = v - sent if v is not None else None
    e = next((r for r in stamps if r["ev"] == "e_first_token" and r.get("role") in ("p", "a")
              and r.get("arrival") is not None and sent <= r["arrival"] <= done), None)
    out["engine_role"] = e.get("role") if e else None
    out["engine_arrival"] = e["arrival"] - sent if e else None
    out["engine_first_token"] = e["t"] - sent if e else None
    out["engine_ttft_s"] = e.get("engine_ttft_s") if e else None
    q, pf = (e.get("queue_s"), e.get("prefill_s")) if e else (None, None)
    out["engine_queue_prefill_s"] = q + pf if q is not None and pf is not None else None
    return out


def mesh_share(points: dict[str, Any]) -> float | None:
    """The client's TTFT minus the first engine's own TTFT (module docstring)."""
    ttft, engine = points.get("first_token"), points.get("engine_ttft_s")
    return ttft - engine if ttft is not None and engine is not None else None


def segments(points: dict[str, Any]) -> dict[str, float | None]:
    """:data:`SEGMENTS` of one request's points (seconds; None where an end is missing)."""
    out: dict[str, float | None] = {}
    for name, start, end, _ in SEGMENTS:
        a, b = points.get(start), points.get(end)
        out[name] = b - a if a is not None and b is not None else None
    return out


def segment_medians(per_request: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Each segment's median over ``per_request`` (None when no request has it)."""
    out: dict[str, float | None] = {}
    for name, *_ in SEGMENTS:
        vals = [s[name] for s in per_request if s.get(name) is not None]
        out[name] = statistics.median(vals) if vals else None  # type: ignore[type-var]
    return out
