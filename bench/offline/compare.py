"""Live replay vs offline replay: the metrics both can be compared on (pure).

Issue 7's consistency check runs a small trace through the live mesh (mock workers, real
services, ``bench.replay``) and through :func:`bench.offline.sim.simulate` with the same
topology and policy, and expects the same hit ratio (within a tolerance) and the same
ordering of policies.

Contract:

- :func:`live_metrics(report)` reads a ``bench.replay`` JSON report (``runs`` with
  ``speedup``, ``hit_ratio``, ``slo_attainment``, ``ttft_s``, ``tpot_s``) into
  ``{speedup: {"hit_ratio", "slo_share", "ttft_p50_s", "itl_p50_s"}}``.
- :func:`offline_metrics(rows)` does the same for offline rows
  (:func:`bench.offline.sweep.point_metrics` or a system's ``points``).
- :func:`scaled_trace(trace, token_scale)` shrinks input and output lengths as the live
  replay's ``--token-scale`` does (``max(1, round(n · scale))``), keeping hash ids, so
  the offline run sees the prompts the live one sent; use
  ``trace_block_size = round(512 · scale)`` with it.
- :func:`compare(live, offline)` pairs the speed-ups both have and returns, per
  speed-up, both values and their differences.
- :func:`same_order(a, b)` is True when two ``{policy: value}`` maps rank the policies
  the same way (ties in either map allow either order).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from bench.replay.trace import TraceRequest

Metrics = dict[float, dict[str, float | None]]


def _p50(d: Mapping[str, Any] | None) -> float | None:
    return None if not d else d.get("p50")


def live_metrics(report: Mapping[str, Any]) -> Metrics:
    """See the module docstring."""
    return {float(r["speedup"]): {"hit_ratio": r["hit_ratio"],
                                  "slo_share": r["slo_attainment"],
                                  "ttft_p50_s": _p50(r.get("ttft_s")),
                                  "itl_p50_s": _p50(r.get("tpot_s"))}
            for r in report["runs"]}


def offline_metrics(rows: Iterable[Mapping[str, Any]]) -> Metrics:
    """See the module docstring."""
    return {float(r["speedup"]): {"hit_ratio": r["hit_ratio"], "slo_share": r["slo_share"],
                                  "ttft_p50_s": _p50(r.get("ttft_s")),
                                  "itl_p50_s": _p50(r.get("itl_s"))}
            for r in rows}


def scaled_trace(trace: Sequence[TraceRequest], token_scale: float) -> list[TraceRequest]:
    """See the module docstring."""
    return [TraceRequest(r.timestamp_ms, max(1, round(r.input_length * token_scale)),
                         max(1, round(r.output_length * token_scale)), r.hash_ids)
            for r in trace]


def compare(live: Metrics, offline: Metrics) -> dict[float, dict[str, float | None]]:
    """See the module docstring."""
    out: dict[float, dict[str, float | None]] = {}
    for s in sorted(set(live) & set(offline)):
        row: dict[str, float | None] = {}
        for k in ("hit_ratio", "slo_share", "ttft_p50_s", "itl_p50_s"):
            a, b = live[s].get(k), offline[s].get(k)
            row[f"live_{k}"], row[f"offline_{k}"] = a, b
            row[f"diff_{k}"] = None if a is None or b is None else b - a
        out[s] = row
    return out


def same_order(a: Mapping[str, float], b: Mapping[str, float], tol: float = 1e-9) -> bool:
    """See the module docstring."""
    names = sorted(set(a) & set(b))
    for i, x in enumerate(names):
        for y in names[i + 1:]:
            da, db = a[x] - a[y], b[x] - b[y]
            if abs(da) <= tol or abs(db) <= tol:
                continue
            if (da > 0) != (db > 0):
                return False
    return True
