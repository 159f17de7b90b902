"""Where a mock mesh spends its CPU per request: per process, per hop, per library.

``python -m bench.mesh_profile [--requests 400] [--concurrency 8] [--words 240]
[--max-tokens 16] [--stream] [--router standalone|embedded]
[--worker-transport tcp|stream|call] [--phases cpu,profile,timers]
[--compare | --baseline DIR [--rounds 3]] [--out bench/results]``

Contracts:

- Each phase starts its own mesh as child processes on free loopback ports (stopped by PID
  at its end, :class:`bench.mesh.BenchMesh`): etcd, Redis, the indexer, one
  ``workers.fleet`` process with 2 mock workers (``--timing zero``: engine steps cost
  nothing, KV events still flow), the ``kv`` router (remote indexer) and the frontend.
  ``--router embedded`` runs no router process: the frontend routes in-process
  (``--router embedded --indexer embedded``, :mod:`services.router.embedded`) and no
  indexer process either. ``--worker-transport`` is the frontend's (default ``tcp``:
  its worker calls on each worker's TCP request plane, :mod:`services.frontend.
  request_plane`; ``stream``: on one GenerateMux per worker, :mod:`services.frontend.
  worker_stream`; ``call``: a gRPC call each).
- Load: a closed loop of ``--concurrency`` clients in this process (httpx, one connection
  each) POSTing ``/v1/completions`` with a text prompt of ``--words`` words (a shared
  head of 5/6 of them, then words of the request's own), ``max_tokens`` 16,
  ``ignore_eos``, temperature 0; ``--requests`` requests after 40 of warm-up.
- Phase ``cpu``: no profiler; each process's CPU time (user + system, all its threads,
  psutil) over the measured requests, per request; req/s and latency p50/p99.
- Phase ``profile``: the frontend, router, indexer and fleet run under
  :mod:`bench.mesh_profile.prof` (cProfile on thread CPU time, every Python thread; the
  main thread's profiler runs only between the two snapshots); a SIGUSR1 before and after
  the measured requests snapshots the stats, and their difference is the window. Per
  process: the profiled Python CPU per request, its split into buckets by library
  (:data:`BUCKETS`, self time), each bucket's estimated µs per request (its share × the
  ``cpu`` phase's per-request CPU, when that phase ran), the RPC handler calls per
  request, and the top functions by self and by cumulative time. The profiler inflates
  Python-heavy code more than C code: read shares, not times.
- Phase ``timers``: the frontend, router, indexer and fleet run under
  :mod:`bench.mesh_profile.timers` (thread-CPU timers around the request path's
  synchronous steps, :data:`~bench.mesh_profile.timers.TARGETS`, counted between two
  SIGUSR1s around the measured requests; nothing else slowed): per process its CPU per
  request with the timers on and each timed function's µs and calls per request
  (inclusive), dearest first. What those steps cost in place, where the profiler's
  shares are skewed towards call-heavy code.
- ``--compare``: instead, the ``cpu`` phase with each router mode in the order
  standalone, embedded, embedded, standalone, and embedded ÷ standalone of the means of
  req/s, p50, p99 and the mesh's CPU per request.
- ``--baseline DIR``: instead, the ``cpu`` phase alternating between this checkout's code
  and DIR's (another checkout of kvmesh, e.g. ``git archive HEAD | tar -x -C DIR``:
  its children run with DIR as their working directory, so ``python -m`` imports DIR's
  services; the client and this bench stay this checkout's), ``--rounds`` rounds of
  baseline then current, with the ``--router`` mode; per process the means and
  current ÷ baseline of the CPU per request, and of req/s, p50 and p99. Also the same
  normalised by the load client's CPU per request (the same code on both sides, so it
  tracks the machine's speed, which drifts between rounds): ``req_per_s_at_client_speed``
  (req/s × the client's CPU ms per request) and ``cpu_over_client.<process>`` (its CPU
  per request ÷ the client's), means of the rounds' values. A change that alters how
  the processes are scheduled moves the client's CPU per request too (fewer, fuller
  wake-ups): read these beside the raw ratios, not instead of them.
- Writes ``<out>/<name>.json`` (default name ``mesh_profile``). All processes share this
  machine's cores with the client and with anything else running: absolute numbers are
  noisy; compare ratios taken in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import marshal
import os
import random
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

from bench.mesh import BenchMesh, embedded_router_args
from services.common.procs import Child, free_port, wait_until

RESULTS = Path(__file__).resolve().parents[1] / "results"
MODEL = "tiny"
WARMUP = 40
WORDS = ("the", "model", "cache", "router", "token", "block", "engine", "river", "stone",
         "light", "paper", "window", "garden", "silver", "number", "market", "winter",
         "signal", "planet", "forest", "bridge", "mirror", "letter", "rocket", "castle",
         "orange", "yellow", "thunder", "machine", "library", "morning", "evening")

# (bucket, substrings of the pstats file path or function name), first match wins
BUCKETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("otel", ("opentelemetry",)),
    ("grpc", ("grpc",)),
    ("protobuf", ("google/protobuf", "upb", "SerializeToString", "FromString",
                  "ParseFromString", "MergeFrom", "CopyFrom")),
    ("http_server (uvicorn/h11/httptools)", ("uvicorn", "h11", "httptools")),
    ("asgi (starlette/fastapi/anyio)", ("starlette", "fastapi", "anyio")),
    ("json", ("json",)),
    ("tokenize (transformers/tokenizers)", ("tokenizers", "transformers", "Tokenizer")),
    ("hashing (block_hash, xxhash)", ("block_hash", "xxh")),
    ("prometheus_client", ("prometheus_client",)),
    ("logging", ("logging/",)),
    ("kvmesh frontend", ("services/frontend/",)),
    ("kvmesh router", ("services/router/",)),
    ("kvmesh indexer", ("services/indexer/",)),
    ("kvmesh worker (mock engine, service)", ("workers/",)),
    ("kvmesh common", ("services/common/",)),
    ("asyncio / event loop", ("asyncio", "selectors", "select.", "epoll", "_contextvars",
                              "contextvars", "Context.run")),
    ("threads / futures", ("threading", "concurrent/futures", "_thread", "queue")),
    ("uuid", ("uuid",)),
    ("redis", ("redis",)),
)
# the RPC handlers and client calls whose calls per request are reported
HANDLERS = ("Route", "Release", "PrefillDone", "FindMatches", "Generate", "ReportFailure")


def prompt_text(i: int, words: int) -> str:
    """``words`` words: a head shared by every request (5/6 of them), then its own."""
    head = max(1, words * 5 // 6)
    shared = random.Random(0)
    own = random.Random(1000 + i)
    return " ".join([shared.choice(WORDS) for _ in range(head)]
                    + [own.choice(WORDS) + str(own.randrange(100)) for _ in range(words - head)])


async def run_clients(n: int, concurrency: int,
                      one: Callable[[httpx.AsyncClient, int], Awaitable[None]],
                      timeout_s: float = 60.0) -> float:
    """A closed loop: ``concurrency`` clients (one connection each), each calling
    ``one(client, i)`` for the next request index ``i`` (0 .. n-1) when its last one is
    done. Returns the wall time in seconds."""
    next_i = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal next_i
        while next_i < n:
            i = next_i
            next_i += 1
            await one(http, i)

    clients = [httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=1))
               for _ in range(concurrency)]
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(client(c) for c in clients))
    finally:
        for c in clients:
            await c.aclose()
    return time.perf_counter() - t0


async def closed_loop(url: str, n: int, concurrency: int, words: int, max_tokens: int,
                      stream: bool, offset: int, stream_interval: int | None = None
                      ) -> dict[str, Any]:
    """``n`` requests from ``concurrency`` clients (:func:`run_clients`); latency send →
    complete response. ``stream_interval``: vLLM's field, sent when set."""
    lat: list[float] = []
    errors: list[str] = []

    async def one(http: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL, "prompt": prompt_text(offset + i, words),
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                "stream": stream}
        if stream_interval is not None:
            body["stream_interval"] = stream_interval
        t0 = time.perf_counter()
        try:
            if stream:
                async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                    r.raise_for_status()
                    async for _ in r.aiter_raw():
                        pass
            else:
                r = await http.post(f"{url}/v1/completions", json=body)
                r.raise_for_status()
            lat.append(time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - counted, reported
            errors.append(f"{type(exc).__name__}: {exc}"[:200])

    wall = await run_clients(n, concurrency, one)
    a = np.asarray(lat) if lat else np.asarray([np.nan])
    return {"requests": n, "ok": len(lat), "errors": len(errors),
            "first_errors": errors[:3], "wall_s": wall, "req_per_s": len(lat) / wall,
            "p50_ms": float(np.percentile(a, 50) * 1e3),
            "p99_ms": float(np.percentile(a, 99) * 1e3)}


def _cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def start(mesh: BenchMesh, args: argparse.Namespace, profile_dir: Path | None,
          runner: str = "bench.mesh_profile.prof") -> tuple[str, dict[str, Child]]:
    """The phase's mesh (see the module docstring): its URL and children by role; with
    ``profile_dir``, the kvmesh processes run under ``runner`` (the profiler, or
    :mod:`bench.mesh_profile.timers`)."""
    def py(name: str, module: str, *argv: str) -> Child:
        if profile_dir is None:
            return mesh.py(name, module, *argv)
        return mesh.py(name, runner, str(profile_dir / name), module, *argv)

    children: dict[str, Child] = {"etcd": mesh.children[0], "redis": mesh.children[1]}
    embedded = args.router == "embedded"
    if not embedded:
        children["indexer"] = py("indexer", "services.indexer")
    children["fleet"] = py("fleet", "workers.fleet", "--workers", "2", "--timing", "zero",
                           "--model-path", "tiny", "--model-name", MODEL,
                           "--max-model-len", "1024")
    front_args: list[str] = []
    replicas = getattr(args, "frontends", 1)
    if embedded:
        front_args = embedded_router_args("kv", replica_sync=replicas > 1)
    else:
        router_port = free_port()
        children["router"] = py("router", "services.router", "--policy", "kv",
                                "--indexer", "remote", "--port", str(router_port))
        front_args = ["--router-address", f"127.0.0.1:{router_port}"]
    transport = getattr(args, "worker_transport", "tcp")
    if transport != "tcp":  # the default goes unsaid: a --baseline checkout may predate
        front_args += ["--worker-transport", transport]  # it (and then runs its own)
    port = free_port()
    if replicas > 1:  # they share the port (SO_REUSEPORT)
        front_args.append("--reuse-port")
    front = py("frontend", "services.frontend", "--http-port", str(port), *front_args)
    children["frontend"] = front
    for i in range(1, replicas):
        children[f"frontend-{i}"] = py(f"frontend-{i}", "services.frontend", "--http-port",
                                       str(port), *front_args)
    url = f"http://127.0.0.1:{port}"

    wait_until(mesh.serving(url, 2, replicas), front, 180, "the mesh to serve")
    _wait_idle(children)
    return url, children


def _wait_idle(children: dict[str, Child], timeout_s: float = 180.0) -> None:
    """Until every child used under 5 % of a core over one second (the frontend imports
    vLLM's tool parser in a thread after it serves: 10-18 s of CPU)."""
    deadline = time.monotonic() + timeout_s
    while True:
        c0 = {n: _cpu(c.pid) for n, c in children.items()}
        time.sleep(1.0)
        busy = {n: _cpu(c.pid) - c0[n] for n, c in children.items()}
        if max(busy.values()) < 0.05:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the mesh never went idle: CPU s in the last second {busy}")


def _snapshot(children: dict[str, Child], profile_dir: Path, k: int) -> None:
    """SIGUSR1 to every profiled child; waits for its k-th snapshot file."""
    names = [n for n in children if n not in ("etcd", "redis")]
    for n in names:
        os.kill(children[n].pid, signal.SIGUSR1)
    for n in names:
        done = profile_dir / f"{n}.{k}.done"
        wait_until(done.exists, children[n], 60, f"{n}'s profile snapshot {k}")


def _bucket(func: tuple[str, int, str]) -> str:
    text = f"{func[0]}:{func[2]}"
    for name, keys in BUCKETS:
        if any(k in text for k in keys):
            return name
    return "other"


def _ours() -> str:
    """The folder whose code the children run (``python -m`` imports from the working
    directory they inherit), with a trailing slash: kvmesh's own functions are there."""
    return os.path.join(os.getcwd(), "")


def _fname(func: tuple[str, int, str]) -> str:
    path = func[0]
    for root in ("site-packages/", _ours(), "lib/python3.11/"):
        if root in path:
            path = path.split(root, 1)[1]
    return f"{path}:{func[1]}({func[2]})" if func[0] != "~" else func[2]


def _profiler_own(func: tuple[str, int, str]) -> bool:
    """The profiler's own snapshot work (in the window, but not the process's)."""
    return (func[0].endswith(("cProfile.py", "mesh_profile/prof.py", "pstats.py"))
            or "_lsprof" in func[2] or "marshal" in func[2])


def analyse(before: dict[Any, Any], after: dict[Any, Any], n: int,
            cpu_us: float | None) -> dict[str, Any]:
    """One process's window (``after`` − ``before``), per request."""
    window: dict[Any, tuple[int, float, float]] = {}
    edges: dict[Any, dict[Any, float]] = {}  # builtin → caller → self time spent for it
    for func, (_cc, nc, tt, ct, callers) in after.items():
        if _profiler_own(func):
            continue
        b = before.get(func, (0, 0, 0.0, 0.0, {}))
        if nc - b[1] > 0 or tt - b[2] > 0:
            window[func] = (nc - b[1], tt - b[2], ct - b[3])
            if func[0] == "~":
                edges[func] = {c: e[2] - b[4].get(c, (0, 0, 0.0, 0.0))[2]
                               for c, e in callers.items()}
    buckets: dict[str, float] = {}
    others: dict[str, float] = {}

    def add(func: Any, tt: float) -> None:
        b = _bucket(func)
        buckets[b] = buckets.get(b, 0.0) + tt
        if b == "other":
            others[func[0]] = others.get(func[0], 0.0) + tt

    for func, (_, tt, _) in window.items():
        # a builtin's self time goes to its callers' buckets (isinstance, len, ... are
        # whoever calls them), unless its own name says where it belongs
        calls = {c: t for c, t in edges.get(func, {}).items() if t > 0}
        ours = sum(t for c, t in calls.items() if _profiler_own(c))
        if calls and ours:  # the part the profiler's snapshots spent is not the process's
            tt *= 1 - ours / sum(calls.values())
        by_caller = {c: t for c, t in calls.items() if c[0] != "~" and not _profiler_own(c)}
        if func[0] != "~" or _bucket(func) != "other" or not by_caller:
            add(func, tt)
            continue
        spent = sum(by_caller.values())
        for caller, t in by_caller.items():
            add(caller, tt * t / spent)
    total = sum(buckets.values())
    rows = []
    for name, tt in sorted(buckets.items(), key=lambda kv: -kv[1]):
        row: dict[str, Any] = {"bucket": name, "share": tt / total if total else 0.0,
                               "profiled_us_per_req": tt / n * 1e6}
        if cpu_us is not None:
            row["est_us_per_req"] = row["share"] * cpu_us
        rows.append(row)
    handlers = {}
    for func, (nc, _tt, ct) in window.items():
        if func[2] in HANDLERS and func[0] != "~":
            handlers[_fname(func)] = {"calls_per_req": nc / n, "cum_us_per_req": ct / n * 1e6}

    def top(key: int, only_ours: bool) -> list[dict[str, Any]]:
        items = [(f, v) for f, v in window.items()
                 if not only_ours or _ours() in f[0]]
        items.sort(key=lambda fv: -fv[1][key])
        return [{"function": _fname(f), "calls_per_req": v[0] / n,
                 "self_us_per_req": v[1] / n * 1e6, "cum_us_per_req": v[2] / n * 1e6,
                 "self_share": v[1] / total if total else 0.0,
                 **({"top_callers": [_fname(c) for c, _ in sorted(
                     edges[f].items(), key=lambda ct: -ct[1])[:3]]} if f in edges else {})}
                for f, v in items[:25]]
    return {"profiled_cpu_us_per_req": total / n * 1e6, "buckets": rows,
            "other_files": {_fname((f, 0, "")): tt / n * 1e6 for f, tt in sorted(
                others.items(), key=lambda kv: -kv[1])[:8]},
            "rpc_handlers": handlers, "top_self": top(1, False),
            "top_cumulative_kvmesh": top(2, True)}


def run_phase(phase: str, args: argparse.Namespace, cpu: dict[str, Any] | None
              ) -> dict[str, Any]:
    with BenchMesh(f"mprof{phase}") as mesh:
        profile_dir = mesh.tmp / "profiles" if phase in ("profile", "timers") else None
        if profile_dir is not None:
            profile_dir.mkdir()
        url, children = start(mesh, args, profile_dir, "bench.mesh_profile.timers"
                              if phase == "timers" else "bench.mesh_profile.prof")
        go = lambda n, off: asyncio.run(closed_loop(  # noqa: E731
            url, n, args.concurrency, args.words, args.max_tokens, args.stream, off,
            args.stream_interval))
        warm = go(WARMUP, 10_000_000)
        if warm["ok"] == 0:
            raise RuntimeError(f"warm-up failed: {warm['first_errors']}")
        if profile_dir is not None:
            _snapshot(children, profile_dir, 1)
        c0 = {n: _cpu(c.pid) for n, c in children.items()}
        p0 = time.process_time()
        load = go(args.requests, 0)
        client_us = (time.process_time() - p0) / args.requests * 1e6
        c1 = {n: _cpu(c.pid) for n, c in children.items()}
        out: dict[str, Any] = {"load": load, "client_cpu_us_per_req": client_us,
                               "cpu_us_per_req": {n: (c1[n] - c0[n]) / args.requests * 1e6
                                                  for n in children}}
        out["cpu_us_per_req_mesh_total"] = sum(out["cpu_us_per_req"].values())
        print(f"[{phase}] {load['req_per_s']:.1f} req/s p50 {load['p50_ms']:.1f} ms "
              f"p99 {load['p99_ms']:.1f} ms errors {load['errors']}; CPU µs/req "
              + " ".join(f"{n}={v:.0f}" for n, v in out["cpu_us_per_req"].items())
              + f" client={client_us:.0f}", flush=True)
        if profile_dir is not None and phase == "timers":
            _snapshot(children, profile_dir, 2)
            out["processes"] = {name: timed(profile_dir / f"{name}.timers.json",
                                            args.requests)
                                for name in children if name not in ("etcd", "redis")}
            print_timed(out["processes"])
        elif profile_dir is not None:
            _snapshot(children, profile_dir, 2)
            out["processes"] = {}
            for name in children:
                if name in ("etcd", "redis"):
                    continue
                before = marshal.loads((profile_dir / f"{name}.1.pstats").read_bytes())
                after = marshal.loads((profile_dir / f"{name}.2.pstats").read_bytes())
                ref = (cpu or {}).get("cpu_us_per_req", {}).get(name)
                out["processes"][name] = analyse(before, after, args.requests, ref)
            if args.keep_profiles:
                shutil.copytree(profile_dir, args.keep_profiles, dirs_exist_ok=True)
        return out


def timed(path: Path, n: int) -> dict[str, Any]:
    """One process's timers (:mod:`bench.mesh_profile.timers`) per request, dearest
    first."""
    got = json.loads(path.read_text())
    return {"cpu_us_per_req": got["cpu_ns"] / n / 1e3, "functions": sorted((
        {"function": name, "us_per_req": f["ns"] / n / 1e3, "calls_per_req": f["calls"] / n}
        for name, f in got["functions"].items()), key=lambda f: -f["us_per_req"])}


def print_timed(processes: dict[str, dict[str, Any]]) -> None:
    for name, p in processes.items():
        print(f"  {name}: {p['cpu_us_per_req']:.0f} µs of CPU per request (timers on); "
              "timed functions, inclusive:")
        for f in p["functions"]:
            print(f"    {f['us_per_req']:7.1f} µs/req {f['calls_per_req']:5.2f} calls/req  "
                  f"{f['function']}")


def compare_baseline(args: argparse.Namespace, baseline: Path) -> dict[str, Any]:
    """The ``--baseline`` report (module docstring): runs, means and current ÷ baseline."""
    if not (baseline / "services" / "frontend").is_dir():
        raise SystemExit(f"--baseline {baseline}: not a kvmesh checkout")
    here = os.getcwd()
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "current": []}
    for _ in range(args.rounds):
        for side in ("baseline", "current"):
            os.chdir(baseline if side == "baseline" else here)  # the children inherit it
            try:
                print(f"[{side}]", end=" ", flush=True)
                runs[side].append(run_phase("cpu", args, None))
            finally:
                os.chdir(here)

    def mean(side: str, *path: str) -> float:
        vals = []
        for r in runs[side]:
            v: Any = r
            for key in path:
                v = v[key]
            vals.append(float(v))
        return float(np.mean(vals))

    means: dict[str, dict[str, float]] = {}
    for side in runs:
        means[side] = {k: mean(side, "load", k) for k in ("req_per_s", "p50_ms", "p99_ms")}
        for name in runs[side][0]["cpu_us_per_req"]:
            means[side][f"cpu_us_per_req.{name}"] = mean(side, "cpu_us_per_req", name)
        means[side]["cpu_us_per_req_mesh_total"] = mean(side, "cpu_us_per_req_mesh_total")
        client = [float(r["client_cpu_us_per_req"]) for r in runs[side]]
        if all(client):
            pairs = list(zip(runs[side], client, strict=True))
            means[side]["req_per_s_at_client_speed"] = float(np.mean(
                [r["load"]["req_per_s"] * c / 1e3 for r, c in pairs]))
            for name in runs[side][0]["cpu_us_per_req"]:
                means[side][f"cpu_over_client.{name}"] = float(np.mean(
                    [r["cpu_us_per_req"][name] / c for r, c in pairs]))
    ratio = {k: means["current"][k] / v for k, v in means["baseline"].items() if v}
    print({k: round(v, 3) for k, v in ratio.items()}, flush=True)
    return {"baseline": str(baseline), "order": ["baseline", "current"] * args.rounds,
            "runs": runs, "means": means, "ratio_current_over_baseline": ratio}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.mesh_profile", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--words", type=int, default=240)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--stream-interval", type=int, default=None,
                   help="vLLM's stream_interval on every request (default: not sent)")
    p.add_argument("--router", default="standalone", choices=("standalone", "embedded"))
    p.add_argument("--worker-transport", default="tcp", choices=("call", "stream", "tcp"),
                   help="the frontend's --worker-transport")
    p.add_argument("--phases", default="cpu,profile",
                   help="comma-separated: cpu, profile, timers (module docstring)")
    p.add_argument("--keep-profiles", type=Path, default=None, metavar="DIR",
                   help="copy the profile phase's pstats snapshots (NAME.1 before the load, "
                        "NAME.2 after it) to DIR")
    p.add_argument("--compare", action="store_true",
                   help="instead of --phases: the cpu phase with the standalone and the "
                        "embedded router, alternating (ABBA), and their ratios")
    p.add_argument("--baseline", default=None,
                   help="instead of --phases: the cpu phase alternating between DIR's code "
                        "(another checkout) and this one's, --rounds times, and the ratios")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="mesh_profile")
    args = p.parse_args(argv)
    report: dict[str, Any] = {
        "benchmark": "mesh_profile", "requests": args.requests,
        "concurrency": args.concurrency, "words": args.words, "max_tokens": args.max_tokens,
        "stream": args.stream, "stream_interval": args.stream_interval,
        "router": args.router, "worker_transport": args.worker_transport,
        "cpus": os.cpu_count(),
        "loadavg_before": os.getloadavg(),
        "note": "2 shared cores, other jobs running: absolute numbers are noisy; the "
                "profiler inflates Python code, so its buckets are shares scaled by the "
                "unprofiled phase's CPU per request"}
    if args.compare:  # the cpu phase, standalone and embedded router, ABBA
        order = ["standalone", "embedded", "embedded", "standalone"]
        runs: dict[str, list[dict[str, Any]]] = {"standalone": [], "embedded": []}
        for mode in order:
            args.router = mode
            runs[mode].append(run_phase("cpu", args, None))
        report["router"] = "compare"
        report["order"] = order
        report["runs"] = runs

        def mean(mode: str, key: str) -> float:
            vals = [r["load"][key] if key in r["load"] else r[key] for r in runs[mode]]
            return float(np.mean(vals))
        report["ratio_embedded_over_standalone"] = {
            k: mean("embedded", k) / mean("standalone", k)
            for k in ("req_per_s", "p50_ms", "p99_ms", "cpu_us_per_req_mesh_total")}
        print(report["ratio_embedded_over_standalone"], flush=True)
        args.phases = ""
    if args.baseline:
        report.update(compare_baseline(args, Path(args.baseline).resolve()))
        args.phases = ""
    cpu = None
    for phase in filter(None, args.phases.split(",")):
        report[phase] = run_phase(phase, args, cpu)
        if phase == "cpu":
            cpu = report[phase]
    report["loadavg_after"] = os.getloadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    print(f"-> {out}/{args.name}.json")
    return 0


def entry() -> None:
    sys.exit(main())
