"""``kvmesh bench replay`` / ``python -m bench.replay``: replay a Mooncake trace through an
OpenAI-compatible endpoint with its original timing, and report latency, cache hits and
goodput.

Contract of :func:`replay_once`: sends every request at its scheduled time (trace
timestamps divided by ``speedup``), concurrently, with a progress bar, and returns the
results and the run's summary (:mod:`bench.replay.stats`). :func:`main` runs one replay
per ``--speedups`` value (the arrival-rate sweep), computes DistServe goodput over them,
and writes ``<out>.json`` (config, per-run summaries, per-request results) and
``<out>.png`` (TTFT and TPOT CDFs per run; SLO attainment vs request rate). Any
OpenAI-compatible server works (``--url``, ``--model``), so another system can be
measured with the same tool and trace.
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

import httpx
from tqdm import tqdm

from bench.replay.client import send
from bench.replay.stats import Result, goodput, summarize
from bench.replay.trace import PromptMaker, TraceRequest, load_trace, schedule

RESULTS = Path(__file__).resolve().parents[1] / "results"


async def replay_once(url: str, model: str, trace: list[TraceRequest], maker: PromptMaker,
                      speedup: float, slo_ttft_s: float, slo_tpot_s: float,
                      progress: bool = True, timeout_s: float = 600.0
                      ) -> tuple[list[Result], dict[str, Any]]:
    """One replay at one arrival speed-up (see the module docstring)."""
    times = schedule(trace, speedup)
    prompts = [maker.tokens(r) for r in trace]
    results = [Result(i, t) for i, t in enumerate(times)]
    bar = tqdm(total=len(trace), desc=f"replay x{speedup:g}", disable=not progress,
               unit="req")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()

        async def one(i: int) -> None:
            delay = start + times[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await send(client, url, model, prompts[i], maker.output_len(trace[i]), results[i])
            bar.update(1)

        await asyncio.gather(*(one(i) for i in range(len(trace))))
        duration = time.perf_counter() - start
    bar.close()
    span_s = times[-1] if times and times[-1] > 0 else duration
    rate = len(trace) / span_s if span_s > 0 else float(len(trace))
    summary = summarize(results, duration, rate, slo_ttft_s, slo_tpot_s)
    summary["speedup"] = speedup
    return results, summary


def plot(runs: list[dict[str, Any]], per_run: list[list[Result]], path: Path,
         title: str) -> None:
    """TTFT/TPOT CDFs per run, and SLO attainment vs rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for summary, results in zip(runs, per_run, strict=True):
        label = f"x{summary['speedup']:g} ({summary['rate_rps']:.2f} req/s)"
        for ax, key in ((axes[0], "ttft_s"), (axes[1], "tpot_s")):
            vals = np.sort([v for r in results if r.status == "ok"
                            and (v := getattr(r, key)) is not None])
            if len(vals):
                ax.plot(vals * 1000, np.arange(1, len(vals) + 1) / len(vals), label=label)
    axes[0].set(xlabel="TTFT (ms)", ylabel="CDF", title="TTFT")
    axes[1].set(xlabel="TPOT / mean ITL (ms)", ylabel="CDF", title="TPOT")
    rates = [r["rate_rps"] for r in runs]
    axes[2].plot(rates, [r["slo_attainment"] for r in runs], "o-")
    axes[2].axhline(0.9, color="grey", ls="--", lw=1)
    axes[2].set(xlabel="request rate (req/s)", ylabel="share meeting both SLOs",
                title="SLO attainment (goodput: highest rate ≥ 0.9)", ylim=(0, 1.05))
    for ax in axes[:2]:
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvmesh bench replay", description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="OpenAI-compatible base URL")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--speedups", default="1", help="comma-separated arrival speed-ups")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply trace timestamps (stretch >1, compress <1)")
    p.add_argument("--trace-block", type=int, default=512, help="tokens per trace hash id")
    p.add_argument("--token-scale", type=float, default=1.0,
                   help="scale input/output lengths and blocks (e.g. 0.0625 for small models)")
    p.add_argument("--max-input", type=int, default=None)
    p.add_argument("--max-output", type=int, default=None)
    p.add_argument("--vocab", type=int, default=700, help="token ids are drawn from [3, vocab)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--label", default="kvmesh", help="system name in the report")
    p.add_argument("--out", default=str(RESULTS / "replay"), help="output path without suffix")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    trace = load_trace(args.trace, args.limit)
    if args.time_scale != 1.0:
        trace = [TraceRequest(r.timestamp_ms * args.time_scale, r.input_length,
                              r.output_length, r.hash_ids) for r in trace]
    maker = PromptMaker(args.trace_block, args.token_scale, args.vocab, args.seed,
                        args.max_input, args.max_output)
    runs, per_run = [], []
    for s in (float(x) for x in args.speedups.split(",")):
        results, summary = await replay_once(args.url, args.model, trace, maker, s,
                                             args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000,
                                             progress=not args.no_progress)
        runs.append(summary)
        per_run.append(results)
    report = {
        "label": args.label, "url": args.url, "model": args.model, "trace": str(args.trace),
        "requests": len(trace), "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
        "prompt": {"trace_block": args.trace_block, "token_scale": args.token_scale,
                   "block_tokens": maker.block_tokens, "vocab": args.vocab},
        "runs": runs,
        "goodput_rps": goodput(runs),
        "slo_attainment_at_trace_rate": next(
            (r["slo_attainment"] for r in runs if r["speedup"] == 1.0), None),
        "results": [[r.as_dict() for r in res] for res in per_run],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    plot(runs, per_run, out.with_suffix(".png"), f"{args.label}: {Path(args.trace).name}, "
         f"{len(trace)} requests")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = asyncio.run(amain(args))
    except (OSError, ValueError) as exc:
        print(f"replay failed: {exc}", file=sys.stderr)
        return 2
    for r in report["runs"]:
        print(f"x{r['speedup']:g}: {r['rate_rps']:.2f} req/s  ok {r['ok']}/{r['requests']}  "
              f"TTFT p50 {_ms(r['ttft_s']['p50'])}  p99 {_ms(r['ttft_s']['p99'])}  "
              f"TPOT p50 {_ms(r['tpot_s']['p50'])}  hit {r['hit_ratio']:.2f}  "
              f"SLO {r['slo_attainment']:.2f}")
    print(f"goodput {report['goodput_rps']:.2f} req/s -> {args.out}.json/.png")
    return 0


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}ms"


def entry() -> None:
    sys.exit(main())
