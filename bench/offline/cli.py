"""``python -m bench.offline`` / ``kvmesh bench replay --offline``: the offline replay CLI.

Contract of :func:`main(argv) -> int`: parses ``argv`` (see ``--help``), builds one
kvmesh system per (policy, admission) pair on the chosen topology and, with
``--dynamo``, one Dynamo system per ``--dynamo-modes`` entry; sweeps each over
``--speedups`` and bisects its capacity (share ≥ ``--target``); prints progress and the
capacity table; writes ``<out>.json`` and ``<out>.png``. Systems run in ``--jobs``
processes. Dynamo missing or failing is reported in the JSON (``dynamo.status``), never
fatal. ``--timeline X`` first runs each kvmesh system once at speed-up X and writes its
timeline (:mod:`bench.offline.timeline`) to ``<out>_timeline-<system>.json/.png``
(``--timeline-only``: nothing else); ``--search-topology N`` runs the topology search
instead (:func:`bench.offline.topology.main_search`). Returns 0, or 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench.offline.config import ADMISSIONS, SimConfig
from bench.offline.report import plot, table, write_json
from bench.offline.sweep import System, run_system
from bench.replay.trace import load_trace
from services.router.disagg import ORDERS

RESULTS = Path(__file__).resolve().parents[1] / "results"
DEFAULT_TRACE = "../shared/traces/mooncake_conversation_trace.jsonl"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    """The argument parser (also used by ``kvmesh bench replay --offline``)."""
    p = argparse.ArgumentParser(prog="python -m bench.offline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake JSONL trace")
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--trace-block-size", type=int, default=512)
    p.add_argument("--workers", type=int, default=8, help="aggregated workers")
    p.add_argument("--prefill-workers", type=int, default=0)
    p.add_argument("--decode-workers", type=int, default=0)
    p.add_argument("--disagg-order", choices=ORDERS, default="prefill_first")
    p.add_argument("--no-conditional-disagg", action="store_true",
                   help="always disaggregate (no Dynamo conditional disaggregation)")
    p.add_argument("--prefill-whole", action="store_true",
                   help="when every D's KV is full, a P worker serves the request whole "
                   "(prefill and decode; the router's \"P serves whole\", offline only)")
    p.add_argument("--policies", default="kv,round_robin,approx",
                   help="router policies or profiles (comma separated; also ttft, ttft_kv)")
    p.add_argument("--prefill-policy", default=None)
    p.add_argument("--profiles", default=None, help="extra router profiles YAML")
    p.add_argument("--admission", default="none",
                   help=f"comma separated admission policies: {', '.join(ADMISSIONS)}")
    p.add_argument("--speedups", type=_floats, default=[1.0, 2.0, 4.0, 6.0, 8.0])
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-itl-ms", type=float, default=50.0)
    p.add_argument("--target", type=float, default=0.9, help="SLO share for capacity")
    p.add_argument("--bisect-iters", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=16384)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--timing", default="poly", help="poly | zero | table[:PATH]")
    p.add_argument("--kv-bytes-per-token", type=int, default=128 << 10)
    p.add_argument("--bandwidth", type=float, default=25e9, help="P→D bytes/s")
    p.add_argument("--event-delay-ms", type=float, default=0.0,
                   help="KV events reach the indexer this late (virtual ms)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dynamo", action="store_true",
                   help="also run dynamo.replay.run_trace_replay on the same trace")
    p.add_argument("--dynamo-modes", default="kv_router,round_robin")
    p.add_argument("--jobs", type=int, default=1, help="systems run in parallel")
    p.add_argument("--out", default=str(RESULTS / "offline"),
                   help="output path without extension (.json and .png are added)")
    p.add_argument("--timeline", type=float, default=None, metavar="SPEEDUP",
                   help="also run each kvmesh system once at this speed-up and write a "
                   "per-interval timeline (queues, KV use, preemptions per worker) to "
                   "<out>_timeline-<system>.json/.png")
    p.add_argument("--timeline-interval", type=float, default=5.0,
                   help="timeline sample interval (virtual s)")
    p.add_argument("--timeline-only", action="store_true",
                   help="with --timeline: skip the speed-up sweep")
    p.add_argument("--search-topology", type=int, default=None, metavar="N",
                   help="evaluate every split of N workers (N agg, 1P+(N-1)D, ..., "
                   "(N-1)P+1D; P/D with and without conditional disaggregation) per "
                   "policy and report the best capacity per split to <out>.json/.png")
    return p


def base_config(a: argparse.Namespace) -> SimConfig:
    """The shared config of every kvmesh system."""
    return SimConfig(
        trace_block_size=a.trace_block_size, slo_ttft_s=a.slo_ttft_ms / 1000.0,
        slo_itl_s=a.slo_itl_ms / 1000.0, block_size=a.block_size, num_blocks=a.num_blocks,
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        timing_spec=a.timing, kv_bytes_per_token=a.kv_bytes_per_token,
        transfer_bandwidth=a.bandwidth, workers=a.workers,
        prefill_workers=a.prefill_workers, decode_workers=a.decode_workers,
        disagg_order=a.disagg_order, conditional_disagg=not a.no_conditional_disagg,
        prefill_whole=a.prefill_whole,
        prefill_policy=a.prefill_policy, profiles_file=a.profiles,
        event_delay_s=a.event_delay_ms / 1000.0, seed=a.seed)


def systems_for(a: argparse.Namespace, dynamo_ok: bool) -> list[System]:
    """kvmesh systems (policy × admission) then Dynamo's."""
    base = base_config(a)
    out = []
    for policy in [x for x in a.policies.split(",") if x]:
        for adm in [x for x in a.admission.split(",") if x]:
            cfg = base.replace(policy=policy, admission=adm)
            cfg.validate()
            out.append(System(f"kvmesh {cfg.label()}", "kvmesh", cfg))
    if dynamo_ok:
        for mode in [x for x in a.dynamo_modes.split(",") if x]:
            topo = (f"{base.prefill_workers}P{base.decode_workers}D" if base.disaggregated
                    else f"{base.workers}agg")
            out.append(System(f"dynamo {mode}/{topo}", "dynamo", base, mode))
    return out


