"""What the frontend and router add to a request, with an engine that costs nothing.

``python -m bench.router_overhead [--rates 25,50,100,200] [--duration-s 4] [--workers 4]
[--policy kv] [--out bench/results]``

Contracts:

- Starts, as child processes on free loopback ports (stopped by PID at the end): etcd,
  Redis, the indexer, a fleet of ``--workers`` mock workers with the ``zero`` timing model
  (every engine step takes no time; KV events still flow to the indexer), the router
  (``--policy``, remote indexer) and the frontend.
- Per rate, two open-loop Poisson request streams of ``--duration-s`` each, one after the
  other, from this process: the **anchor** calls a worker's gRPC ``Generate`` directly
  (round robin over the workers), the **mesh** path POSTs ``/v1/completions`` to the
  frontend (tokenized prompt, so no tokenizer time) which calls the router and then the
  worker. Both use 64-token prompts (a shared 32-token head, so the kv policy has work)
  and ``max_tokens`` 1. Latency is send → complete response at the client.
- Reports per rate p50/p99 of both, the added latency (mesh − anchor, at p50 and p99),
  achieved rates and errors; writes ``<out>/router_overhead.json`` and ``.png``. All
  processes share this machine's cores, so the numbers include contention with the
  client; both paths pay it equally.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np

from bench.mesh import BenchMesh
from protos import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.procs import free_port

RESULTS = Path(__file__).resolve().parents[1] / "results"


def prompt(i: int) -> list[int]:
    rng = random.Random(i)
    return [5 + (j % 50) for j in range(32)] + [rng.randrange(3, 700) for _ in range(32)]


async def _poisson(rate: float, duration_s: float, call: Any, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    lat: list[float] = []
    errors = 0
    tasks = []
    start = time.perf_counter()
    t, i = 0.0, 0
    while t < duration_s:
        delay = start + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)

        async def one(i: int = i) -> None:
            nonlocal errors
            t0 = time.perf_counter()
            try:
                await call(i)
                lat.append(time.perf_counter() - t0)
            except Exception:  # noqa: BLE001 - counted, reported
                errors += 1
        tasks.append(asyncio.create_task(one()))
        i += 1
        t += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    a = np.asarray(lat) if lat else np.asarray([np.nan])
    return {"sent": i, "ok": len(lat), "errors": errors, "achieved_rps": len(lat) / wall,
            "p50_ms": float(np.percentile(a, 50) * 1e3),
            "p99_ms": float(np.percentile(a, 99) * 1e3), "mean_ms": float(np.mean(a) * 1e3)}


async def measure(url: str, workers: list[str], model: str, rates: list[float],
                  duration_s: float) -> list[dict[str, Any]]:
    channels = [grpc.aio.insecure_channel(a) for a in workers]
    stubs = [worker_pb2_grpc.WorkerStub(c) for c in channels]
    out = []
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=None)) as http:
        async def direct(i: int) -> None:
            req = worker_pb2.GenerateRequest(
                request_id=f"d{i}-{time.monotonic_ns()}", token_ids=prompt(i), model=model,
                sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0))
            async for _ in stubs[i % len(stubs)].Generate(req, timeout=30):
                pass

        async def mesh(i: int) -> None:
            resp = await http.post(f"{url}/v1/completions", json={
                "model": model, "prompt": prompt(i), "max_tokens": 1, "temperature": 0})
            resp.raise_for_status()

        await _poisson(20, 1.0, mesh, 0)  # warm-up: connections, JIT-free paths
        await _poisson(20, 1.0, direct, 0)
        for rate in rates:
            anchor = await _poisson(rate, duration_s, direct, int(rate))
            through = await _poisson(rate, duration_s, mesh, int(rate) + 1)
            out.append({"rate_rps": rate, "anchor_direct_worker": anchor,
                        "frontend_router": through,
                        "added_p50_ms": through["p50_ms"] - anchor["p50_ms"],
                        "added_p99_ms": through["p99_ms"] - anchor["p99_ms"]})
            print(f"{rate:6.0f} req/s  direct p50 {anchor['p50_ms']:.2f} p99 {anchor['p99_ms']:.2f}"
                  f"  mesh p50 {through['p50_ms']:.2f} p99 {through['p99_ms']:.2f} ms"
                  f"  errors {anchor['errors']}/{through['errors']}", flush=True)
    for c in channels:
        await c.close()
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["rate_rps"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for key, style in (("p50_ms", "o-"), ("p99_ms", "s--")):
        ax[0].plot(rates, [r["anchor_direct_worker"][key] for r in rows], style,
                   label=f"direct worker {key[:3]}")
        ax[0].plot(rates, [r["frontend_router"][key] for r in rows], style,
                   label=f"frontend+router {key[:3]}")
        ax[1].plot(rates, [r[f"added_{key}"] for r in rows], style, label=f"added {key[:3]}")
    ax[0].set(xlabel="offered rate (req/s)", ylabel="latency (ms)", title="request latency")
    ax[1].set(xlabel="offered rate (req/s)", ylabel="ms", title="added by frontend + router")
    for a in ax:
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict[str, Any]:
    with BenchMesh("rovh") as mesh:
        mesh.py("indexer", "services.indexer")
        mesh.py("fleet", "workers.fleet", "--workers", str(args.workers), "--timing", "zero",
                "--model-path", "tiny", "--model-name", "tiny", "--max-model-len", "512")
        router_port = free_port()
        mesh.py("router", "services.router", "--policy", args.policy, "--indexer", args.indexer,
                "--port", str(router_port))
        url = mesh.frontend(args.workers, 120)

        async def workers() -> list[str]:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{router_port}") as ch:
                resp = await router_pb2_grpc.RouterStub(ch).ListWorkers(
                    router_pb2.ListWorkersRequest())
            return [w.address for w in resp.workers]
        addrs = asyncio.run(workers())
        rows = asyncio.run(measure(url, addrs, "tiny", [float(r) for r in args.rates.split(",")],
                                   args.duration_s))
        return {"benchmark": "router_overhead", "workers": args.workers, "policy": args.policy,
                "indexer": args.indexer,
                "engine": "mock (zero timing)", "duration_s": args.duration_s,
                "cpus": os.cpu_count(), "rows": rows}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.router_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="25,50,100,200")
    p.add_argument("--duration-s", type=float, default=4.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--policy", default="kv")
    p.add_argument("--indexer", default="remote", choices=("remote", "embedded", "none"))
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="router_overhead", help="output file stem")
    args = p.parse_args(argv)
    report = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    plot(report["rows"], out / f"{name}.png")
    print(f"-> {out}/{name}.json/.png")
    return 0


def entry() -> None:
    sys.exit(main())
