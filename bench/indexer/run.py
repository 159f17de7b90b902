"""KV indexer throughput and latency: kvmesh's KvIndex against Dynamo's RadixTree.

``python -m bench.indexer [--sizes 10000,100000] [--queries N] [--passes N] [--out DIR]``

Contracts:

- For every size (total stored blocks), one seeded workload (:mod:`bench.indexer.workload`:
  16 workers, Zipf-shared prefixes + unique suffixes, stores and evictions, then a query
  set) is generated once and fed to every available side (:mod:`bench.indexer.sides`) in
  the same run. Dynamo's side is skipped, with the reason in the JSON, when
  ``ai-dynamo-runtime`` does not import or with ``--no-dynamo``.
- Events: ``--event-reps`` times per side (sides interleaved), from an empty index: convert
  all events (timed), then apply them all (timed). ``events_per_s`` = events / apply time
  (median over reps); ``events_per_s_with_conversion`` adds the conversion time.
- Correctness: every query's answer on every side is compared with the brute-force
  reference (:func:`bench.indexer.workload.reference_matches`); ``mismatches`` counts the
  queries that differ. Exit code 0 iff every side has 0 mismatches.
- Queries: one untimed warm-up pass, then ``--passes`` timed passes per side over the whole
  query set, the sides taking turns every ``--chunk`` queries. Each call is timed alone with
  ``time.perf_counter_ns``; ``queries_per_s`` = calls / sum of call times; p50/p90/p99/mean
  in µs, overall and per query kind (hit / replay / miss). ``hash_us_mean`` is the mean
  tokens → query-input time per query of that side; ``queries_per_s_with_hashing`` adds it.
  The GC runs as usual (``--no-gc`` disables it while timing); it is collected before each
  timed section.
- The process is pinned to one CPU (``--cpu``, default the last one it may use; ``none``
  leaves it free). Dynamo's binding hands every call to a background thread; with the two
  threads on different vCPUs each call pays a cross-CPU wake-up (measured here: p50 ~80 µs
  instead of ~8-10 µs), so pinning gives Dynamo its best case. Ours is single-threaded.
  Per-pass stats are kept, and ``best_pass`` is each side's fastest pass.
- ``ratios`` are ours / dynamo per size (throughputs: > 1 means ours is faster; latencies:
  < 1 means ours is faster).
- Writes ``<out>/indexer.json`` and ``<out>/indexer.png`` (the PNG is skipped with a warning
  when matplotlib is missing).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.indexer.sides import Dynamo, Ours, Side, load_dynamo
from bench.indexer.workload import Workload, WorkloadConfig, generate, reference_matches

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SIZES = "10000,100000"


def percentiles_us(ns: Sequence[int]) -> dict[str, float]:
    """p50/p90/p99/mean/max in µs of per-call nanoseconds (nearest-rank percentiles)."""
    if not ns:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0, "max": 0.0, "n": 0}
    s = sorted(ns)
    n = len(s)

    def rank(p: float) -> float:
        return s[min(n - 1, max(0, math.ceil(p / 100 * n) - 1))] / 1e3

    return {"p50": rank(50), "p90": rank(90), "p99": rank(99),
            "mean": sum(s) / n / 1e3, "max": s[-1] / 1e3, "n": n}


def time_events(side: Side, wl: Workload) -> dict[str, float]:
    """One rep: reset, convert (timed), apply (timed)."""
    side.reset()
    gc.collect()
    t0 = time.perf_counter_ns()
    inputs = side.convert_events(wl.events)
    t1 = time.perf_counter_ns()
    gc.collect()
    t2 = time.perf_counter_ns()
    side.apply_all(inputs)
    t3 = time.perf_counter_ns()
    return {"convert_s": (t1 - t0) / 1e9, "apply_s": (t3 - t2) / 1e9}


def check(side: Side, wl: Workload, inputs: list[Any]) -> int:
    """Queries whose answer differs from the brute-force reference."""
    bad = 0
    for q, inp in zip(wl.queries, inputs, strict=True):
        if side.normalise(side.query(inp)) != reference_matches(wl.held, q.hashes):
            bad += 1
    return bad


def time_calls(side: Side, inputs: Sequence[Any]) -> list[int]:
    """Per-call ns of ``side.query`` over ``inputs``."""
    query = side.query
    clock = time.perf_counter_ns
    out = [0] * len(inputs)
    for i, inp in enumerate(inputs):
        t0 = clock()
        query(inp)
        out[i] = clock() - t0
    return out


def time_pass(sides: Sequence[Side], inputs: dict[str, list[Any]],
              chunk: int, flip: bool) -> dict[str, list[int]]:
    """One pass over the query set per side, the sides taking turns every ``chunk`` queries
    (who goes first alternates), so load bursts on the machine hit both alike. Per-call ns,
    in query order."""
    out: dict[str, list[int]] = {s.name: [] for s in sides}
    n = len(next(iter(inputs.values()))) if inputs else 0
    for k, start in enumerate(range(0, n, chunk)):
        order = list(sides) if (k % 2 == 0) != flip else list(reversed(sides))
        for s in order:
            out[s.name] += time_calls(s, inputs[s.name][start:start + chunk])
    return out


def time_hashing(side: Side, wl: Workload) -> float:
    """Mean µs per query of tokens → query input."""
    bs = wl.config.block_size
    clock = time.perf_counter_ns
    t0 = clock()
    for q in wl.queries:
        side.hash_prompt(q.tokens, bs)
    return (clock() - t0) / 1e3 / max(1, len(wl.queries))


def run_size(cfg: WorkloadConfig, sides: list[Side], event_reps: int, passes: int,
             no_gc: bool, chunk: int = 100) -> dict[str, Any]:
    """Every measurement of one workload size (see the module docstring)."""
    t0 = time.perf_counter()
    wl = generate(cfg)
    gen_s = time.perf_counter() - t0
    n_ev = len(wl.events)
    reps: dict[str, list[dict[str, float]]] = {s.name: [] for s in sides}
    for _ in range(event_reps):
        for s in sides:
            reps[s.name].append(time_events(s, wl))
    res: dict[str, Any] = {}
    inputs = {s.name: [s.query_input(q) for q in wl.queries] for s in sides}
    for s in sides:
        apply_s = statistics.median(r["apply_s"] for r in reps[s.name])
        conv_s = statistics.median(r["convert_s"] for r in reps[s.name])
        res[s.name] = {
            "timed": s.timed,
            "events_per_s": n_ev / apply_s,
            "events_per_s_with_conversion": n_ev / (apply_s + conv_s),
            "blocks_per_s": (wl.stored_blocks + wl.removed_blocks) / apply_s,
            "event_reps": reps[s.name],
            "mismatches": check(s, wl, inputs[s.name]),  # also the warm-up pass
        }
    samples: dict[str, list[int]] = {s.name: [] for s in sides}
    per_pass: dict[str, list[dict[str, float]]] = {s.name: [] for s in sides}
    if no_gc:
        gc.disable()
    try:
        for p in range(passes):
            gc.collect()
            for name, ns in time_pass(sides, inputs, chunk, p % 2 == 1).items():
                samples[name] += ns
                per_pass[name].append({**percentiles_us(ns),
                                       "queries_per_s": len(ns) / (sum(ns) / 1e9)})
    finally:
        gc.enable()
    kinds = sorted({q.kind for q in wl.queries})
    for s in sides:
        ns = samples[s.name]
        r = res[s.name]
        r["latency_us"] = percentiles_us(ns)
        r["queries_per_s"] = len(ns) / (sum(ns) / 1e9) if ns else 0.0
        r["passes"] = per_pass[s.name]
        best = max(per_pass[s.name], key=lambda p: p["queries_per_s"])
        r["best_pass"] = {"queries_per_s": best["queries_per_s"], "p50": best["p50"],
                          "p99": best["p99"]}
        r["latency_us_by_kind"] = {
            k: percentiles_us([t for i, t in enumerate(ns)
                               if wl.queries[i % len(wl.queries)].kind == k]) for k in kinds}
        r["hash_us_mean"] = time_hashing(s, wl)
        mean_us = r["latency_us"]["mean"]
        r["queries_per_s_with_hashing"] = 1e6 / (mean_us + r["hash_us_mean"]) if ns else 0.0
    ours = sides[0]
    assert isinstance(ours, Ours)
    matched = [len(reference_matches(wl.held, q.hashes)) for q in wl.queries]
    out: dict[str, Any] = {
        "total_blocks": cfg.total_blocks,
        "workload": {
            "events": n_ev, "stored_blocks": wl.stored_blocks,
            "removed_blocks": wl.removed_blocks,
            "queries": len(wl.queries),
            "query_kinds": {k: sum(q.kind == k for q in wl.queries) for k in kinds},
            "query_blocks_mean": statistics.fmean(len(q.hashes) for q in wl.queries)
            if wl.queries else 0.0,
            "workers_matched_mean": statistics.fmean(matched) if matched else 0.0,
            "index_stats": ours.index.stats(),
            "generate_s": gen_s,
        },
        "sides": res,
    }
    if "dynamo" in res:
        a, b = res["kvmesh"], res["dynamo"]
        out["ratios"] = {
            "events_per_s": a["events_per_s"] / b["events_per_s"],
            "events_per_s_with_conversion":
                a["events_per_s_with_conversion"] / b["events_per_s_with_conversion"],
            "queries_per_s": a["queries_per_s"] / b["queries_per_s"],
            "queries_per_s_with_hashing":
                a["queries_per_s_with_hashing"] / b["queries_per_s_with_hashing"],
            "p50_us": a["latency_us"]["p50"] / b["latency_us"]["p50"],
            "p99_us": a["latency_us"]["p99"] / b["latency_us"]["p99"],
            "best_pass_queries_per_s":
                a["best_pass"]["queries_per_s"] / b["best_pass"]["queries_per_s"],
            "best_pass_p50_us": a["best_pass"]["p50"] / b["best_pass"]["p50"],
            "best_pass_p99_us": a["best_pass"]["p99"] / b["best_pass"]["p99"],
        }
    return out


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("xxhash", "ai-dynamo-runtime", "matplotlib"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def pin_cpu(spec: str) -> int | None:
    """Pins this process to one CPU: ``"auto"`` (the last allowed), ``"none"``, or a number.
    Returns the CPU, or None when not pinned."""
    if spec == "none" or not hasattr(os, "sched_setaffinity"):
        return None
    cpu = max(os.sched_getaffinity(0)) if spec == "auto" else int(spec)
    os.sched_setaffinity(0, {cpu})
    return cpu


def run_benchmark(sizes: list[int], base: WorkloadConfig, event_reps: int, passes: int,
                  use_dynamo: bool, no_gc: bool, cpu: str = "none",
                  chunk: int = 100) -> dict[str, Any]:
    """The whole JSON-ready report."""
    t_start = time.perf_counter()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    pinned = pin_cpu(cpu)
    try:
        return _run(sizes, base, event_reps, passes, use_dynamo, no_gc, chunk, pinned,
                    t_start)
    finally:
        if pinned is not None and affinity is not None:
            os.sched_setaffinity(0, affinity)


def _run(sizes: list[int], base: WorkloadConfig, event_reps: int, passes: int,
         use_dynamo: bool, no_gc: bool, chunk: int, pinned: int | None,
         t_start: float) -> dict[str, Any]:
    load_before = os.getloadavg()
    sides: list[Side] = [Ours()]
    tree_cls, dyn = load_dynamo() if use_dynamo else (None, {"available": False,
                                                             "error": "disabled (--no-dynamo)"})
    if tree_cls is not None:
        sides.append(Dynamo(tree_cls))
    results = []
    for n in sizes:
        cfg = WorkloadConfig(**{**base.__dict__, "total_blocks": n})
        row = run_size(cfg, sides, event_reps, passes, no_gc, chunk)
        results.append(row)
        print(_row_line(row), file=sys.stderr, flush=True)
    return {
        "schema": "kvmesh.bench.indexer/1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                 "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "versions": _versions(),
        "dynamo": dyn,
        "config": {**{k: v for k, v in base.__dict__.items() if k != "total_blocks"},
                   "sizes": sizes, "event_reps": event_reps, "passes": passes, "chunk": chunk,
                   "gc_during_queries": not no_gc, "clock": "time.perf_counter_ns per call",
                   "pinned_cpu": pinned},
        "results": results,
        "all_correct": all(s["mismatches"] == 0 for r in results for s in r["sides"].values()),
        "wall_s": time.perf_counter() - t_start,
    }


def _row_line(r: dict[str, Any]) -> str:
    parts = [f"{r['total_blocks']:>7}"]
    for name, s in r["sides"].items():
        lat = s["latency_us"]
        parts.append(f"{name}: {s['events_per_s']:9.0f} ev/s {s['queries_per_s']:9.0f} q/s "
                     f"p50 {lat['p50']:6.1f} p99 {lat['p99']:6.1f} us bad {s['mismatches']}")
    return " | ".join(parts)


def table(report: dict[str, Any]) -> str:
    """Plain-text table: one line per size and side, then the ratios ours/dynamo."""
    lines = [f"{'blocks':>7} {'side':>7} {'events/s':>10} {'ev/s+conv':>10} {'queries/s':>10} "
             f"{'q/s+hash':>9} {'p50 us':>7} {'p99 us':>7} | {'best q/s':>9} {'p50':>6} "
             f"{'p99':>6} {'bad':>4}"]
    for r in report["results"]:
        for name, s in r["sides"].items():
            lat, bp = s["latency_us"], s["best_pass"]
            lines.append(f"{r['total_blocks']:>7} {name:>7} {s['events_per_s']:10.0f} "
                         f"{s['events_per_s_with_conversion']:10.0f} "
                         f"{s['queries_per_s']:10.0f} {s['queries_per_s_with_hashing']:9.0f} "
                         f"{lat['p50']:7.1f} {lat['p99']:7.1f} | {bp['queries_per_s']:9.0f} "
                         f"{bp['p50']:6.1f} {bp['p99']:6.1f} {s['mismatches']:>4}")
        if "ratios" in r:
            ra = r["ratios"]
            lines.append(f"{r['total_blocks']:>7} {'ours/dy':>7} {ra['events_per_s']:10.2f} "
                         f"{ra['events_per_s_with_conversion']:10.2f} "
                         f"{ra['queries_per_s']:10.2f} {ra['queries_per_s_with_hashing']:9.2f} "
                         f"{ra['p50_us']:7.2f} {ra['p99_us']:7.2f} | "
                         f"{ra['best_pass_queries_per_s']:9.2f} {ra['best_pass_p50_us']:6.2f} "
                         f"{ra['best_pass_p99_us']:6.2f}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> bool:
    """Write the PNG (2×2 bars per size and side); False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipping the PNG", file=sys.stderr)
        return False
    rows = report["results"]
    names = list(rows[0]["sides"]) if rows else []
    panels = (("events_per_s", "events applied / s (higher is better)", 1.0),
              ("queries_per_s", "FindMatches queries / s (higher is better)", 1.0),
              ("p50", "per-query latency p50, µs (lower is better)", None),
              ("p99", "per-query latency p99, µs (lower is better)", None))
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    width = 0.8 / max(1, len(names))
    x = list(range(len(rows)))
    for ax, (key, title, _) in zip(axes.flat, panels, strict=True):
        for j, name in enumerate(names):
            vals = [r["sides"][name]["latency_us"][key] if key in ("p50", "p99")
                    else r["sides"][name][key] for r in rows]
            bars = ax.bar([i + (j - (len(names) - 1) / 2) * width for i in x], vals, width,
                          label=name, color=f"C{j}")
            ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_xticks(x, [f"{r['total_blocks']:,} blocks" for r in rows])
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    dyn = report["dynamo"]
    dyn_s = (f"Dynamo RadixTree ({dyn.get('distribution')} {dyn.get('version')})"
             if dyn.get("available") else f"Dynamo unavailable: {dyn.get('error')}")
    host = report["host"]
    fig.suptitle(f"kvmesh KvIndex vs {dyn_s}\n{report['config']['workers']} workers, "
                 f"Zipf {report['config']['zipf']} shared prefixes; query times exclude prompt "
                 f"hashing (see JSON); {host['cpus']} CPUs, pinned to CPU "
                 f"{report['config']['pinned_cpu']}, load avg {host['loadavg_before'][0]:.1f} "
                 f"at start", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    d = WorkloadConfig()
    p = argparse.ArgumentParser(prog="python -m bench.indexer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help="comma list of total stored blocks (default %(default)s)")
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--prefixes", type=int, default=d.prefixes, help="shared prefix pool size")
    p.add_argument("--zipf", type=float, default=d.zipf, help="prefix popularity exponent")
    p.add_argument("--suffix-max", type=int, default=d.suffix_max,
                   help="unique suffix blocks, 1..N")
    p.add_argument("--evict", type=float, default=d.evict,
                   help="probability a request is followed by an eviction")
    p.add_argument("--queries", type=int, default=d.queries)
    p.add_argument("--passes", type=int, default=5, help="timed passes over the query set")
    p.add_argument("--chunk", type=int, default=100,
                   help="queries per turn when the sides take turns")
    p.add_argument("--event-reps", type=int, default=3, help="times events are replayed")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-dynamo", action="store_true", help="skip Dynamo's RadixTree")
    p.add_argument("--no-gc", action="store_true", help="disable the GC while timing queries")
    p.add_argument("--cpu", default="auto",
                   help="pin to this CPU: auto (the last allowed), none, or a number")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = p.parse_args(argv)
    try:
        args.size_list = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
        args.base = WorkloadConfig(workers=args.workers, block_size=args.block_size,
                                   prefixes=args.prefixes, zipf=args.zipf,
                                   suffix_max=args.suffix_max, evict=args.evict,
                                   queries=args.queries, seed=args.seed)
        args.base.validate()
        if not args.size_list or min(args.size_list) < 1:
            raise ValueError("--sizes needs positive integers")
        if args.cpu not in ("auto", "none") and not args.cpu.isdigit():
            raise ValueError("--cpu must be auto, none or a CPU number")
        if min(args.passes, args.event_reps, args.queries, args.chunk) < 1:
            raise ValueError("--passes, --event-reps, --queries and --chunk must be >= 1")
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    """Run, print the table, write JSON (+PNG); 0 iff every answer was correct."""
    args = parse_args(argv)
    report = run_benchmark(args.size_list, args.base, args.event_reps, args.passes,
                           not args.no_dynamo, args.no_gc, args.cpu, args.chunk)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    report["png"] = "indexer.png" if plot(report, out / "indexer.png") else None
    (out / "indexer.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"wrote {out / 'indexer.json'} in {report['wall_s']:.1f} s; answers "
          f"{'all correct' if report['all_correct'] else 'WRONG (see mismatches)'}")
    return 0 if report["all_correct"] else 1
