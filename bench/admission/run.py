"""``python -m bench.admission``: goodput under overload with admission control off, by
current load, and by Mooncake early rejection, on a live mesh of mock workers.

What it does:

- Per admission policy, a fresh :class:`bench.mesh.BenchMesh` (etcd, Redis, children on
  free loopback ports, stopped by PID): one mock fleet (``python -m workers.fleet``:
  ``--prefill-workers`` P + ``--decode-workers`` D, Dynamo mocker timing divided by
  ``--engine-speedup``, ``--num-blocks`` × ``--block-size`` KV tokens each), a router
  (``--admission POLICY`` with the same SLOs, the mocker perf model at the same speed-up,
  conditional disaggregation off) and a frontend.
- Replays the first ``--limit`` requests of a Mooncake trace (default: the shared
  conversation trace, lengths scaled by ``--token-scale`` and capped) with
  :func:`bench.replay.run.replay_once` at each arrival speed-up; rejected requests (503)
  count as SLO misses. Goodput is DistServe's: the highest rate whose SLO attainment
  (TTFT ≤ ``--slo-ttft-ms`` and TPOT ≤ ``--slo-tpot-ms``) is ≥ 0.9; since that is coarse
  with a few speed-ups, the report also gives the rate of requests served within SLO
  (``slo_met_rps``) per run.
- Writes ``<out>.json`` (config, per policy and speed-up summaries, goodput) and
  ``<out>.png`` (attainment, served-within-SLO rate and rejected share vs request rate).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.mesh import BenchMesh, warm_up
from bench.replay.run import replay_once
from bench.replay.stats import goodput
from bench.replay.trace import PromptMaker, TraceRequest, load_trace

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
NS = "admbench"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.admission",
                                description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--limit", type=int, default=120)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--token-scale", type=float, default=0.125)
    p.add_argument("--max-input", type=int, default=2048)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--speedups", default="1,2,4")
    p.add_argument("--policies", default="none,current_load,early")
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--engine-speedup", type=float, default=2.0)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=10.0)
    p.add_argument("--decode-correction", type=float, default=1.1,
                   help="admission: actual / model ITL (margin for the stack's overhead)")
    p.add_argument("--out", default=str(RESULTS / "admission"))
    return p.parse_args(argv)


def start_policy(mesh: BenchMesh, args: argparse.Namespace, policy: str) -> str:
    """The mock fleet, a router with ``--admission policy`` and a frontend in ``mesh``; the
    frontend's URL once it serves and is warmed up."""
    from workers.model.tiny import ensure_tiny_model

    a = args
    mesh.py("fleet", "workers.fleet", "--workers", "0",
            "--prefill-workers", str(a.prefill_workers),
            "--decode-workers", str(a.decode_workers),
            "--block-size", str(a.block_size), "--num-blocks", str(a.num_blocks),
            "--max-num-seqs", "512", "--max-model-len", "8192", "--timing", "poly",
            "--speedup-ratio", str(a.engine_speedup), "--worker-id", "ab-",
            "--model-path", str(ensure_tiny_model()), "--model-name", "mock")
    mesh.py("router", "services.router", "--policy", "least_loaded",
            "--load-poll-s", "0.2", "--conditional-disagg", "false",
            "--admission", policy,
            "--admission-ttft-slo-ms", str(a.slo_ttft_ms),
            "--admission-itl-slo-ms", str(a.slo_tpot_ms),
            "--admission-perf-speedup", str(a.engine_speedup),
            "--admission-decode-correction", str(a.decode_correction))
    url = mesh.frontend(a.prefill_workers + a.decode_workers)
    time.sleep(1.0)  # the router's watch and first load reports
    warm_up(url, "mock")
    return url


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    trace = load_trace(args.trace, args.limit)
    if args.time_scale != 1.0:
        trace = [TraceRequest(r.timestamp_ms * args.time_scale, r.input_length,
                              r.output_length, r.hash_ids) for r in trace]
    maker = PromptMaker(512, args.token_scale, 700, 0, args.max_input, args.max_output)
    speedups = [float(x) for x in args.speedups.split(",")]
    slo_ttft, slo_tpot = args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000
    policies: dict[str, Any] = {}
    for policy in [x for x in args.policies.split(",") if x]:
        with BenchMesh(NS) as mesh:  # a fresh fleet per policy: no cache carried over
            url = await asyncio.to_thread(start_policy, mesh, args, policy)
            runs = []
            for s in speedups:
                _, summary = await replay_once(url, "mock", trace, maker, s, slo_ttft,
                                               slo_tpot, progress=False)
                met = summary["slo_attainment"] * summary["requests"]
                summary["slo_met_rps"] = (met / summary["duration_s"]
                                          if summary["duration_s"] > 0 else 0.0)
                summary["rejected_share"] = summary["rejected"] / max(summary["requests"], 1)
                runs.append(summary)
                print(f"{policy:>12} x{s:g}: {summary['rate_rps']:.2f} req/s  "
                      f"ok {summary['ok']} rejected {summary['rejected']} "
                      f"errors {summary['errors']}  SLO {summary['slo_attainment']:.3f}  "
                      f"met {summary['slo_met_rps']:.2f} req/s", flush=True)
                await asyncio.sleep(2.0)  # drain
            policies[policy] = {"runs": runs, "goodput_rps": goodput(runs)}
    report = {
        "trace": str(args.trace), "requests": len(trace),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "prompt": {"block_tokens": maker.block_tokens,
                   "mean_input": sum(maker.input_len(r) for r in trace) / len(trace),
                   "mean_output": sum(maker.output_len(r) for r in trace) / len(trace)},
        "policies": policies,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"))
    return report


def plot(report: dict[str, Any], path: Path) -> None:
    """SLO attainment, rate served within SLO and rejected share vs request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, data in report["policies"].items():
        rates = [r["rate_rps"] for r in data["runs"]]
        label = f"{name} (goodput {data['goodput_rps']:.1f} req/s)"
        axes[0].plot(rates, [r["slo_attainment"] for r in data["runs"]], "o-", label=label)
        axes[1].plot(rates, [r["slo_met_rps"] for r in data["runs"]], "o-", label=name)
        axes[2].plot(rates, [r["rejected_share"] for r in data["runs"]], "o-", label=name)
    axes[0].axhline(0.9, color="grey", ls="--", lw=1)
    axes[0].set(xlabel="request rate (req/s)", ylabel="share meeting TTFT and TPOT SLOs",
                title="SLO attainment", ylim=(0, 1.05))
    axes[1].set(xlabel="request rate (req/s)", ylabel="req/s",
                title="requests served within SLO per second")
    axes[2].set(xlabel="request rate (req/s)", ylabel="share", title="rejected (503)",
                ylim=(0, 1.05))
    for ax in axes:
        ax.legend(fontsize=8)
    c = report["config"]
    fig.suptitle(f"admission control: {c['prefill_workers']}P+{c['decode_workers']}D mock "
                 f"(mocker timing /{c['engine_speedup']:g}), {report['requests']} requests, "
                 f"SLO TTFT {c['slo_ttft_ms']:g} ms, TPOT {c['slo_tpot_ms']:g} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = asyncio.run(amain(args))
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"admission bench failed: {exc}", file=sys.stderr)
        return 2
    for name, data in report["policies"].items():
        print(f"{name:>12}: goodput {data['goodput_rps']:.2f} req/s")
    print(f"-> {args.out}.json/.png")
    return 0


def entry() -> None:
    sys.exit(main())
