"""Pure report building for the kvmesh vs Dynamo bench: medians over rounds, ratios, the
table and the PNG. No I/O but :func:`plot` (which writes the PNG it is given).

Contracts:

- A *round result* is a :func:`bench.frontend_vs_dynamo.client.summary` dict, or
  ``{"error": str}`` when the side could not run that round. ``results[mode][point][side]``
  is the list of one side's round results at one point (mode ``"closed"``: point =
  concurrency; ``"open"``: point = offered req/s; side ``"kvmesh"`` or ``"dynamo"``).
- :func:`median` of the finite numbers given, None when there are none.
  :func:`ratio(a, b)` = a / b, None when either is missing, not finite, or b is 0.
- :func:`side_summary(rounds)`: medians over the rounds that ran with at least one ok
  request of ``req_per_s``, ``p50_ms``, ``p99_ms``; ``rounds_ok``, ``errors`` (requests
  that failed over all rounds) and ``side_errors`` (the distinct errors of rounds that
  could not run at all); also the medians of ``cpu_us_per_req`` (the side's processes),
  ``client_cpu_us_per_req`` and ``cpu_us_per_req_by_process`` (each process of the side,
  with its children) where the rounds recorded them.
- :func:`build_rows(results)`: per mode the rows in increasing point order, each
  ``{"point", "kvmesh", "dynamo", "ratio"}`` with ``ratio`` = kvmesh ÷ Dynamo of
  ``req_per_s``, ``p50_ms``, ``p99_ms`` and ``cpu_us_per_req`` (for req/s above 1 is
  better for kvmesh, for latency and CPU below 1 is).
- :func:`goal(rows)`: the issue's targets, reported never asserted: req/s ratio ≥ 1 at
  concurrency 8 and 32, p50 ratio ≤ 1 at concurrency 1 (None where not measured).
- :func:`paced_goal(paced)`: the one-at-a-time target (kvmesh ÷ Dynamo p50 ≤ 1) of the
  ``paced`` report, and why it is void: None with the reason when the part did not run
  or either side's requests failed more than :data:`MAX_ERROR_SHARE` of the time (its
  p50 would be of the few it answered).
- :func:`format_table(rows, mode)`: a Markdown table.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

SIDES = ("kvmesh", "dynamo")
KEYS = ("req_per_s", "p50_ms", "p99_ms")
CPU_KEYS = ("cpu_us_per_req", "client_cpu_us_per_req")


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def median(values: Iterable[Any]) -> float | None:
    """See the module docstring."""
    xs = sorted(float(v) for v in values if _finite(v))
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def ratio(a: Any, b: Any) -> float | None:
    """See the module docstring."""
    if not (_finite(a) and _finite(b)) or b == 0:
        return None
    return float(a) / float(b)


def median_by_process(rounds: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The median over ``rounds`` of each process's ``cpu_us_per_req_by_process``."""
    names = sorted({n for r in rounds for n in r.get("cpu_us_per_req_by_process", {})})
    out = {n: median(r.get("cpu_us_per_req_by_process", {}).get(n) for r in rounds)
           for n in names}
    return {n: v for n, v in out.items() if v is not None}


