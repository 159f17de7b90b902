"""JSON and PNG output of an offline comparison.

Contract:

- :func:`write_json(path, report)` writes the report (config, per-system sweep rows and
  capacities, Dynamo availability) as indented JSON.
- :func:`plot(path, systems, target)` draws the SLO share against the arrival speed-up,
  one line per system (kvmesh solid, Dynamo dashed), the target as a horizontal line and
  each capacity as a marker; and, beside it, the KV hit ratio against the speed-up.
- :func:`table(systems)` is the capacity table as Markdown lines.
- :func:`merge(paths, out)` (``python -m bench.offline.report OUT IN.json ...``) combines
  reports of separate runs into one JSON + PNG.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def write_json(path: Path, report: dict[str, Any]) -> None:
    """See the module docstring."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")


def plot(path: Path, systems: list[dict[str, Any]], target: float = 0.9) -> None:
    """See the module docstring."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    for s in systems:
        pts = s.get("points") or []
        if not pts:
            continue
        xs = [p["speedup"] for p in pts]
        style = "--" if s["kind"] == "dynamo" else "-"
        line, = ax.plot(xs, [p["slo_share"] for p in pts], style, marker="o", ms=3,
                        label=f"{s['name']} (cap {s['capacity']:.2f}x)")
        if s.get("capacity"):
            ax.axvline(s["capacity"], color=line.get_color(), alpha=0.25, lw=1)
        bx.plot(xs, [p["hit_ratio"] for p in pts], style, marker="o", ms=3,
                color=line.get_color(), label=s["name"])
    ax.axhline(target, color="grey", lw=1, ls=":")
    ax.set_xlabel("arrival speed-up")
    ax.set_ylabel(f"share of requests meeting TTFT and ITL SLOs (target {target:g})")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    bx.set_xlabel("arrival speed-up")
    bx.set_ylabel("KV hit ratio (cached / prompt tokens)")
    bx.grid(alpha=0.3)
    bx.legend(fontsize=7)
    fig.suptitle("Offline replay: kvmesh cores vs Dynamo run_trace_replay")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(systems: list[dict[str, Any]]) -> list[str]:
    """Markdown capacity table; see the module docstring."""
    lines = ["| system | config | capacity (x) | SLO share per speed-up | hit ratio |",
             "|---|---|---|---|---|"]
    for s in systems:
        pts = s.get("points") or []
        shares = ", ".join(f"{p['speedup']:g}: {p['slo_share']:.3f}" for p in pts)
        hits = ", ".join(f"{p['hit_ratio']:.3f}" for p in pts)
        cap = "error" if s.get("error") else (
            f"{s['capacity']:.2f}" + ("" if s.get("capacity_bounded") else "+"))
        lines.append(f"| {s['name']} | {s['config']} | {cap} | {shares} | {hits} |")
    return lines


def merge(paths: list[Path], out: Path) -> dict[str, Any]:
    """Combines several reports' systems (first occurrence of a name wins) into one
    JSON + PNG at ``out`` (without extension); returns the merged report."""
    merged: dict[str, Any] = {"merged_from": [str(p) for p in paths], "systems": []}
    seen: set[str] = set()
    for p in paths:
        rep = json.loads(p.read_text())
        for k in ("trace", "limit", "target", "slo", "config", "dynamo"):
            merged.setdefault(k, rep.get(k))
        for s in rep.get("systems", []):
            if s["name"] not in seen:
                seen.add(s["name"])
                merged["systems"].append(s)
    merged["table"] = table(merged["systems"])
    write_json(out.with_suffix(".json"), merged)
    plot(out.with_suffix(".png"), merged["systems"], merged.get("target") or 0.9)
    return merged


if __name__ == "__main__":  # python -m bench.offline.report OUT IN.json [IN.json ...]
    import sys

    print("\n".join(merge([Path(p) for p in sys.argv[2:]], Path(sys.argv[1]))["table"]))
