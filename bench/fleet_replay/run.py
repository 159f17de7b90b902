"""Routing policies compared on a Mooncake trace, through the live mesh with a mock fleet.

``python -m bench.fleet_replay [--trace ../shared/traces/mooncake_conversation_trace.jsonl]
[--limit 200] [--policies kv,approx,round_robin] [--speedups 1,2,4] [--workers 32]
[--topologies standalone,embedded,replicas2,replicas2-nosync]``

Contracts:

- Per policy, a fresh mesh of child processes on free loopback ports (stopped by PID):
  etcd, Redis, the indexer, one fleet process with ``--workers`` mock workers
  (Dynamo's polynomial timing, ``--block-size`` 64, ``--num-blocks`` per worker), the
  router with that policy (``kv`` reads the indexer; ``approx`` and ``round_robin`` use no
  events) and the frontend. Fresh engines per policy, so no policy inherits another's
  cache.
- **Topologies** (``--topologies``, each a fresh mesh per policy; the report names the run
  ``policy`` for ``standalone``, else ``policy@topology``): ``standalone`` (above: router
  and indexer processes, one frontend), ``embedded`` (one frontend routing in-process
  with its own KV index: ``--router embedded --indexer embedded`` for ``kv``),
  ``replicas<N>`` (N such frontends sharing the HTTP port with ``--reuse-port``, their
  routers in replica sync, :mod:`services.router.replica_sync`) and
  ``replicas<N>-nosync`` (the same without sync: what it buys). The client's connections
  reach the replicas as the kernel spreads them.
- **Load spread**: each mock worker serves Prometheus metrics (``--metrics-port 0``); per
  run, the requests each worker served (``kvmesh_worker_queue_seconds_count`` after minus
  before) give ``spread``: per-worker counts, their max ÷ mean and coefficient of
  variation.
- **Time dilation**: the mock engines run ``--dilation`` times slower than Dynamo's
  timing model (``speedup_ratio = 1/dilation``) and the SLOs are multiplied by the same
  factor, so engine saturation happens at request rates this machine's Python frontend
  can drive. Attainment and hit ratio are unchanged by a uniform dilation; rates are
  reported in trace time (divided by the dilation) and in wall time.
- The trace's first ``--limit`` requests are replayed (bench/replay: prompts from hash
  ids, ``--trace-block`` tokens per id; outputs capped at ``--max-output``) at each
  ``--speedups`` arrival speed-up. Per policy and speed-up: hit ratio, TTFT/TPOT
  percentiles, SLO attainment; per policy: goodput (DistServe, highest rate with ≥ 90 %
  attainment). Writes ``<out>/<name>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.mesh import BenchMesh, warm_up
from bench.replay.stats import goodput
from bench.replay.trace import PromptMaker, load_trace
from services.common.discovery import read_instance_records

RESULTS = Path(__file__).resolve().parents[1] / "results"
DEFAULT_TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / \
    "mooncake_conversation_trace.jsonl"


def parse_topology(text: str) -> tuple[int, bool, bool]:
    """(frontends, embedded router, replica sync) of a ``--topologies`` item; ValueError
    for anything else."""
    if text == "standalone":
        return 1, False, False
    if text == "embedded":
        return 1, True, False
    m = re.fullmatch(r"replicas(\d+)(-nosync)?", text)
    if m is None or int(m.group(1)) < 2:
        raise ValueError(f"topology {text!r}: standalone, embedded, replicas<N> or "
                         "replicas<N>-nosync (N >= 2)")
    return int(m.group(1)), True, m.group(2) is None


def worker_counts(mesh: BenchMesh) -> dict[str, float]:
    """Requests each mock worker served so far (its /metrics), by worker id."""
    records = asyncio.run(read_instance_records(mesh.env["KVMESH_ETCD_ENDPOINT"],
                                                mesh.namespace, "worker"))
    out = {}
    with httpx.Client(timeout=10) as c:
        for r in records:
            text = c.get(f"http://{r.metrics_address}/metrics").text
            out[r.instance_id] = sum(float(x.split()[-1]) for x in text.splitlines()
                                     if x.startswith("kvmesh_worker_queue_seconds_count"))
    return out


def spread(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Per-worker requests of one run, max ÷ mean and coefficient of variation."""
    counts = {w: after[w] - before.get(w, 0.0) for w in sorted(after)}
    values = list(counts.values())
    mean = sum(values) / len(values) if values else 0.0
    var = sum((v - mean) ** 2 for v in values) / len(values) if values else 0.0
    return {"per_worker": counts, "max_over_mean": max(values) / mean if mean else None,
            "cv": var ** 0.5 / mean if mean else None}


def _frontends(mesh: BenchMesh, policy: str, indexer: str, topology: str,
               workers: int) -> str:
    """The topology's router(s) and frontend(s); the URL once all serve."""
    n, embedded, sync = parse_topology(topology)
    if not embedded:
        mesh.py("router", "services.router", "--policy", policy, "--indexer", indexer,
                "--seed", "1")
        return mesh.frontend(workers)
    router = f"--policy {policy} --indexer {'embedded' if indexer == 'remote' else indexer}" \
             f" --seed 1{' --replica-sync' if sync else ''}"
    args = ["--router", "embedded", "--router-args", router,
            *(["--reuse-port"] if n > 1 else [])]
    return mesh.frontend(workers, 180.0, *args, replicas=n)


