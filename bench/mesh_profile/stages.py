"""Where one request's wall time goes: the median timeline of a non-streamed completion
through a mock mesh, step by step, in the frontend and the worker fleet.

``python -m bench.mesh_profile.stages [--requests 400] [--gap-ms 10] [--out
bench/results] [--name mesh_stages]``

Contracts:

- Starts :func:`bench.mesh_profile.run.start`'s mesh with the router embedded (etcd,
  Redis, one ``workers.fleet`` process of 2 zero-timing mock workers, the frontend), the
  frontend and the fleet under :mod:`bench.mesh_profile.stamps` (entry and exit stamps of
  their request steps on one monotonic clock); every child is stopped by PID at the end.
- Load, from this process: 100 warm-up requests, then ``--requests`` POSTs of
  ``/v1/completions`` (64 token ids, ``max_tokens`` 1, temperature 0) one at a time,
  ``--gap-ms`` apart (10 ms: the pacing of 100 req/s without overlap), with the lean
  HTTP client (:class:`bench.router_overhead.lean.LeanHttp`: a few µs of client); each
  request's send and answer times are kept. The stamps are recorded between two SIGUSR1s
  around the measured requests.
- Per request, each stamp between its send and its answer is placed at its offset from
  the send, named ``<F|W>:<step><+|->#k`` (frontend or fleet; entry or exit; k-th of
  that name in the request). ``timeline``: per name the median offset in µs over the
  requests where it occurred and in how many, names seen in fewer than 30 % of the
  requests left out, in order of median offset; ``answer_us``: the median send→answer.
  Medians of offsets are not a single request's path: read the gaps, not the sums.
- Writes ``<out>/<name>.json`` and prints the timeline. Only on this machine's loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.mesh import BenchMesh
from bench.mesh_profile import run as mesh_run  # the mesh and its snapshot signals
from bench.router_overhead.lean import LeanHttp
from bench.router_overhead.run import MODEL, prompt

RESULTS = Path(__file__).resolve().parents[1] / "results"
WARMUP = 100
MIN_SHARE = 0.3


def timeline(requests: Sequence[tuple[int, int]],
             stamps: Mapping[str, Sequence[Sequence[Any]]]) -> dict[str, Any]:
    """The report's ``timeline`` and ``answer_us`` (see the module docstring) from each
    request's (send, answer) ns and each process's stamps (``(ns, step, "+"|"-")``)."""
    events = sorted((int(ns), f"{proc}:{step}{edge}")
                    for proc, log in stamps.items() for ns, step, edge in log)
    times = [t for t, _ in events]
    offsets: dict[str, list[float]] = defaultdict(list)
    for sent, answered in requests:
        seen: Counter[str] = Counter()
        for ns, name in events[bisect.bisect_left(times, sent):
                               bisect.bisect_right(times, answered)]:
            seen[name] += 1
            offsets[f"{name}#{seen[name]}"].append((ns - sent) / 1e3)
    need = MIN_SHARE * len(requests)
    medians = sorted((float(np.median(v)), name, len(v))
                     for name, v in offsets.items() if len(v) >= need)
    rows = [{"stamp": name, "median_us": med, "requests": n} for med, name, n in medians]
    answers = [(a - s) / 1e3 for s, a in requests]
    return {"timeline": rows,
            "answer_us": float(np.median(answers)) if answers else float("nan")}


async def _load(url: str, n: int, gap_s: float, offset: int) -> list[tuple[int, int]]:
    host, _, port = url.removeprefix("http://").rpartition(":")
    http = LeanHttp(host, int(port))
    out = []
    try:
        for i in range(n):
            await asyncio.sleep(gap_s)
            sent = time.perf_counter_ns()
            await http.post("/v1/completions", {"model": MODEL, "prompt": prompt(offset + i),
                                                "max_tokens": 1, "temperature": 0})
            out.append((sent, time.perf_counter_ns()))
    finally:
        http.close()
    return out


def record_lone(runner: str, suffix: str, n: int, gap_s: float, warmup: int = WARMUP,
                warmup_gap_s: float | None = None
                ) -> tuple[list[tuple[int, int]], dict[str, Any]]:
    """The embedded mesh of :func:`bench.mesh_profile.run.start` with its frontend and fleet
    under ``runner`` (recording between two SIGUSR1s); ``warmup`` lone requests
    ``warmup_gap_s`` apart (default ``gap_s``), then ``n`` recorded ones ``gap_s`` apart:
    their (send, answer) ns and each child's ``<name>.<suffix>`` file, parsed, by name."""
    mesh_args = argparse.Namespace(router="embedded", worker_transport="tcp")
    with BenchMesh("mlone") as mesh:
        out_dir = mesh.tmp / "recorded"
        out_dir.mkdir()
        url, children = mesh_run.start(mesh, mesh_args, out_dir, runner=runner)
        asyncio.run(_load(url, warmup, gap_s if warmup_gap_s is None else warmup_gap_s,
                          1_000_000))
        mesh_run._snapshot(children, out_dir, 1)
        requests = asyncio.run(_load(url, n, gap_s, 0))
        mesh_run._snapshot(children, out_dir, 2)
        return requests, {name: json.loads((out_dir / f"{name}.{suffix}").read_text())
                          for name in ("frontend", "fleet")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    requests, logs = record_lone("bench.mesh_profile.stamps", "stamps.json", args.requests,
                                 args.gap_ms / 1e3)
    stamps = {"F": logs["frontend"], "W": logs["fleet"]}
    report: dict[str, Any] = {"benchmark": "mesh_stages", "requests": args.requests,
                              "gap_ms": args.gap_ms, "router": "embedded",
                              "engine": "mock (zero timing), 2 workers"}
    report.update(timeline(requests, stamps))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.mesh_profile.stages",
                                description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--gap-ms", type=float, default=10.0)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="mesh_stages")
    args = p.parse_args(argv)
    report = run(args)
    for row in report["timeline"]:
        print(f"{row['median_us']:8.1f} µs  {row['requests']:5d}  {row['stamp']}")
    print(f"{report['answer_us']:8.1f} µs  answer at the client (median)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    print(f"-> {out}/{args.name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
