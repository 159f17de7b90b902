"""What one request step costs this machine's Python after the process has done something
else for a while: the reason a lone request at 100 req/s costs the frontend several times
its step-by-step micro-benchmarks (issue 17's added-latency goal).

``python -m bench.mesh_profile.cold [--samples 300] [--prompt-tokens 64] [--out
bench/results] [--name mesh_cold]``

Contracts:

- The step: an embedded router's whole decision for one request, as the frontend makes
  it: ``RouterServicer.route_now`` of a ``--prompt-tokens`` prompt (a shared head, its
  own tail) over 2 workers with the ``kv`` policy and an embedded index, then
  ``release_now`` (the real code, in this process, nothing mocked).
- Per gap (:data:`GAPS_MS`) and way of spending it (:data:`WAYS`), ``--samples`` steps
  each timed alone (``perf_counter_ns``), every one after the gap:
  - ``sleep``: the process sleeps (``time.sleep``): the core may idle or run others;
  - ``spin``: the process spins on the clock (it keeps its core; nothing else of its
    own runs);
  - ``spin+other``: the process runs other Python meanwhile (building strings and
    lists), as a frontend serving other work would;
  - ``spin+step``: the process runs the same step every :data:`RERUN_MS` ms meanwhile
    (unmeasured): the step's code and data are kept in use.
- Reports per way and gap the median and p90 µs, and ``cold_over_warm``: each way's
  median at the longest gap ÷ the median without a gap. Writes ``<out>/<name>.json``
  and a PNG (median µs against the gap, a line per way). Timings drift with the
  machine; compare the ways within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from protos import discovery_pb2, router_pb2
from services.indexer.core import KvIndex
from services.router.core import RouterCore
from services.router.overlaps import EmbeddedSource
from services.router.policy_setup import default_registry
from services.router.service import RouterServicer

RESULTS = Path(__file__).resolve().parents[1] / "results"
GAPS_MS = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0)
WAYS = ("sleep", "spin", "spin+other", "spin+step")
RERUN_MS = 1.0
WARMUP = 500


def router_step(prompt_tokens: int, seed: int = 0) -> Callable[[], None]:
    """One routing decision and its release on an in-process embedded router (see the
    module docstring); each call routes the next of 64 prompts under a fresh id."""
    core = RouterCore(policy=default_registry().create("kv", random.Random(seed)),
                      clock=time.monotonic)
    servicer = RouterServicer(core, {}, EmbeddedSource(KvIndex()))
    servicer.set_records({f"w{i}": discovery_pb2.InstanceRecord(
        instance_id=f"w{i}", component="worker", address=f"127.0.0.1:{9000 + i}",
        model="m", role=discovery_pb2.WORKER_ROLE_AGG, block_size=16,
        max_model_len=max(4096, 2 * prompt_tokens)) for i in range(2)})
    rng = random.Random(seed)
    head = [rng.randrange(1, 30000) for _ in range(prompt_tokens // 2)]
    prompts = [head + [rng.randrange(1, 30000) for _ in range(prompt_tokens - len(head))]
               for _ in range(64)]
    count = [0]

    def step() -> None:
        i = count[0] = count[0] + 1
        rid = f"cold-{i}"
        resp = servicer.route_now(router_pb2.RouteRequest(
            request_id=rid, model="m", max_tokens=1), prompts[i % len(prompts)])
        if resp is None or not resp.worker.instance_id:
            raise RuntimeError("the router gave no worker")
        servicer.release_now(rid)
    return step


def _spend(way: str, gap_s: float, step: Callable[[], None]) -> None:
    """Spends ``gap_s`` the ``way`` (see the module docstring)."""
    if gap_s <= 0:
        return
    if way == "sleep":
        time.sleep(gap_s)
        return
    end = time.perf_counter() + gap_s
    rerun = time.perf_counter() + RERUN_MS / 1000
    while (now := time.perf_counter()) < end:
        if way == "spin+other":
            _ = [str(i) for i in range(32)]
        elif way == "spin+step" and now >= rerun:
            step()
            rerun = time.perf_counter() + RERUN_MS / 1000


def measure(step: Callable[[], None], samples: int, gaps_ms: tuple[float, ...] = GAPS_MS,
            ways: tuple[str, ...] = WAYS) -> dict[str, dict[str, dict[str, float]]]:
    """Per way, per gap (ms, as a string), the median and p90 µs of ``samples`` steps."""
    for _ in range(WARMUP):
        step()
    out: dict[str, dict[str, dict[str, float]]] = {w: {} for w in ways}
    for gap in gaps_ms:
        for way in ways:
            xs = []
            for _ in range(samples):
                _spend(way, gap / 1000, step)
                t = time.perf_counter_ns()
                step()
                xs.append((time.perf_counter_ns() - t) / 1000)
            xs.sort()
            out[way][f"{gap:g}"] = {"median_us": statistics.median(xs),
                                    "p90_us": xs[min(len(xs) - 1, int(len(xs) * 0.9))]}
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for way, rows in report["ways"].items():
        gaps = [float(g) for g in rows]
        ax.plot(gaps, [r["median_us"] for r in rows.values()], marker="o", label=way)
    ax.set_xlabel("time since the step last ran (ms)")
    ax.set_ylabel("step median (µs)")
    ax.set_title(f"route + release of a {report['prompt_tokens']}-token prompt, in-process")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.mesh_profile.cold",
                                description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--gaps-ms", default=",".join(f"{g:g}" for g in GAPS_MS))
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="mesh_cold")
    args = p.parse_args(argv)
    gaps = tuple(float(g) for g in args.gaps_ms.split(","))
    ways = measure(router_step(args.prompt_tokens), args.samples, gaps)
    last, first = f"{gaps[-1]:g}", f"{gaps[0]:g}"
    report = {
        "benchmark": "mesh_cold", "step": "RouterServicer.route_now + release_now",
        "prompt_tokens": args.prompt_tokens, "samples": args.samples,
        "rerun_ms": RERUN_MS, "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
        "ways": ways,
        "cold_over_warm": {w: rows[last]["median_us"] / rows[first]["median_us"]
                           for w, rows in ways.items()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    plot(report, out / f"{args.name}.png")
    for way, rows in ways.items():
        print(f"{way:>11}: " + "  ".join(f"{g} ms {r['median_us']:.0f}"
                                         for g, r in rows.items()) + " µs")
    print(f"-> {out}/{args.name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