def side_summary(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """See the module docstring."""
    ran = [r for r in rounds if "error" not in r and r.get("ok", 0) > 0]
    out: dict[str, Any] = {k: median(r.get(k) for r in ran) for k in (*KEYS, *CPU_KEYS)}
    out["cpu_us_per_req_by_process"] = median_by_process(ran)
    out["rounds"] = len(rounds)
    out["rounds_ok"] = len(ran)
    out["errors"] = sum(int(r.get("errors", 0)) for r in rounds if "error" not in r)
    out["side_errors"] = sorted({str(r["error"]) for r in rounds if "error" in r})
    return out


def build_rows(results: Mapping[str, Mapping[Any, Mapping[str, Sequence[Any]]]]
               ) -> dict[str, list[dict[str, Any]]]:
    """See the module docstring."""
    out: dict[str, list[dict[str, Any]]] = {}
    for mode, points in results.items():
        rows = []
        for point in sorted(points, key=float):
            per = points[point]
            row: dict[str, Any] = {"point": float(point) if mode == "open" else int(point)}
            for side in SIDES:
                row[side] = side_summary(per.get(side, []))
            row["ratio"] = {k: ratio(row["kvmesh"][k], row["dynamo"][k])
                            for k in (*KEYS, "cpu_us_per_req")}
            rows.append(row)
        out[mode] = rows
    return out


def goal(rows: Sequence[Mapping[str, Any]]) -> dict[str, bool | None]:
    """See the module docstring."""
    by = {r["point"]: r["ratio"] for r in rows}

    def ok(point: int, key: str, better_high: bool) -> bool | None:
        v = by.get(point, {}).get(key)
        if v is None:
            return None
        return bool(v >= 1.0) if better_high else bool(v <= 1.0)

    return {"req_per_s_ratio_ge_1_at_c8": ok(8, "req_per_s", True),
            "req_per_s_ratio_ge_1_at_c32": ok(32, "req_per_s", True),
            "p50_ratio_le_1_at_c1": ok(1, "p50_ms", False)}


MAX_ERROR_SHARE = 0.01


def paced_goal(paced: Mapping[str, Any]) -> tuple[bool | None, str | None]:
    """See the module docstring."""
    if "ratio" not in paced:
        return None, str(paced.get("error", "the paced part did not run"))
    for side in SIDES:
        got = paced.get(side, {})
        n, errors = int(got.get("requests", 0)), int(got.get("errors", 0))
        if n <= 0 or errors > MAX_ERROR_SHARE * n:
            return None, (f"{side} failed {errors} of {n} paced requests"
                          f" (first: {', '.join(got.get('first_errors', [])) or '-'})")
    v = paced["ratio"].get("p50_ms")
    return (bool(v <= 1.0) if v is not None else None), None


def _num(v: Any, fmt: str) -> str:
    return format(v, fmt) if _finite(v) else "—"


def _times(v: Any) -> str:
    return f"{v:.2f}×" if _finite(v) else "—"


def format_table(rows: Sequence[Mapping[str, Any]], mode: str = "closed") -> str:
    """See the module docstring."""
    head = "concurrency" if mode == "closed" else "offered req/s"
    lines = [f"| {head} | Dynamo req/s | Dynamo p50 ms | Dynamo p99 ms | kvmesh req/s "
             "| kvmesh p50 ms | kvmesh p99 ms | kvmesh ÷ Dynamo req/s | kvmesh ÷ Dynamo p50 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d, k, q = r["dynamo"], r["kvmesh"], r["ratio"]
        point = r["point"]
        lines.append(
            f"| {point:g} | {_num(d['req_per_s'], '.0f')} | {_num(d['p50_ms'], '.1f')} "
            f"| {_num(d['p99_ms'], '.1f')} | {_num(k['req_per_s'], '.0f')} "
            f"| {_num(k['p50_ms'], '.1f')} | {_num(k['p99_ms'], '.1f')} "
            f"| {_times(q['req_per_s'])} | {_times(q['p50_ms'])} |")
    return "\n".join(lines)


def plot(rows: Mapping[str, Sequence[Mapping[str, Any]]], path: Path, title: str) -> None:
    """req/s and p50/p99 per point and system (closed loop; the open loop's p50/p99 per
    offered rate when measured) as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("closed", "req_per_s", "closed loop: req/s (higher is better)"),
              ("closed", "p50_ms", "closed loop: p50 / p99 ms (lower is better)")]
    if rows.get("open"):
        panels.append(("open", "p50_ms", "open loop: p50 / p99 ms per offered req/s"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2))
    colors = {"kvmesh": "tab:blue", "dynamo": "tab:orange"}
    for ax, (mode, key, label) in zip(axes, panels, strict=True):
        data = rows.get(mode, [])
        xs = list(range(len(data)))
        width = 0.38
        for j, side in enumerate(SIDES):
            pos = [x + (j - 0.5) * width for x in xs]
            vals = [r[side][key] if r[side][key] is not None else 0.0 for r in data]
            ax.bar(pos, vals, width, label=side, color=colors[side])
            if key == "p50_ms":
                p99 = [r[side]["p99_ms"] for r in data]
                ax.scatter([p for p, v in zip(pos, p99, strict=True) if v is not None],
                           [v for v in p99 if v is not None], marker="_", s=300,
                           color="black", zorder=3, label="p99" if j == 0 else None)
        ax.set_xticks(xs, [f"{r['point']:g}" for r in data])
        ax.set_xlabel("concurrency" if mode == "closed" else "offered req/s")
        ax.set_title(label, fontsize=9)
        if key == "p50_ms":
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
