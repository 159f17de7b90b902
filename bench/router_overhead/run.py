"""What the frontend and router add to a request, with an engine that costs nothing; and
what mTLS adds, per RPC.

``python -m bench.router_overhead [--rates 25,50,100,200] [--duration-s 4] [--workers 4]
[--policy kv] [--router standalone|embedded] [--tls both] [--rpc-rounds 6]
[--rpc-calls 200] [--out bench/results]``

Contracts:

- Per mode of ``--tls`` (``off``: plaintext; ``on``: mTLS; ``both``, the default: two
  meshes side by side) it starts, as child processes on free loopback ports (stopped by
  PID at the end): etcd, Redis, the indexer, a fleet of ``--workers`` mock workers with the
  ``zero`` timing model (every engine step takes no time; KV events still flow to the
  indexer), the router (``--policy``, remote indexer) and the frontend; with ``--router
  embedded`` no indexer and no router process: the frontend routes in-process with the
  index embedded (``--router embedded --router-args '--policy P --indexer embedded'``,
  Dynamo's deployment), and the router's RPCs are measured on the gRPC server the embedded
  router registers in etcd. The mTLS mesh is
  exactly what ``--tls-dir`` turns on (:mod:`bench.tls_cost`): certificates from
  ``write_mesh_certs`` in the mesh's temporary folder, every server requiring client
  certificates with the role authorization interceptor, every client presenting its
  role's; this process calls as the frontend. etcd and Redis stay plaintext in both.
  Every gRPC call of this process goes through :func:`services.common.grpc_client.channel`
  (the frontend's helper) on long-lived channels.
- Per rate, three open-loop Poisson request streams of ``--duration-s`` each, one after
  the other, from this process: the **anchor** calls a worker's gRPC ``Generate``
  directly (round robin over the workers), the **mesh** path POSTs ``/v1/completions``
  to the frontend (tokenized prompt, so no tokenizer time) which calls the router and
  then the worker, and the **mesh over gRPC** path calls the frontend's gRPC API
  (``Frontend.Generate``, the same client stack as the anchor; a 64-word text prompt,
  tokenized by the frontend). All use 64-token prompts (a shared 32-token head, so the
  kv policy has work) and ``max_tokens`` 1. Latency is send → complete response at the
  client. With both modes, each rate runs in both meshes, in alternating order (ABBA).
- Per rate and mode also the **lean pair** (:mod:`bench.router_overhead.lean`): the
  anchor over the worker's TCP request plane (the frontend's own carrier to a worker)
  and the mesh's POST, each from a minimal client of a few µs (httpx and grpc.aio cost
  this client hundreds of µs per request, and not the same: the pair above holds their
  difference), both at once, their arrivals interleaved at random (two Poisson streams
  of the rate each, so that the machine's drift, which moves these numbers by tens of
  % within seconds, is the same for both; the workers see twice the rate).
  ``added_lean_p50_ms`` / ``added_lean_p99_ms``: lean mesh − lean anchor, what the
  frontend and router themselves add (their work and one more hop).
- Per rate also a third stream, once for all modes: the **HTTP floor**, the same POSTs
  to a bare uvicorn + FastAPI endpoint that parses the body and answers a fixed
  completion (``python -m bench.mesh_profile.floors --serve http``, a child process on
  a free loopback port): what one HTTP hop of this stack costs this client with no work
  behind it. The mesh path is that hop plus a worker hop (the anchor's) plus the
  frontend's work, so ``added − floor`` is roughly what the frontend itself adds.
- Reports per rate p50/p99 of the four, the added latency (mesh − anchor, at p50 and
  p99; ``added_grpc_p50_ms`` / ``added_grpc_p99_ms``: mesh over gRPC − anchor),
  ``http_floor`` and ``added_beyond_http_floor_p50_ms`` (added p50 − floor p50),
  achieved rates and errors: ``rows`` (the plaintext mesh; with ``--tls on`` the mTLS
  one), with both modes also ``rows_tls`` and ``rate_ratio`` (TLS / plaintext p50 per rate).
- ``rpc`` (``--rpc-rounds`` > 0): per-RPC latency, one call in flight, the modes
  alternating call by call: Router.Route + Router.Release in pairs, Worker.Generate
  (max_tokens 1), the whole HTTP completion, Router.ListWorkers; and ``connect``: a fresh
  channel to the router until READY (the TCP + TLS handshake a long-lived channel pays
  once). Then each RPC alone per mode for its CPU µs per call (this process, and the
  mode's mesh processes: :func:`bench.tls_cost.cpu_block`). Per RPC and mode
  p50/p99/mean µs, the ratio, the cost of TLS in µs (wall p50 and CPU) and, for the
  data path (:data:`DATA_PATH`: what the frontend calls per request, and the request
  itself), whether it is within 10 %: reported, never asserted.
- ``--paced N`` (default 0: none): after the sweep, per mode, the lean pair one request
  at a time, N rounds of both in a random order, each request 10 ms after the answer
  before it (what a lone request costs, with no queueing): ``paced[mode]`` holds each
  side's p50/p99, ``added_lean_p50_ms`` / ``added_lean_p99_ms`` and
  ``paired_diff_p50_ms`` (the median over rounds of mesh − anchor).
- Writes ``<out>/router_overhead.json`` and ``.png``. All processes share this machine's
  cores, so the numbers include contention with the client; both paths pay it equally.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.mesh import BenchMesh, embedded_router_args
from bench.router_overhead.lean import LeanHttp, PlaneClient
from bench.tls_cost import (
    TLS_FLAG,
    cpu_block,
    interleaved,
    modes_of,
    plot_rpc,
    print_rows,
    round_order,
    summarize,
    verdict,
)
from protos import (
    common_pb2,
    frontend_pb2,
    frontend_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.discovery import read_instance_records
from services.common.grpc_client import channel
from services.common.procs import free_port, port_open, spawn, wait_until
from services.common.tls import MeshTls, write_mesh_certs

RESULTS = Path(__file__).resolve().parents[1] / "results"
MODEL = "tiny"
PACED_GAP_S = 0.010


def prompt(i: int) -> list[int]:
    rng = random.Random(i)
    return [5 + (j % 50) for j in range(32)] + [rng.randrange(3, 700) for _ in range(32)]


# a call timed by itself: round index → (seconds, client CPU seconds or None)
Timed = Callable[[int], Awaitable[tuple[float, float | None]]]
# per round: (round, seconds, CPU seconds), or None where the call failed
Rounds = list[tuple[int, float, float | None] | None]


async def paced_rounds(calls: dict[str, Timed], n: int, gap_s: float, seed: int
                       ) -> dict[str, Rounds]:
    """One request at a time: ``n`` rounds of every one of ``calls`` once, in a random
    order per round (seeded), each ``gap_s`` after the answer before it (a process that
    waits that long between requests, as at 100 req/s without overlap). Per call, per
    round what it returned, or None where it raised (counted, not raised)."""
    rng = random.Random(seed)
    out: dict[str, Rounds] = {k: [] for k in calls}
    names = list(calls)
    for i in range(n):
        for name in rng.sample(names, len(names)):
            await asyncio.sleep(gap_s)
            try:
                took, cpu = await calls[name](i)
            except Exception:  # noqa: BLE001 - counted, reported
                out[name].append(None)
                continue
            out[name].append((i, took, cpu))
    return out


def timed(call: Callable[[int], Awaitable[Any]]) -> Timed:
    """``call`` timed from here (send → its return), no CPU figure."""
    async def run(i: int) -> tuple[float, float | None]:
        t0 = time.perf_counter()
        await call(i)
        return time.perf_counter() - t0, None
    return run


async def _paced(calls: Sequence[Any], rounds: int, gap_s: float, seed: int
                 ) -> list[dict[str, Any]]:
    """:func:`paced_rounds` of ``calls`` (each timed from here), summarised: per call
    :func:`_stats`, and ``paired_diff_p50_ms`` (the median, over the rounds where every
    call answered, of the last call's latency − the first's: mesh − anchor)."""
    start = time.perf_counter()
    got = await paced_rounds({str(k): timed(c) for k, c in enumerate(calls)}, rounds,
                             gap_s, seed)
    wall = time.perf_counter() - start
    per = [got[str(k)] for k in range(len(calls))]
    diffs = []
    for in_round in zip(*per, strict=True):  # each call's entry of one round
        took = [r[1] for r in in_round if r is not None]
        if len(took) == len(in_round):
            diffs.append(took[-1] - took[0])
    out = [_stats([r[1] for r in rows if r is not None], sum(r is None for r in rows),
                  rounds, wall) for rows in per]
    for row in out:
        row["paired_diff_p50_ms"] = float(np.median(diffs) * 1e3) if diffs else float("nan")
    return out


def _stats(lat: list[float], errors: int, sent: int, wall: float) -> dict[str, Any]:
    a = np.asarray(lat) if lat else np.asarray([np.nan])
    return {"sent": sent, "ok": len(lat), "errors": errors, "achieved_rps": len(lat) / wall,
            "p50_ms": float(np.percentile(a, 50) * 1e3),
            "p99_ms": float(np.percentile(a, 99) * 1e3), "mean_ms": float(np.mean(a) * 1e3)}


async def _poisson_mixed(rate: float, duration_s: float, calls: Sequence[Any],
                         seed: int) -> list[dict[str, Any]]:
    """Each of ``calls`` as an open-loop Poisson stream of ``rate`` req/s, all at once for
    ``duration_s``: one Poisson process of ``rate x len(calls)`` whose arrivals are given
    to a call drawn at random (so each is Poisson at ``rate``, and the machine's drift
    within the run is the same for all of them). Per call: sent, ok, errors, achieved
    req/s, p50/p99/mean latency (ms)."""
    rng = random.Random(seed)
    lat: list[list[float]] = [[] for _ in calls]
    errors = [0] * len(calls)
    sent = [0] * len(calls)
    tasks = []
    start = time.perf_counter()
    t, i = 0.0, 0
    while t < duration_s:
        delay = start + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        k = rng.randrange(len(calls))
        sent[k] += 1

        async def one(i: int = i, k: int = k) -> None:
            t0 = time.perf_counter()
            try:
                await calls[k](i)
                lat[k].append(time.perf_counter() - t0)
            except Exception:  # noqa: BLE001 - counted, reported
                errors[k] += 1
        tasks.append(asyncio.create_task(one()))
        i += 1
        t += rng.expovariate(rate * len(calls))
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    return [_stats(lat[k], errors[k], sent[k], wall) for k in range(len(calls))]


async def _poisson(rate: float, duration_s: float, call: Any, seed: int) -> dict[str, Any]:
    """``call`` alone as an open-loop Poisson stream (see :func:`_poisson_mixed`)."""
    (one,) = await _poisson_mixed(rate, duration_s, [call], seed)
    return one


def prompt_text(i: int) -> str:
    """:func:`prompt`'s ids as words (the gRPC stream's text prompt: tokenized there)."""
    return " ".join(f"w{t}" for t in prompt(i))


def _stubs(workers: list[str], tls: MeshTls | None) -> tuple[list[Any], list[Any]]:
    """Long-lived channels to the workers (the frontend's channel helper) and their stubs."""
    channels = [channel(a, tls, "worker") for a in workers]
    return channels, [worker_pb2_grpc.WorkerStub(c) for c in channels]


async def measure(targets: dict[str, Target], rates: list[float], duration_s: float,
                  floor_url: str, paced: int = 0
                  ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, dict[str, Any]]]:
    """The rate sweep of every mode in ``targets``; per rate the HTTP floor (``floor_url``,
    see the module docstring), then the modes, alternating (ABBA). With ``paced`` > 0,
    after the sweep, per mode the lean pair one request at a time (:func:`_paced`,
    ``paced`` rounds, :data:`PACED_GAP_S` apart): the second mapping (empty without)."""
    out: dict[str, list[dict[str, Any]]] = {m: [] for m in targets}
    out_paced: dict[str, dict[str, Any]] = {}
    lean_https: list[LeanHttp] = []
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=None)) as http:
        async def floor(i: int) -> None:
            resp = await http.post(f"{floor_url}/v1/completions", json={
                "model": MODEL, "prompt": prompt(i), "max_tokens": 1, "temperature": 0})
            resp.raise_for_status()

        await _poisson(20, 1.0, floor, 0)
        calls: dict[str, tuple[Any, ...]] = {}
        closers: list[Any] = []
        for mode, tg in targets.items():
            channels, stubs = _stubs(tg.workers, tg.tls)
            front_ch = channel(tg.grpc, tg.tls, "frontend")
            closers += [*channels, front_ch]
            front = frontend_pb2_grpc.FrontendStub(front_ch)

            async def direct(i: int, stubs: list[Any] = stubs) -> None:
                req = worker_pb2.GenerateRequest(
                    request_id=f"d{i}-{time.monotonic_ns()}", token_ids=prompt(i),
                    model=MODEL, sampling=common_pb2.SamplingParams(max_tokens=1,
                                                                    temperature=0.0))
                async for _ in stubs[i % len(stubs)].Generate(req, timeout=30):
                    pass

            async def mesh(i: int, url: str = tg.url) -> None:
                resp = await http.post(f"{url}/v1/completions", json={
                    "model": MODEL, "prompt": prompt(i), "max_tokens": 1, "temperature": 0})
                resp.raise_for_status()
            async def mesh_grpc(i: int, front: Any = front) -> None:
                req = frontend_pb2.CompletionRequest(
                    model=MODEL, prompt=prompt_text(i),
                    sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0))
                async for _ in front.Generate(req, timeout=30):
                    pass
            planes = [PlaneClient(a, tg.tls) for a in tg.planes]
            for plane in planes:
                await plane.connect()
            host, _, port = tg.url.removeprefix("http://").rpartition(":")
            lean_http = LeanHttp(host, int(port))
            closers += planes
            lean_https.append(lean_http)

            async def direct_plane(i: int, planes: list[PlaneClient] = planes) -> None:
                await planes[i % len(planes)].generate(worker_pb2.GenerateRequest(
                    request_id=f"p{i}-{time.monotonic_ns()}", token_ids=prompt(i),
                    model=MODEL, sampling=common_pb2.SamplingParams(max_tokens=1,
                                                                    temperature=0.0)))

            async def mesh_lean(i: int, http: LeanHttp = lean_http) -> None:
                await http.post("/v1/completions", {
                    "model": MODEL, "prompt": prompt(i), "max_tokens": 1, "temperature": 0})
            calls[mode] = (direct, mesh, mesh_grpc, direct_plane, mesh_lean)
            for warm in calls[mode]:  # warm-up: connections, JIT-free paths
                await _poisson(20, 1.0, warm, 0)
        for k, rate in enumerate(rates):
            bare = await _poisson(rate, duration_s, floor, int(rate) + 2)
            for mode in round_order(list(targets), k):
                direct, mesh, mesh_grpc, direct_plane, mesh_lean = calls[mode]
                anchor = await _poisson(rate, duration_s, direct, int(rate))
                through = await _poisson(rate, duration_s, mesh, int(rate) + 1)
                over_grpc = await _poisson(rate, duration_s, mesh_grpc, int(rate) + 3)
                plane_anchor, lean = await _poisson_mixed(
                    rate, duration_s, [direct_plane, mesh_lean], int(rate) + 4)
                added = through["p50_ms"] - anchor["p50_ms"]
                out[mode].append({"rate_rps": rate, "anchor_direct_worker": anchor,
                                  "frontend_router": through, "frontend_grpc": over_grpc,
                                  "anchor_plane_lean": plane_anchor, "frontend_lean": lean,
                                  "added_lean_p50_ms": lean["p50_ms"] - plane_anchor["p50_ms"],
                                  "added_lean_p99_ms": lean["p99_ms"] - plane_anchor["p99_ms"],
                                  "http_floor": bare, "added_p50_ms": added,
                                  "added_p99_ms": through["p99_ms"] - anchor["p99_ms"],
                                  "added_grpc_p50_ms": over_grpc["p50_ms"] - anchor["p50_ms"],
                                  "added_grpc_p99_ms": over_grpc["p99_ms"] - anchor["p99_ms"],
                                  "added_beyond_http_floor_p50_ms": added - bare["p50_ms"]})
                print(f"{mode:>8} {rate:6.0f} req/s  direct p50 {anchor['p50_ms']:.2f} p99 "
                      f"{anchor['p99_ms']:.2f}  mesh p50 {through['p50_ms']:.2f} p99 "
                      f"{through['p99_ms']:.2f}  mesh over gRPC p50 {over_grpc['p50_ms']:.2f} "
                      f"p99 {over_grpc['p99_ms']:.2f}  bare HTTP hop p50 {bare['p50_ms']:.2f} "
                      f"ms  lean: direct p50 {plane_anchor['p50_ms']:.2f} p99 "
                      f"{plane_anchor['p99_ms']:.2f} mesh p50 {lean['p50_ms']:.2f} p99 "
                      f"{lean['p99_ms']:.2f}  errors {anchor['errors']}/{through['errors']}/"
                      f"{over_grpc['errors']}/{plane_anchor['errors']}/{lean['errors']}/"
                      f"{bare['errors']}", flush=True)
        if paced > 0:
            for mode in targets:
                _, _, _, direct_plane, mesh_lean = calls[mode]
                anchor_row, mesh_row = await _paced([direct_plane, mesh_lean], paced,
                                                    PACED_GAP_S, seed=11)
                out_paced[mode] = {
                    "rounds": paced, "gap_ms": PACED_GAP_S * 1e3,
                    "anchor_plane_lean": anchor_row, "frontend_lean": mesh_row,
                    "added_lean_p50_ms": mesh_row["p50_ms"] - anchor_row["p50_ms"],
                    "added_lean_p99_ms": mesh_row["p99_ms"] - anchor_row["p99_ms"],
                    "paired_diff_p50_ms": mesh_row["paired_diff_p50_ms"]}
                print(f"{mode:>8} paced, {paced} rounds {PACED_GAP_S * 1e3:.0f} ms apart: "
                      f"direct p50 {anchor_row['p50_ms']:.2f} mesh p50 "
                      f"{mesh_row['p50_ms']:.2f} (paired +{mesh_row['paired_diff_p50_ms']:.2f}"
                      f" ms)  errors {anchor_row['errors']}/{mesh_row['errors']}", flush=True)
    for c in closers:
        await c.close()
    for h in lean_https:
        h.close()
    return out, out_paced


