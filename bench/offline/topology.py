"""``python -m bench.offline --search-topology N``: the best capacity of every split of N
workers.

Contract:

- :func:`splits(n)` lists the splits of ``n`` >= 2 workers as ``(prefill, decode)``:
  ``(0, 0)`` (``n`` aggregated workers) first, then ``(1, n-1)`` … ``(n-1, 1)``.
  ``n`` < 2 raises ValueError.
- :func:`split_name(p, d, n)`: ``"8agg"`` or ``"3P5D"``.
- :func:`topology_systems(base, n, policies, dynamo_modes)` is one :class:`System` per
  (split, policy, conditional disaggregation on/off; the aggregated split once per
  policy), then, per split, one Dynamo system per mode in ``dynamo_modes`` (empty: none).
  Each system's ``cfg`` carries the split.
- :func:`best_per_split(systems, n)` groups the swept systems (``run_system``'s rows) by
  split and returns one row per split in :func:`splits` order: ``split``, ``prefill``,
  ``decode``, ``best`` (the kvmesh system with the highest capacity; ties: the first),
  ``capacity``, ``bounded``, ``candidates`` ({system name: capacity}), and, when
  Dynamo ran, ``dynamo`` ({mode: capacity}, an errored run is None) and ``ratio`` (best
  kvmesh capacity / the best Dynamo capacity; None without one).
- :func:`topology_table(rows)`: Markdown lines; :func:`plot_topology(path, rows,
  target)`: bars of the best capacity per split (kvmesh, and Dynamo beside it).
- :func:`rows_from_systems(systems)` builds the same rows from swept systems of any
  reports (``run_system`` dicts; the split is read from a kvmesh system's ``config``
  label, ``policy/4P4D-…`` or ``policy/8agg``, and from a Dynamo system's name,
  ``dynamo MODE/4P4D``), in order of first appearance. ``python -m
  bench.offline.topology OUT IN.json ...`` merges reports
  (:func:`bench.offline.report.merge`: ``OUT.json``, ``OUT.png``) and adds the rows as
  ``splits`` and their bars as ``OUT_capacity.png``; it prints the table.
- :func:`main_search(args)` (called by :func:`bench.offline.cli.main`) runs them in
  ``--jobs`` processes and writes ``<out>.json`` (``splits``: the rows; ``systems``:
  every sweep) and ``<out>.png``, prints the table; returns 0 (2 for a bad ``N``).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.offline.config import SimConfig
from bench.offline.sweep import System


def splits(n: int) -> list[tuple[int, int]]:
    """See the module docstring."""
    if n < 2:
        raise ValueError("--search-topology needs at least 2 workers")
    return [(0, 0)] + [(k, n - k) for k in range(1, n)]


def split_name(p: int, d: int, n: int) -> str:
    """See the module docstring."""
    return f"{n}agg" if p == 0 and d == 0 else f"{p}P{d}D"


def topology_systems(base: SimConfig, n: int, policies: Sequence[str],
                     dynamo_modes: Sequence[str] = ()) -> list[System]:
    """See the module docstring."""
    out = []
    for p, d in splits(n):
        for policy in policies:
            if p == 0:
                cfg = base.replace(workers=n, prefill_workers=0, decode_workers=0,
                                   policy=policy)
                cfg.validate()
                out.append(System(f"kvmesh {cfg.label()}", "kvmesh", cfg))
                continue
            for cond in (True, False):
                cfg = base.replace(workers=n, prefill_workers=p, decode_workers=d,
                                   policy=policy, conditional_disagg=cond)
                cfg.validate()
                out.append(System(f"kvmesh {cfg.label()}", "kvmesh", cfg))
        for mode in dynamo_modes:
            cfg = base.replace(workers=n, prefill_workers=p, decode_workers=d)
            out.append(System(f"dynamo {mode}/{split_name(p, d, n)}", "dynamo", cfg, mode))
    return out


def _split_of(cfg: SimConfig) -> tuple[int, int]:
    return (cfg.prefill_workers, cfg.decode_workers) if cfg.disaggregated else (0, 0)


def best_per_split(swept: Sequence[tuple[System, dict[str, Any]]], n: int
                   ) -> list[dict[str, Any]]:
    """See the module docstring."""
    rows = []
    for p, d in splits(n):
        mine = [(s, r) for s, r in swept if _split_of(s.cfg) == (p, d)]
        ours = [(s, r) for s, r in mine if s.kind == "kvmesh"]
        dyn = [(s, r) for s, r in mine if s.kind == "dynamo"]
        row: dict[str, Any] = {"split": split_name(p, d, n), "prefill": p, "decode": d,
                               "best": None, "capacity": None, "bounded": None,
                               "candidates": {s.name: r["capacity"] for s, r in ours}}
        if ours:
            s, r = max(ours, key=lambda x: x[1]["capacity"])
            row.update(best=s.name, capacity=r["capacity"], bounded=r["capacity_bounded"])
        if dyn:
            row["dynamo"] = {s.router_mode: (None if r.get("error") else r["capacity"])
                             for s, r in dyn}
            caps = [c for c in row["dynamo"].values() if c]
            row["ratio"] = (row["capacity"] / max(caps)
                            if caps and row["capacity"] is not None else None)
        rows.append(row)
    return rows


def _split_label(s: dict[str, Any]) -> str:
    text = s["name"].split("/", 1)[1] if s["kind"] == "dynamo" else s["config"].split("/")[1]
    return text.split("-", 1)[0]


def rows_from_systems(systems: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """See the module docstring."""
    order: list[str] = []
    groups: dict[str, list[dict[str, Any]]] = {}
    for s in systems:
        label = _split_label(s)
        if label not in groups:
            order.append(label)
            groups[label] = []
        groups[label].append(s)
    rows = []
    for label in order:
        m = re.fullmatch(r"(\d+)P(\d+)D", label)
        p, d = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
        ours = [s for s in groups[label] if s["kind"] == "kvmesh"]
        dyn = [s for s in groups[label] if s["kind"] == "dynamo"]
        row: dict[str, Any] = {"split": label, "prefill": p, "decode": d, "best": None,
                               "capacity": None, "bounded": None,
                               "candidates": {s["name"]: s["capacity"] for s in ours}}
        if ours:
            best = max(ours, key=lambda s: s["capacity"])
            row.update(best=best["name"], capacity=best["capacity"],
                       bounded=best["capacity_bounded"])
        if dyn:
            row["dynamo"] = {s["name"].split()[1].split("/")[0]:
                             (None if s.get("error") else s["capacity"]) for s in dyn}
            caps = [c for c in row["dynamo"].values() if c]
            row["ratio"] = (row["capacity"] / max(caps)
                            if caps and row["capacity"] is not None else None)
        rows.append(row)
    return rows


def topology_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """See the module docstring."""
    dyn = any("dynamo" in r for r in rows)
    head = "| split | best kvmesh system | capacity (x) |"
    sep = "|---|---|---|"
    if dyn:
        head += " Dynamo (x) | kvmesh / Dynamo |"
        sep += "---|---|"
    lines = [head, sep]
    for r in rows:
        cap = "-" if r["capacity"] is None else (
            f"{r['capacity']:.2f}" + ("" if r["bounded"] else "+"))
        line = f"| {r['split']} | {r['best'] or '-'} | {cap} |"
        if dyn:
            d = r.get("dynamo") or {}
            dtxt = ", ".join(f"{m}: {'error' if c is None else f'{c:.2f}'}"
                             for m, c in d.items()) or "-"
            ratio = r.get("ratio")
            line += f" {dtxt} | {'-' if ratio is None else f'{ratio:.2f}'} |"
        lines.append(line)
    return lines


def plot_topology(path: Path, rows: Sequence[dict[str, Any]], target: float) -> None:
    """See the module docstring."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["split"] for r in rows]
    xs = list(range(len(rows)))
    dyn = any("dynamo" in r for r in rows)
    width = 0.4 if dyn else 0.7
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(rows) + 3), 5))
    ours = [r["capacity"] or 0.0 for r in rows]
    bars = ax.bar([x - (width / 2 if dyn else 0) for x in xs], ours, width,
                  label="kvmesh (best policy / conditional disaggregation)")
    for b, r in zip(bars, rows, strict=True):
        if r["best"]:
            label = r["best"].removeprefix("kvmesh ").split("/")[0]
            cond = "" if r["prefill"] == 0 else (
                (" always" if "-always" in r["best"] else " cond")
                + (" +whole" if r["best"].endswith("-whole") else ""))
            ax.annotate(f"{label}{cond}", (b.get_x() + b.get_width() / 2, b.get_height()),
                        xytext=(0, -4), textcoords="offset points", ha="center", va="top",
                        fontsize=7, rotation=90, color="white")
    if dyn:
        theirs = [max((c for c in (r.get("dynamo") or {}).values() if c), default=0.0)
                  for r in rows]
        ax.bar([x + width / 2 for x in xs], theirs, width, label="Dynamo run_trace_replay")
    ax.set_xticks(xs, names)
    ax.set_xlabel("split of the workers")
    ax.set_ylabel(f"capacity: arrival speed-up at SLO share >= {target:g}")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Offline replay: best capacity per topology split")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main_search(a: argparse.Namespace) -> int:
    """See the module docstring."""
    from bench.offline.cli import base_config, run_systems
    from bench.offline.report import write_json

    n = a.search_topology
    if n < 2:
        print("error: --search-topology needs at least 2 workers", file=sys.stderr)
        return 2
    policies = [x for x in a.policies.split(",") if x]
    status: str | None = "not requested (--dynamo)"
    if a.dynamo:
        from bench.offline.dynamo import dynamo_status

        status = dynamo_status()
        if status:
            print(f"Dynamo side by side skipped: {status}", flush=True)
    modes = [x for x in a.dynamo_modes.split(",") if x] if a.dynamo and not status else []
    base = base_config(a)
    try:
        systems = topology_systems(base, n, policies, modes)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    done = run_systems(a, systems)
    rows = best_per_split(list(zip(systems, done, strict=True)), n)
    report = {
        "trace": a.trace, "limit": a.limit, "workers": n, "speedups": a.speedups,
        "target": a.target, "slo": {"ttft_ms": a.slo_ttft_ms, "itl_ms": a.slo_itl_ms},
        "config": vars(base), "dynamo": {"requested": a.dynamo, "status": status or "ok"},
        "wall_s": round(time.perf_counter() - t0, 1), "splits": rows,
        "table": topology_table(rows), "systems": done,
    }
    out = Path(a.out)
    write_json(Path(f"{out}.json"), report)
    plot_topology(Path(f"{out}.png"), rows, a.target)
    print("\n".join(report["table"]))
    print(f"wrote {out}.json and {out}.png")
    return 0


if __name__ == "__main__":  # python -m bench.offline.topology OUT IN.json [IN.json ...]
    from bench.offline.report import merge, write_json

    out_path = Path(sys.argv[1])
    merged = merge([Path(x) for x in sys.argv[2:]], out_path)
    merged["splits"] = rows_from_systems(merged["systems"])
    merged["split_table"] = topology_table(merged["splits"])
    write_json(Path(f"{out_path}.json"), merged)
    plot_topology(Path(f"{out_path}_capacity.png"), merged["splits"],
                  merged.get("target") or 0.9)
    print("\n".join(merged["table"] + [""] + merged["split_table"]))
