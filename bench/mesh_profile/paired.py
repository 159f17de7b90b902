"""One request at a time through two checkouts' meshes at once: what a change did to the
latency of a lone request, with the machine's drift taken out.

``python -m bench.mesh_profile.paired --baseline DIR [--pairs 800] [--gap-ms 10] [--out
bench/results] [--name mesh_paired]``

Contracts:

- Two meshes of :func:`bench.mesh_profile.run.start` (router embedded, etcd, Redis, one
  ``workers.fleet`` of 2 zero-timing mock workers, the frontend) run at once: one from
  ``DIR``'s checkout (its children started with ``DIR`` as their working directory, so
  they import its code), one from this checkout. Every child is stopped by PID.
- Load, from this process: :func:`bench.frontend_vs_dynamo.client.paced_rounds` (the
  lean client, one keep-alive connection per mesh, 64 token ids and one token), 50
  warm-up rounds of their own prompts, then ``--pairs`` rounds of one request to each
  mesh in a random order (seeded), every request ``--gap-ms`` after the previous answer
  (10: a process wakes from that long a sleep, as at 100 req/s one at a time). A
  request that fails (not a 200 of one token) fails the bench.
- The mesh started second answered ~0.1 ms sooner in a run comparing a checkout with
  itself, so the whole is done twice, the baseline's mesh started first, then second:
  per order each side's p50 / p90 / p99 µs and the median over rounds of (current −
  baseline); ``diff_p50_us`` is the mean of the two orders' medians (the start order's
  part cancels), ``ratio_p50`` current ÷ baseline of the p50s pooled over both orders.
- Writes ``<out>/<name>.json`` and prints it. Only on this machine's loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.frontend_vs_dynamo.client import Paced, paced_rounds
from bench.mesh import BenchMesh
from bench.mesh_profile import run as mesh_run
from bench.router_overhead.run import MODEL

RESULTS = Path(__file__).resolve().parents[1] / "results"
WARMUP = 50


def paired_summary(base: Sequence[float], cur: Sequence[float]) -> dict[str, float]:
    """Per side p50 / p90 / p99 of one order's latencies (µs, the same rounds, in
    order) and the median of the per-round differences (current − baseline)."""
    b, c = np.asarray(base, dtype=float), np.asarray(cur, dtype=float)
    if b.shape != c.shape or not b.size:
        raise ValueError("the two sides need the same, non-zero number of rounds")
    out = {f"{side}_p{q}_us": float(np.percentile(a, q))
           for side, a in (("baseline", b), ("current", c)) for q in (50, 90, 99)}
    out["diff_p50_us"] = float(np.median(c - b))
    return out


def _latencies_us(got: Paced) -> dict[str, list[float]]:
    """Each side's latencies in µs; a failed request fails the bench."""
    failed = {side: dict(e) for side, e in got.errors.items() if e}
    if failed:
        raise RuntimeError(f"requests failed: {failed}")
    return {side: [x * 1e6 for x in lat if x is not None] for side, lat in got.lat.items()}


def _one_order(baseline: Path, here: Path, first: str, args: argparse.Namespace
               ) -> dict[str, list[float]]:
    mesh_args = argparse.Namespace(router="embedded", worker_transport="tcp")
    dirs = {"baseline": baseline, "current": here}
    order = [first, "current" if first == "baseline" else "baseline"]
    urls: dict[str, str] = {}
    with BenchMesh("paired-a") as a, BenchMesh("paired-b") as b:
        try:
            for side, mesh in zip(order, (a, b), strict=True):
                os.chdir(dirs[side])  # its children import that checkout's code
                urls[side], _ = mesh_run.start(mesh, mesh_args, None)
        finally:
            os.chdir(here)
        gap = args.gap_ms / 1e3
        asyncio.run(paced_rounds(urls, MODEL, WARMUP, gap, seed=1, offset=80_000_000))
        return _latencies_us(asyncio.run(paced_rounds(urls, MODEL, args.pairs, gap)))


def run(args: argparse.Namespace) -> dict[str, Any]:
    baseline, here = Path(args.baseline).resolve(), Path.cwd().resolve()
    if not (baseline / "services" / "frontend").is_dir():
        raise SystemExit(f"--baseline {baseline}: not a kvmesh checkout")
    orders: dict[str, dict[str, float]] = {}
    pooled: dict[str, list[float]] = {"baseline": [], "current": []}
    for first in ("baseline", "current"):
        lat = _one_order(baseline, here, first, args)
        orders[f"{first}_started_first"] = paired_summary(lat["baseline"], lat["current"])
        for side in pooled:
            pooled[side] += lat[side]
    diffs = [o["diff_p50_us"] for o in orders.values()]
    return {"benchmark": "mesh_paired", "baseline": str(baseline), "pairs": args.pairs,
            "gap_ms": args.gap_ms, "router": "embedded",
            "engine": "mock (zero timing), 2 workers", "orders": orders,
            "diff_p50_us": float(np.mean(diffs)),
            "ratio_p50": float(np.median(pooled["current"]) / np.median(pooled["baseline"]))}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.mesh_profile.paired",
                                description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="another kvmesh checkout")
    p.add_argument("--pairs", type=int, default=800)
    p.add_argument("--gap-ms", type=float, default=10.0)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="mesh_paired")
    args = p.parse_args(argv)
    if args.pairs < 1 or args.gap_ms < 0:
        p.error("--pairs must be >= 1 and --gap-ms >= 0")
    report = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
