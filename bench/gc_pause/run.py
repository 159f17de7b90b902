"""What one full garbage collection stalls a frontend (and a mock worker fleet) for, with
the startup heap frozen (the default, :mod:`services.common.gc_heap`) and without it
(``KVMESH_GC_FREEZE=0``).

``python -m bench.gc_pause [--rounds 2] [--requests 400] [--probes 3] [--out bench/results]``

Contracts:

- Per round, each mode once (``frozen`` and ``unfrozen``, the order alternating by
  round): a mesh as :mod:`bench.mesh_profile` starts it with the embedded router (etcd,
  Redis, one ``workers.fleet`` process of 2 zero-timing mock workers, the frontend), its
  fleet and frontend run under :mod:`bench.gc_pause.probe` with ``KVMESH_GC_FREEZE`` 1 or
  0. Once every process is idle (the frontend has imported vLLM's tool parser), it serves
  ``--requests`` requests of mesh_profile's closed loop (concurrency 8, 240-word
  prompts), then each probed process gets ``--probes`` SIGUSR1s, one after the other's
  answer: each times one full collection on the process's main thread.
- Reports per mode and process the median and largest full collection (ms), the objects
  the collector still traverses and the frozen ones (means over the probes), and per
  process ``unfrozen ÷ frozen`` of the median; the load's req/s per mode, for reference.
  CPython runs a full collection only once enough objects have survived younger ones
  (see :mod:`services.common.gc_heap`): this measures what one costs when it comes, not
  how often it comes.
- Writes ``<out>/gc_pause.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.mesh import BenchMesh
from bench.mesh_profile.run import closed_loop, start
from services.common.gc_heap import FREEZE_ENV
from services.common.procs import Child, wait_until

RESULTS = Path(__file__).resolve().parents[1] / "results"
PROBED = ("frontend", "fleet")
MODES = {"frozen": "1", "unfrozen": "0"}


def _probe(child: Child, prefix: Path, k: int) -> dict[str, Any]:
    """Sends the k-th SIGUSR1; the probe's answer."""
    os.kill(child.pid, signal.SIGUSR1)
    path = Path(f"{prefix}.{k}.json")
    wait_until(path.exists, child, 120, f"{child.name}'s probe {k}")
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def one_mesh(mode: str, requests: int, probes: int) -> dict[str, Any]:
    """One mesh in ``mode``: its load and each probed process's probes."""
    with BenchMesh(f"gc{mode}") as mesh:
        mesh.env[FREEZE_ENV] = MODES[mode]
        probe_dir = mesh.tmp / "probes"
        probe_dir.mkdir()
        args = argparse.Namespace(router="embedded", worker_transport="tcp")
        url, children = start(mesh, args, probe_dir, "bench.gc_pause.probe")
        load = asyncio.run(closed_loop(url, requests, 8, 240, 16, False, 0))
        if load["errors"]:
            raise RuntimeError(f"the load failed: {load['first_errors']}")
        out: dict[str, Any] = {"load": load}
        for name in PROBED:
            out[name] = [_probe(children[name], probe_dir / name, k)
                         for k in range(1, probes + 1)]
        return out


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per probed process: median / max full collection ms, mean tracked and frozen."""
    out: dict[str, Any] = {"req_per_s": float(np.mean([r["load"]["req_per_s"]
                                                       for r in runs]))}
    for name in PROBED:
        probes = [p for r in runs for p in r[name]]
        ms = [p["full_collection_ms"] for p in probes]
        out[name] = {"full_collection_ms_median": float(np.median(ms)),
                     "full_collection_ms_max": float(max(ms)),
                     "tracked": float(np.mean([p["tracked"] for p in probes])),
                     "frozen": float(np.mean([p["frozen"] for p in probes]))}
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = np.arange(len(PROBED))
    for i, mode in enumerate(MODES):
        ax.bar(x + (i - 0.5) * 0.38, [report["summary"][mode][n]["full_collection_ms_median"]
                                      for n in PROBED], 0.38, label=mode)
    ax.set_xticks(x, PROBED)
    ax.set_yscale("log")
    ax.set_ylabel("one full gc.collect(), ms (median)")
    ax.set_title("Main-thread stall of a full garbage collection")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.gc_pause", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--probes", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):
            runs[mode].append(one_mesh(mode, args.requests, args.probes))
            print(mode, {n: [round(p["full_collection_ms"], 1) for p in runs[mode][-1][n]]
                         for n in PROBED}, flush=True)
    report: dict[str, Any] = {
        "benchmark": "gc_pause", "rounds": args.rounds, "requests": args.requests,
        "probes": args.probes, "cpus": os.cpu_count(), "python": sys.version.split()[0],
        "runs": runs, "summary": {m: summary(runs[m]) for m in MODES}}
    report["unfrozen_over_frozen_median"] = {
        n: report["summary"]["unfrozen"][n]["full_collection_ms_median"]
        / report["summary"]["frozen"][n]["full_collection_ms_median"] for n in PROBED}
    print(json.dumps(report["summary"], indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gc_pause.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "gc_pause.png")
    print(f"-> {out}/gc_pause.json")
    return 0


def entry() -> None:
    sys.exit(main())