DATA_PATH = ("Router.Route", "Router.Release", "Worker.Generate (max_tokens 1)",
             "HTTP completion (frontend+router+worker)")
CONNECT = "connect: channel to READY (router)"


def _rpc_calls(tg: Target, router: Any, workers: list[Any], http: httpx.AsyncClient,
               tag: str, opened: list[Any]) -> dict[str, Any]:
    """One mode's calls for :func:`measure_rpcs`: name → ``async call(i)``. The connect
    call leaves its READY channel in ``opened`` (closed by the caller, untimed)."""
    async def route(i: int) -> None:
        await router.Route(router_pb2.RouteRequest(
            request_id=f"{tag}-{i}", model=MODEL, token_ids=prompt(i), max_tokens=1),
            timeout=10)

    async def release(i: int) -> None:
        await router.Release(router_pb2.ReleaseRequest(request_id=f"{tag}-{i}"), timeout=10)

    async def generate(i: int) -> None:
        req = worker_pb2.GenerateRequest(
            request_id=f"{tag}-g{i}", token_ids=prompt(i), model=MODEL,
            sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0))
        async for _ in workers[i % len(workers)].Generate(req, timeout=10):
            pass

    async def complete(i: int) -> None:
        resp = await http.post(f"{tg.url}/v1/completions", json={
            "model": MODEL, "prompt": prompt(i), "max_tokens": 1, "temperature": 0})
        resp.raise_for_status()

    async def list_workers(_: int) -> None:
        await router.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10)

    async def connect(_: int) -> None:
        ch = channel(tg.router, tg.tls, "router")
        opened.append(ch)
        await asyncio.wait_for(ch.channel_ready(), 10)
    return {"Router.Route": route, "Router.Release": release, DATA_PATH[2]: generate,
            DATA_PATH[3]: complete, "Router.ListWorkers": list_workers, CONNECT: connect}