def run_policy(policy: str, args: argparse.Namespace, topology: str = "standalone"
               ) -> dict[str, Any]:
    """One fresh mesh, one policy, every speed-up (see the module docstring)."""
    from bench.replay.run import replay_once

    # The policies the router serves from its own history need no events.
    indexer = "none" if policy in ("approx", "round_robin", "random", "least_loaded") \
        else "remote"
    embedded = parse_topology(topology)[1]
    with BenchMesh("fleet") as mesh:
        if indexer == "remote" and not embedded:
            mesh.py("indexer", "services.indexer")
        mesh.py("fleet", "workers.fleet", "--workers", str(args.workers), "--timing", "poly",
                "--speedup-ratio", str(1.0 / args.dilation), "--block-size", str(args.block_size),
                "--num-blocks", str(args.num_blocks), "--max-model-len", str(args.max_model_len),
                "--model-path", "tiny", "--model-name", "tiny", "--seed", "1",
                "--metrics-port", "0")
        url = _frontends(mesh, policy, indexer, topology, args.workers)
        warm_up(url, "tiny")
        label = policy if topology == "standalone" else f"{policy}@{topology}"
        trace = load_trace(args.trace, args.limit)
        maker = PromptMaker(args.trace_block, 1.0, 700, 0, args.max_input, args.max_output)
        runs = []
        for s in (float(x) for x in args.speedups.split(",")):
            # Wall-clock arrivals are the trace's, sped up and then dilated.
            counts = worker_counts(mesh)
            _, summary = asyncio.run(replay_once(
                url, "tiny", trace, maker, s / args.dilation,
                args.slo_ttft_ms * args.dilation / 1000, args.slo_tpot_ms * args.dilation / 1000,
                progress=not args.no_progress))
            summary["speedup"] = s
            summary["spread"] = spread(counts, worker_counts(mesh))
            summary["wall_rate_rps"] = summary["rate_rps"]
            summary["rate_rps"] = summary["rate_rps"] * args.dilation  # trace time
            runs.append(summary)
            print(f"{label:12s} x{s:g}: {summary['rate_rps']:.2f} req/s (trace time)  hit "
                  f"{summary['hit_ratio']:.3f}  SLO {summary['slo_attainment']:.3f}  "
                  f"max/mean {summary['spread']['max_over_mean']}  "
                  f"errors {summary['errors']}", flush=True)
        return {"policy": label, "topology": topology, "runs": runs,
                "goodput_rps": goodput(runs)}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(16, 4))
    for p in report["policies"]:
        xs = [r["speedup"] for r in p["runs"]]
        ax[0].plot(xs, [r["slo_attainment"] for r in p["runs"]], "o-", label=p["policy"])
        ax[1].plot(xs, [r["hit_ratio"] for r in p["runs"]], "o-", label=p["policy"])
        ax[2].plot(xs, [r["spread"]["cv"] for r in p["runs"]], "o-", label=p["policy"])
    ax[0].axhline(0.9, color="grey", ls="--", lw=1)
    ax[0].set(xlabel="arrival speed-up", ylabel="share meeting both SLOs", ylim=(0, 1.05),
              title="SLO attainment")
    ax[1].set(xlabel="arrival speed-up", ylabel="prompt tokens served from cache",
              ylim=(0, 1.05), title="KV hit ratio")
    ax[2].set(xlabel="arrival speed-up", ylabel="coefficient of variation",
              title="requests per worker: spread (lower is even)")
    for a in ax:
        a.legend()
        a.grid(alpha=0.3)
    fig.suptitle(f"{report['workers']} mock workers, {report['requests']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.fleet_replay", description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--limit", type=int, default=200)
    p.add_argument("--policies", default="kv,approx,round_robin")
    p.add_argument("--topologies", default="standalone")
    p.add_argument("--speedups", default="1,2,4")
    p.add_argument("--workers", type=int, default=32)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--max-input", type=int, default=12000)
    p.add_argument("--max-output", type=int, default=32)
    p.add_argument("--trace-block", type=int, default=512)
    p.add_argument("--dilation", type=float, default=5.0)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="fleet_replay")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:
        for t in args.topologies.split(","):
            parse_topology(t)
    except ValueError as exc:
        p.error(f"--topologies: {exc}")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every policy; the whole report."""
    policies = [run_policy(p, args, t) for t in args.topologies.split(",")
                for p in args.policies.split(",")]
    return {"benchmark": "fleet_replay", "trace": args.trace, "requests": args.limit,
            "workers": args.workers, "block_size": args.block_size,
            "num_blocks": args.num_blocks, "dilation": args.dilation,
            "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
            "max_output": args.max_output, "speedups": args.speedups,
            "topologies": args.topologies, "policies": policies}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    plot(report, out / f"{args.name}.png")
    for p in report["policies"]:
        print(f"{p['policy']:12s} goodput {p['goodput_rps']:.2f} req/s (trace time)")
    return 0


def entry() -> None:
    sys.exit(main())
