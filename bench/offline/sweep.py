"""Arrival speed-up sweeps, per-run metrics and capacity by bisection (pure apart from the
runs themselves).

Contract:

- :func:`point_metrics(results, duration_s, speedup, slo_ttft_s, slo_itl_s)` is one
  run's row: the share of *all* requests meeting both SLOs (TTFT ≤ and per-request mean
  ITL ≤, as Dynamo counts; rejected and failed requests are misses), TTFT and ITL
  p50/p90/p99/mean over completed requests (ITL = per-request mean ITL), KV hit ratio
  (cached / prompt tokens of completed requests), counts of ok/rejected/errors, and the
  shares of all requests that completed but missed the TTFT (``ttft_miss_share``) or the
  ITL SLO (``itl_miss_share``; a request may miss both).
- :func:`capacity(evaluate, points, target, iters)`: ``points`` maps speed-up → SLO share
  of the sweep. The capacity is the highest speed-up whose share is ≥ ``target``: take
  the highest passing sweep point below the first failing one above it and bisect
  between them ``iters`` times with ``evaluate(speedup) -> share`` (each probe is added
  to ``points``). When every point passes, the capacity is the largest point and
  ``bounded`` is False; when none does, it is bisected between 0 and the smallest point.
  Returns ``(capacity, bounded)``. Assumes the share falls as the speed-up grows.
- :class:`System` names one line of the plot: ``kind`` ``"kvmesh"`` (a
  :class:`SimConfig`) or ``"dynamo"`` (a Dynamo router mode); :func:`run_system` sweeps
  it over the speed-ups, bisects its capacity, and returns its rows; failures of Dynamo
  are recorded as ``{"error": ...}`` instead of raising.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.offline.config import SimConfig
from bench.offline.sim import simulate
from bench.replay.stats import Result, summarize
from bench.replay.trace import TraceRequest


def point_metrics(results: list[Result], duration_s: float, speedup: float,
                  slo_ttft_s: float, slo_itl_s: float) -> dict[str, Any]:
    """One run's row; see the module docstring."""
    s = summarize(results, duration_s, 0.0, slo_ttft_s, slo_itl_s)
    ok = [r for r in results if r.status == "ok"]
    n = len(results) or 1
    ttft_miss = sum(1 for r in ok if r.ttft_s is not None and r.ttft_s > slo_ttft_s)
    itl_miss = sum(1 for r in ok if (t := r.tpot_s) is not None and t > slo_itl_s)
    return {
        "ttft_miss_share": ttft_miss / n, "itl_miss_share": itl_miss / n,
        "speedup": speedup, "slo_share": s["slo_attainment"], "requests": s["requests"],
        "ok": s["ok"], "rejected": s["rejected"], "errors": s["errors"],
        "hit_ratio": s["hit_ratio"], "ttft_s": s["ttft_s"], "itl_s": s["tpot_s"],
        "duration_s": duration_s,
    }


def capacity(evaluate: Callable[[float], float], points: dict[float, float],
             target: float = 0.9, iters: int = 4) -> tuple[float, bool]:
    """Highest speed-up with share ≥ ``target``; see the module docstring."""
    xs = sorted(points)
    if not xs:
        raise ValueError("capacity needs at least one sweep point")
    passing = [x for x in xs if points[x] >= target]
    failing = [x for x in xs if points[x] < target]
    if not failing:
        return xs[-1], False
    hi = failing[0]
    below = [x for x in passing if x < hi]
    lo = below[-1] if below else 0.0
    for _ in range(iters):
        mid = (lo + hi) / 2.0
        share = evaluate(mid)
        points[mid] = share
        if share >= target:
            lo = mid
        else:
            hi = mid
    return lo, True


@dataclass(frozen=True)
class System:
    """One line of the comparison."""

    name: str
    kind: str  # "kvmesh" or "dynamo"
    cfg: SimConfig
    router_mode: str = ""  # Dynamo's: kv_router or round_robin


def run_system(system: System, trace: Sequence[TraceRequest], trace_path: str,
               speedups: Sequence[float], target: float = 0.9, iters: int = 4,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """Sweep + capacity of one system; see the module docstring."""
    cfg = system.cfg
    rows: dict[float, dict[str, Any]] = {}

    def one(speedup: float) -> float:
        t = time.perf_counter()
        if system.kind == "dynamo":
            from bench.offline.dynamo import run_dynamo

            results, info = run_dynamo(trace_path, system.router_mode, speedup, cfg)
            end = max(((r.send_s + (r.e2e_s or 0.0)) for r in results), default=0.0)
            row = point_metrics(results, end, speedup, cfg.slo_ttft_s, cfg.slo_itl_s)
            row["dynamo"] = info
        else:
            run = simulate(trace, cfg.replace(speedup=speedup))
            row = point_metrics(run.results, run.duration_s, speedup, cfg.slo_ttft_s,
                                cfg.slo_itl_s)
            row["counters"] = {k: v for k, v in run.counters.items()
                               if k != "worker_busy_s"}
        row["wall_s"] = round(time.perf_counter() - t, 2)
        rows[speedup] = row
        log(f"{system.name} x{speedup:g}: SLO share {row['slo_share']:.3f}, hit "
            f"{row['hit_ratio']:.3f}, wall {row['wall_s']:.1f} s")
        return float(row["slo_share"])

    out: dict[str, Any] = {"name": system.name, "kind": system.kind,
                           "config": cfg.label() if system.kind == "kvmesh"
                           else f"dynamo {system.router_mode}"}
    try:
        shares = {s: one(s) for s in speedups}
        cap, bounded = capacity(one, shares, target, iters)
    except Exception as exc:  # noqa: BLE001 (a broken system must not end the bench)
        if system.kind != "dynamo":
            raise
        out["error"] = str(exc)
        log(f"{system.name}: {exc}")
        cap, bounded = 0.0, False
    out["capacity"] = cap
    out["capacity_bounded"] = bounded
    out["points"] = [rows[s] for s in sorted(rows)]
    return out