def timelines(a: argparse.Namespace) -> list[Path]:
    """``--timeline``: one timeline per kvmesh system; returns the JSON paths written."""
    from bench.offline.report import write_json as write
    from bench.offline.timeline import plot_timeline, run_timeline

    trace = load_trace(a.trace, a.limit)
    out = []
    for system in systems_for(a, False):
        cfg = system.cfg.replace(speedup=a.timeline)
        data = run_timeline(trace, cfg, a.timeline_interval)
        data["trace"], data["limit"] = a.trace, a.limit
        tag = re.sub(r"[^A-Za-z0-9_.+-]+", "_", cfg.label())
        js, png = Path(f"{a.out}_timeline-{tag}.json"), Path(f"{a.out}_timeline-{tag}.png")
        write(js, data)
        plot_timeline(png, data)
        print(f"wrote {js} and {png}", flush=True)
        out.append(js)
    return out


def _job(system: System, trace_path: str, limit: int | None, speedups: list[float],
         target: float, iters: int) -> dict[str, Any]:
    trace = load_trace(trace_path, limit) if system.kind == "kvmesh" else []
    return run_system(system, trace, trace_path, speedups, target, iters,
                      log=lambda m: print(m, flush=True))


def run_systems(a: argparse.Namespace, systems: Sequence[System]) -> list[dict[str, Any]]:
    """Each system's sweep and capacity (:func:`bench.offline.sweep.run_system`), in
    order, ``a.jobs`` at a time. Dynamo's replay reads its trace file whole, so with
    ``a.limit`` it gets the first ``a.limit`` lines in a temporary file (removed after)."""
    tmp = None
    if a.limit is not None and any(s.kind == "dynamo" for s in systems):
        tmp = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False)
        with open(a.trace, encoding="utf-8") as fh:
            for n, line in enumerate(fh):
                if n >= a.limit:
                    break
                tmp.write(line)
        tmp.close()
    args = [(s, tmp.name if (tmp and s.kind == "dynamo") else a.trace, a.limit,
             a.speedups, a.target, a.bisect_iters) for s in systems]
    try:
        if a.jobs > 1:
            with ProcessPoolExecutor(a.jobs) as pool:
                return list(pool.map(_job, *zip(*args, strict=True)))
        return [_job(*x) for x in args]
    finally:
        if tmp is not None:
            os.unlink(tmp.name)


def main(argv: Sequence[str] | None = None) -> int:
    """See the module docstring."""
    a = parser().parse_args(argv)
    try:
        base_config(a).validate()
        if a.timeline is not None and not (a.timeline > 0 and a.timeline_interval > 0):
            raise ValueError("--timeline and --timeline-interval must be > 0")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if a.search_topology is not None:
        from bench.offline.topology import main_search

        return main_search(a)
    if a.timeline is not None:
        timelines(a)
        if a.timeline_only:
            return 0
    dynamo_status: str | None = "not requested (--dynamo)"
    if a.dynamo:
        from bench.offline.dynamo import dynamo_status as check

        dynamo_status = check()
        if dynamo_status:
            print(f"Dynamo side by side skipped: {dynamo_status}", flush=True)
    try:
        systems = systems_for(a, a.dynamo and dynamo_status is None)
    except (ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    done = run_systems(a, systems)
    report = {
        "trace": a.trace, "limit": a.limit, "speedups": a.speedups, "target": a.target,
        "slo": {"ttft_ms": a.slo_ttft_ms, "itl_ms": a.slo_itl_ms},
        "config": vars(base_config(a)),
        "dynamo": {"requested": a.dynamo, "status": dynamo_status or "ok"},
        "wall_s": round(time.perf_counter() - t0, 1),
        "systems": done,
        "table": table(done),
    }
    out = Path(a.out)
    write_json(out.with_suffix(".json"), report)
    plot(out.with_suffix(".png"), done, a.target)
    print("\n".join(report["table"]))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0