async def measure_rpcs(targets: dict[str, Target], rounds: int,
                       calls: int) -> dict[str, Any]:
    """Per-RPC latency (one call in flight, long-lived channels, the modes alternating
    call by call) and connect cost; see the module docstring."""
    counts = {"Router.Route": calls, DATA_PATH[2]: calls, DATA_PATH[3]: calls // 2,
              "Router.ListWorkers": calls // 2, CONNECT: 5}
    samples: dict[str, dict[str, list[float]]] = {
        n: {m: [] for m in targets} for n in [*DATA_PATH, "Router.ListWorkers", CONNECT]}
    async with httpx.AsyncClient(timeout=30) as http:
        setup: dict[str, tuple[Any, ...]] = {}
        opened: list[Any] = []
        for mode, tg in targets.items():
            router_ch = channel(tg.router, tg.tls, "router")
            setup[mode] = (router_ch, router_pb2_grpc.RouterStub(router_ch), *_stubs(
                tg.workers, tg.tls))
        for r in range(rounds):
            plans = {mode: _rpc_calls(targets[mode], router, workers, http,
                                      f"rpc-{mode}-{r}-{time.monotonic_ns()}", opened)
                     for mode, (_, router, _, workers) in setup.items()}
            for i in range(calls):  # Route then Release: nothing stays routed
                for mode in round_order(list(plans), i):
                    t0 = time.perf_counter()
                    await plans[mode]["Router.Route"](i)
                    t1 = time.perf_counter()
                    await plans[mode]["Router.Release"](i)
                    samples["Router.Route"][mode].append(t1 - t0)
                    samples["Router.Release"][mode].append(time.perf_counter() - t1)
            for name, n in counts.items():
                if name != "Router.Route":
                    got = await interleaved(n, {m: p[name] for m, p in plans.items()})
                    for mode, secs in got.items():
                        samples[name][mode] += secs
        cpu: dict[str, dict[str, dict[str, float]]] = {n: {} for n in samples}
        for mode, (_, router, _, workers) in setup.items():  # CPU per call, each mode alone
            plan = _rpc_calls(targets[mode], router, workers, http,
                              f"cpu-{mode}-{time.monotonic_ns()}", opened)
            for name, n in {**counts, "Router.Release": calls}.items():
                if name != CONNECT:  # Route's block leaves them routed; Release's frees
                    cpu[name][mode] = await cpu_block(n, plan[name], targets[mode].pids)
        for router_ch, _, chans, _ in setup.values():
            opened += [router_ch, *chans]
        for c in opened:
            await c.close()
    conn = summarize({CONNECT: samples.pop(CONNECT)})
    rows = summarize(samples, DATA_PATH, cpu)
    print_rows(rows, f"per RPC ({rounds} rounds x {calls} calls, one in flight):")
    print_rows(conn, "connect (a fresh channel, once per long-lived channel):")
    return {"rounds": rounds, "calls_per_round": calls, "rows": rows, "connect": conn,
            "data_path": list(DATA_PATH), "data_path_within_10pct": verdict(rows),
            "data_path_cpu_within_10pct": verdict(rows, "cpu_within_10pct")}


def rate_ratios(rows: list[dict[str, Any]], rows_tls: list[dict[str, Any]]) -> list[dict[str,
                                                                                      Any]]:
    """Per rate: TLS / insecure p50 of both paths, and the added latency of each."""
    out = []
    for a, b in zip(rows, rows_tls, strict=True):
        out.append({"rate_rps": a["rate_rps"],
                    "mesh_p50_ratio": b["frontend_router"]["p50_ms"]
                    / a["frontend_router"]["p50_ms"],
                    "anchor_p50_ratio": b["anchor_direct_worker"]["p50_ms"]
                    / a["anchor_direct_worker"]["p50_ms"],
                    "mesh_p50_cost_ms": b["frontend_router"]["p50_ms"]
                    - a["frontend_router"]["p50_ms"],
                    "added_p50_ms_insecure": a["added_p50_ms"],
                    "added_p50_ms_tls": b["added_p50_ms"]})
    return out


def plot(rows: list[dict[str, Any]], path: Path, rows_tls: list[dict[str, Any]] | None = None,
         rpc: dict[str, Any] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["rate_rps"] for r in rows]
    fig, ax = plt.subplots(1, 3 if rpc else 2, figsize=(16 if rpc else 11, 4))
    for key, style in (("p50_ms", "o-"), ("p99_ms", "s--")):
        ax[0].plot(rates, [r["anchor_direct_worker"][key] for r in rows], style,
                   label=f"direct worker {key[:3]}")
        ax[0].plot(rates, [r["frontend_router"][key] for r in rows], style,
                   label=f"frontend+router {key[:3]}")
        if "http_floor" in rows[0]:
            ax[0].plot(rates, [r["http_floor"][key] for r in rows], style,
                       label=f"bare HTTP hop {key[:3]}")
        ax[1].plot(rates, [r[f"added_{key}"] for r in rows], style, label=f"added {key[:3]}")
        if "frontend_lean" in rows[0]:
            ax[1].plot(rates, [r[f"added_lean_{key}"] for r in rows], style,
                       label=f"added, lean clients {key[:3]}")
        if "frontend_grpc" in rows[0]:
            ax[0].plot(rates, [r["frontend_grpc"][key] for r in rows], style,
                       label=f"frontend+router over gRPC {key[:3]}")
            ax[1].plot(rates, [r[f"added_grpc_{key}"] for r in rows], style,
                       label=f"added over gRPC {key[:3]}")
        if rows_tls:
            ax[0].plot(rates, [r["frontend_router"][key] for r in rows_tls], style,
                       label=f"frontend+router mTLS {key[:3]}")
            ax[1].plot(rates, [r[f"added_{key}"] for r in rows_tls], style,
                       label=f"added mTLS {key[:3]}")
    if "http_floor" in rows[0]:
        ax[1].plot(rates, [r["added_beyond_http_floor_p50_ms"] for r in rows], "^:",
                   label="added p50 beyond a bare HTTP hop")
    ax[0].set(xlabel="offered rate (req/s)", ylabel="latency (ms)", title="request latency")
    ax[1].set(xlabel="offered rate (req/s)", ylabel="ms", title="added by frontend + router")
    for a in ax[:2]:
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    if rpc:
        plot_rpc(ax[2], rpc["rows"], "per RPC: insecure vs mTLS (* data path)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass
class Target:
    """One mesh of a mode: the frontend's URL, the router and workers, the client TLS."""

    url: str
    router: str
    grpc: str  # the frontend's gRPC API
    workers: list[str]
    tls: MeshTls | None
    pids: list[int]  # the mesh's processes (their CPU time, descendants included)
    planes: list[str]  # the workers' TCP request planes


def start_mesh(stack: contextlib.ExitStack, mode: str, args: argparse.Namespace) -> Target:
    """A whole mesh (etcd, Redis, indexer, fleet, router, frontend) of ``mode``; in TLS
    mode every child gets ``KVMESH_TLS_DIR`` (certificates made into the mesh's folder)
    and this process calls as the frontend."""
    mesh = stack.enter_context(BenchMesh("rovh" if mode == "insecure" else "rovhtls"))
    tls = None
    fleet_env: dict[str, str] = {}
    if mode == "tls":
        certs = mesh.tmp / "certs"
        write_mesh_certs(certs)
        write_mesh_certs(certs, ["worker:fleet"])  # the fleet's workers are fleet.a0, ...
        fleet_env["KVMESH_TLS_CERT"] = "worker-fleet"
        mesh.env["KVMESH_TLS_DIR"] = str(certs)
        tls = MeshTls.load(certs, "frontend")
    embedded = args.router == "embedded"
    if not embedded:
        mesh.py("indexer", "services.indexer")
    mesh.py("fleet", "workers.fleet", "--workers", str(args.workers), "--timing", "zero",
            "--model-path", "tiny", "--model-name", MODEL, "--max-model-len", "512",
            **fleet_env)
    if embedded:
        url = mesh.frontend(args.workers, 120, *embedded_router_args(args.policy))
        (rec,) = asyncio.run(read_instance_records(
            mesh.children[0].address, mesh.namespace, "router", tls))
        router = rec.address
    else:
        router_port = free_port()
        mesh.py("router", "services.router", "--policy", args.policy, "--indexer",
                args.indexer, "--port", str(router_port))
        url = mesh.frontend(args.workers, 120)
        router = f"127.0.0.1:{router_port}"

    async def workers() -> list[Any]:  # InstanceRecord
        ch = channel(router, tls, "router")
        try:
            resp = await router_pb2_grpc.RouterStub(ch).ListWorkers(
                router_pb2.ListWorkersRequest())
        finally:
            await ch.close()
        return list(resp.workers)
    (front,) = asyncio.run(read_instance_records(
        mesh.children[0].address, mesh.namespace, "frontend", tls))
    listed = asyncio.run(workers())
    if not all(w.request_plane_address for w in listed):
        raise RuntimeError("a worker has no TCP request plane: the lean streams need one")
    return Target(url, router, front.address, [w.address for w in listed], tls,
                  [c.pid for c in mesh.children], [w.request_plane_address for w in listed])


PORT = "{port}"  # start_server's placeholder for the free port in a child's arguments


def start_server(stack: contextlib.ExitStack, name: str, module: str, argv: Sequence[str],
                 logs: Path | None = None) -> str:
    """``python -m module *argv`` (:data:`PORT` in ``argv``: a free loopback port), a child
    serving HTTP on that port, stopped by PID with ``stack``, its output in ``logs``
    (default a fresh temporary folder); its URL once it listens."""
    port = free_port()
    logs = logs or Path(tempfile.mkdtemp(prefix=f"kvmesh-{name}-"))
    child = spawn(name, [sys.executable, "-m", module,
                         *(str(port) if a == PORT else a for a in argv)], logs)
    stack.callback(child.stop)
    wait_until(lambda: port_open("127.0.0.1", port), child, 60, f"{name} to listen")
    return f"http://127.0.0.1:{port}"


def start_http_floor(stack: contextlib.ExitStack) -> str:
    """The HTTP floor's server (module docstring), stopped by PID with ``stack``; its URL."""
    return start_server(stack, "floor-http", "bench.mesh_profile.floors",
                        ["--serve", "http", PORT])


def run(args: argparse.Namespace) -> dict[str, Any]:
    modes = modes_of(args.tls)
    load_before = os.getloadavg()
    with contextlib.ExitStack() as stack:
        targets = {m: start_mesh(stack, m, args) for m in modes}
        floor_url = start_http_floor(stack)
        by_mode, paced = asyncio.run(measure(
            targets, [float(r) for r in args.rates.split(",")], args.duration_s, floor_url,
            args.paced))
        rpc = asyncio.run(measure_rpcs(targets, args.rpc_rounds, args.rpc_calls)) \
            if args.rpc_rounds > 0 else None
    report: dict[str, Any] = {
        "benchmark": "router_overhead", "workers": args.workers, "policy": args.policy,
        "indexer": "embedded" if args.router == "embedded" else args.indexer,
        "router": args.router, "engine": "mock (zero timing)", "duration_s": args.duration_s,
        "cpus": os.cpu_count(), "loadavg_1_5_15": {"before": load_before,
                                                    "after": os.getloadavg()},
        "tls": args.tls, "modes": list(modes),
        "rows": by_mode[modes[0]]}
    if len(modes) == 2:
        report["rows_tls"] = by_mode["tls"]
        report["rate_ratio"] = rate_ratios(by_mode["insecure"], by_mode["tls"])
    if paced:
        report["paced"] = paced
    if rpc is not None:
        report["rpc"] = rpc
    return report


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.router_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="25,50,100,200")
    p.add_argument("--duration-s", type=float, default=4.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--policy", default="kv")
    p.add_argument("--indexer", default="remote", choices=("remote", "embedded", "none"),
                   help="the router process's index (--router standalone)")
    p.add_argument("--router", default="standalone", choices=("standalone", "embedded"))
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="router_overhead", help="output file stem")
    p.add_argument("--tls", default="both", choices=tuple(TLS_FLAG),
                   help="plaintext meshes, mTLS meshes (--tls-dir: certificates + role "
                        "authorization), or both side by side, interleaved")
    p.add_argument("--rpc-rounds", type=int, default=6,
                   help="rounds of the per-RPC measurement (0: skip it)")
    p.add_argument("--rpc-calls", type=int, default=200, help="calls per RPC and round")
    p.add_argument("--paced", type=int, default=0,
                   help="rounds of the lean pair one request at a time, 10 ms apart (a "
                        "row of rate 0 per mode; 0: none)")
    args = p.parse_args(argv)
    report = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    plot(report["rows"], out / f"{name}.png", report.get("rows_tls"), report.get("rpc"))
    print(f"-> {out}/{name}.json/.png")
    return 0


def entry() -> None:
    sys.exit(main())
