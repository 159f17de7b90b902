"""kvmesh's frontend + router against Dynamo 1.6.1's, side by side, with zero-cost engines.

``python -m bench.frontend_vs_dynamo [--requests 400] [--concurrency 1,8,32] [--words 240]
[--max-tokens 16] [--rounds 2] [--open-loop-rps R,...] [--router standalone|embedded]
[--frontends N] [--out bench/results]``

Contracts:

- Both systems run at once for the whole bench, as child processes on free loopback ports,
  stopped by PID (process group) at its end; each uses the same model folder (the tiny
  test model, ``workers.model.tiny``: its ``tokenizer.json`` and ``config.json``) and so
  the same tokenizer, under the served name ``tiny``.
  - kvmesh: :func:`bench.mesh_profile.run.start` (etcd, Redis, the indexer, one
    ``workers.fleet`` with 2 mock workers at ``--timing zero``, the ``kv`` router and the
    frontend; ``--router embedded``: the router and index inside the frontend;
    ``--frontends N``: N frontend processes sharing the HTTP port, ``--reuse-port``, each
    with its embedded router in replica sync).
  - Dynamo: :class:`bench.frontend_vs_dynamo.dynamo_side.DynamoMesh` (``dynamo.frontend
    --router-mode kv`` and 2 ``dynamo.mocker`` at block size 32, speedup 10000, file
    discovery, loopback only), from ``.dynvenv``, installed on demand
    (:func:`~bench.frontend_vs_dynamo.dynamo_side.ensure_dynvenv`; ``--no-install``
    refuses to install and reports Dynamo as unavailable instead).
  A side that cannot start, or a round that raises, gets its error in the JSON and the
  bench goes on with the other side.
- Load (:mod:`bench.frontend_vs_dynamo.client`, the same client and byte-identical
  request bodies for both): 40 warm-up requests per side, then per concurrency in
  ``--concurrency`` and per round, a closed loop of ``--requests`` requests on kvmesh,
  then on Dynamo (A B A B …, ``--rounds`` rounds); then per rate in ``--open-loop-rps``
  the same with Poisson arrivals. A request counts only if it answered HTTP 200 with
  ``usage.completion_tokens == --max-tokens``. Per round the side's CPU time per request
  (all its processes, psutil, user + system) and the client's are recorded too.
  Then, with ``--paced-pairs N``, both systems one request at a time in one sequence
  (:func:`bench.frontend_vs_dynamo.client.paced_pairs`: after 50 warm-up rounds, N rounds
  of one request per side in a random order, ``--paced-gap-ms`` apart (10: each process
  sleeps as long as at 100 req/s), the lean client, 64 token ids and one token):
  ``paced`` in the report, per side p50 / p90 / p99, kvmesh ÷ Dynamo at each, and the
  median paired difference; its goal is void (None, ``paced.void`` says why) when a
  side failed more than 1 % of its requests (:func:`~.report.paced_goal`).
- Report (:mod:`bench.frontend_vs_dynamo.report`): per system and point the medians over
  rounds of req/s, p50 and p99, and kvmesh ÷ Dynamo; the issue's goal checks (reported,
  never asserted); cpus, load average before and after, versions, each side's idle CPU
  and its listening addresses (all must be loopback; any other is listed under
  ``non_loopback_listeners``). Writes ``<out>/frontend_vs_dynamo.json`` and ``.png`` and
  prints the tables. Both systems and the client share this machine's cores (and
  whatever else runs on it): compare the ratios taken in one run, not absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import psutil

from bench.frontend_vs_dynamo import report as rep
from bench.frontend_vs_dynamo.client import closed_loop, open_loop, paced_pairs
from bench.frontend_vs_dynamo.dynamo_side import DynamoError, DynamoMesh, ensure_dynvenv
from bench.mesh import BenchMesh
from bench.mesh_profile import run as mesh_profile

RESULTS = Path(__file__).resolve().parents[1] / "results"
ROOT = Path(__file__).resolve().parents[2]
MODEL = mesh_profile.MODEL
WARMUP = 40
NOTE = ("Both systems, their engines and the load client share this machine's cores "
        "(cpus below; other jobs may run too): absolute numbers are noisy, compare the "
        "kvmesh ÷ Dynamo ratios taken in one run. Engines cost nothing on both sides "
        "(kvmesh workers.fleet --timing zero, dynamo.mocker --speedup-ratio 10000).")


@dataclass
class Side:
    """One running system: its URL, its processes' PIDs, or why it is not running."""

    name: str
    url: str = ""
    pids: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


def parse_list(text: str, kind: Callable[[str], Any]) -> list[Any]:
    """``"1,8,32"`` → ``[1, 8, 32]`` (empty items dropped); raises ValueError on a bad or
    non-positive item."""
    out = [kind(x) for x in text.split(",") if x.strip()]
    if any(v <= 0 for v in out):
        raise ValueError(f"values must be positive: {text!r}")
    return out


def _procs(pids: dict[str, int]) -> list[psutil.Process]:
    out = []
    for pid in pids.values():
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            out += [p, *p.children(recursive=True)]
    return out


def cpu_seconds(pids: dict[str, int]) -> float:
    """User + system CPU seconds of these processes and their descendants."""
    total = 0.0
    for p in _procs(pids):
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def cpu_by_name(pids: dict[str, int]) -> dict[str, float]:
    """:func:`cpu_seconds` of each named process (with its descendants) alone."""
    return {name: cpu_seconds({name: pid}) for name, pid in pids.items()}


def idle_cpu(pids: dict[str, int], window_s: float = 1.0) -> float:
    """Cores these processes use while nothing is sent (CPU s per second)."""
    c0 = cpu_seconds(pids)
    time.sleep(window_s)
    return (cpu_seconds(pids) - c0) / window_s


def listeners(pids: dict[str, int]) -> list[str]:
    """``host:port`` of every listening TCP socket of these processes."""
    out = set()
    for p in _procs(pids):
        with contextlib.suppress(psutil.Error):
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN and c.laddr:
                    out.add(f"{c.laddr.ip}:{c.laddr.port}")
    return sorted(out)


def non_loopback(addrs: Sequence[str]) -> list[str]:
    """The addresses among ``host:port`` strings whose host is not a loopback address
    (an IPv4-mapped IPv6 loopback address counts as loopback)."""
    bad = []
    for a in addrs:
        host = a.rsplit(":", 1)[0].strip("[]")
        try:
            ip = ipaddress.ip_address(host)
            mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
            if not (mapped or ip).is_loopback:
                bad.append(a)
        except ValueError:
            bad.append(a)
    return bad


def _git_rev() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        p = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                           capture_output=True, text=True, timeout=10, check=False)
        return p.stdout.strip() or None
    return None


def start_kvmesh(stack: contextlib.ExitStack, router: str, frontends: int = 1,
                 worker_transport: str = "tcp") -> Side:
    side = Side("kvmesh", info={"router": router, "frontends": frontends,
                                "worker_transport": worker_transport})
    try:
        mesh = stack.enter_context(BenchMesh("fvd"))
        url, children = mesh_profile.start(
            mesh, argparse.Namespace(router=router, frontends=frontends,
                                     worker_transport=worker_transport), None)
        side.url, side.pids = url, {n: c.pid for n, c in children.items()}
    except Exception as exc:  # noqa: BLE001 - reported, the bench goes on
        side.error = f"{type(exc).__name__}: {exc}"[-2000:]
    return side


def start_dynamo(stack: contextlib.ExitStack, model_dir: Path, install: bool) -> Side:
    side = Side("dynamo")
    try:
        if not install and not (ROOT / ".dynvenv" / "bin" / "python").exists():
            raise DynamoError(".dynvenv is missing and --no-install was given")
        side.info["install"] = ensure_dynvenv()
        mesh = stack.enter_context(DynamoMesh(side.info["install"]["python"], model_dir,
                                              MODEL))
        side.url, side.pids = mesh.url, mesh.pids()
        side.info["advertised"] = mesh.advertised()
        side.info["non_loopback_advertised"] = non_loopback(side.info["advertised"])
        side.info["note"] = ("dynamo.mocker binds its ZMQ publishers on 0.0.0.0 whatever "
                             "DYN_EVENT_PLANE_HOST says, and advertises 127.0.0.1: every "
                             "connection between the processes is on loopback")
    except Exception as exc:  # noqa: BLE001 - reported, the bench goes on
        side.error = f"{type(exc).__name__}: {exc}"[-2000:]
    return side


def _settle(side: Side, timeout_s: float = 60.0) -> float:
    """Waits (bounded) until the side uses under 5 % of a core; returns its last idle
    CPU (a side that never settles is measured anyway, with that number reported)."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = idle_cpu(side.pids)
        if busy < 0.05 or time.monotonic() > deadline:
            return busy


Load = Callable[[], Coroutine[Any, Any, dict[str, Any]]]


def measure(side: Side, load: Load) -> dict[str, Any]:
    """One round on one side: the client's summary plus the side's CPU per request, or
    ``{"error": ...}``."""
    if side.error is not None:
        return {"error": f"{side.name} did not start"}
    try:
        by0 = cpu_by_name(side.pids)
        c0, p0 = cpu_seconds(side.pids), time.process_time()
        out = asyncio.run(load())
        n = max(1, out["requests"])
        out["cpu_us_per_req"] = (cpu_seconds(side.pids) - c0) / n * 1e6
        out["cpu_us_per_req_by_process"] = {
            name: round((t - by0.get(name, 0.0)) / n * 1e6)
            for name, t in cpu_by_name(side.pids).items()}
        out["client_cpu_us_per_req"] = (time.process_time() - p0) / n * 1e6
        return out
    except Exception as exc:  # noqa: BLE001 - reported, the bench goes on
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def bench(sides: list[Side], args: argparse.Namespace) -> dict[str, Any]:
    """The warm-up, then the closed- and open-loop rounds (see the module docstring)."""
    results: dict[str, dict[str, dict[str, list[Any]]]] = {"closed": {}, "open": {}}
    shape = {"model": MODEL, "words": args.words, "max_tokens": args.max_tokens}
    for s in sides:
        if s.error is None:
            s.info["warmup"] = measure(s, partial(
                closed_loop, s.url, n=WARMUP, concurrency=8, offset=90_000_000, **shape))
            s.info["idle_cpu_cores"] = _settle(s)

    step = 0

    def one(mode: str, point: float, rnd: int) -> None:
        nonlocal step
        per = results[mode].setdefault(f"{point:g}", {s.name: [] for s in sides})
        step += 1
        offset = step * 1_000_000  # fresh own-words per round, the same for both sides
        for s in sides:  # A B per round: identical requests for both
            load: Load
            if mode == "closed":
                load = partial(closed_loop, s.url, n=args.requests, concurrency=int(point),
                               offset=offset, **shape)
            else:
                load = partial(open_loop, s.url, n=args.requests, rate=point,
                               offset=offset, seed=rnd, **shape)
            r = measure(s, load)
            per[s.name].append(r)
            msg = r.get("error") or (
                f"{r['req_per_s']:.0f} req/s p50 {r['p50_ms']:.1f} ms p99 "
                f"{r['p99_ms']:.1f} ms errors {r['errors']}")
            print(f"[{mode} {point:g} r{rnd}] {s.name}: {msg}", flush=True)

    for c in args.concurrency:
        for rnd in range(args.rounds):
            one("closed", c, rnd)
    for rate in args.open_loop_rps:
        for rnd in range(args.rounds):
            one("open", rate, rnd)
    return results


def paced(sides: list[Side], pairs: int, gap_s: float) -> dict[str, Any]:
    """The ``--paced-pairs`` rounds (module docstring), or ``{"error": ...}``."""
    down = [s.name for s in sides if s.error is not None]
    if down:
        return {"error": f"{', '.join(down)} did not start"}
    urls = {s.name: s.url for s in sides}
    try:
        asyncio.run(paced_pairs(urls, MODEL, 50, gap_s, seed=1,  # warm-up, not kept:
                                offset=80_000_000))  # prompts of its own
        out = asyncio.run(paced_pairs(urls, MODEL, pairs, gap_s))
    except Exception as exc:  # noqa: BLE001 - reported, the bench goes on
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    kv, dyn = out["kvmesh"], out["dynamo"]
    out["ratio"] = {k: kv[k] / dyn[k] for k in ("p50_ms", "p90_ms", "p99_ms")}
    print(f"[paced {gap_s * 1e3:g} ms] kvmesh p50 {kv['p50_ms']:.2f} ms p99 "
          f"{kv['p99_ms']:.2f} ms errors {kv['errors']}; dynamo p50 {dyn['p50_ms']:.2f} ms "
          f"p99 {dyn['p99_ms']:.2f} ms errors {dyn['errors']}; kvmesh ÷ dynamo p50 "
          f"{out['ratio']['p50_ms']:.2f}×, paired diff p50 {out['paired_diff_p50_ms']:+.3f} ms",
          flush=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.frontend_vs_dynamo",
                                description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--words", type=int, default=240)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--open-loop-rps", default="")
    p.add_argument("--paced-pairs", type=int, default=0,
                   help="rounds of one request per side, one at a time (0: none)")
    p.add_argument("--paced-gap-ms", type=float, default=10.0)
    p.add_argument("--router", default="standalone", choices=("standalone", "embedded"))
    p.add_argument("--worker-transport", default="tcp", choices=("call", "stream", "tcp"),
                   help="kvmesh's frontend --worker-transport")
    p.add_argument("--frontends", type=int, default=1)
    p.add_argument("--no-install", action="store_true",
                   help="do not install Dynamo into .dynvenv when it is missing")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="frontend_vs_dynamo")
    args = p.parse_args(argv)
    try:
        args.concurrency = parse_list(args.concurrency, int)
        args.open_loop_rps = parse_list(args.open_loop_rps, float)
    except ValueError as exc:
        p.error(f"--concurrency / --open-loop-rps: {exc}")
    if args.frontends > 1 and args.router != "embedded":
        p.error("--frontends > 1 needs --router embedded (a router in each replica)")
    if args.paced_pairs < 0 or args.paced_gap_ms < 0:
        p.error("--paced-pairs and --paced-gap-ms must be >= 0")
    for name in ("requests", "words", "max_tokens", "rounds", "frontends"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")

    from workers.model.tiny import ensure_tiny_model

    model_dir = ensure_tiny_model()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "benchmark": "frontend_vs_dynamo", "requests": args.requests,
        "concurrency": args.concurrency, "open_loop_rps": args.open_loop_rps,
        "words": args.words, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "order": "per point and round: kvmesh then dynamo (A B A B ...)",
        "router": args.router, "frontends": args.frontends,
        "worker_transport": args.worker_transport,
        "model": {"name": MODEL, "path": str(model_dir)},
        "cpus": os.cpu_count(), "loadavg_before": os.getloadavg(), "note": NOTE,
        "versions": {"kvmesh": _git_rev(), "python": platform.python_version()}}
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        sides = [start_kvmesh(stack, args.router, args.frontends, args.worker_transport),
                 start_dynamo(stack, model_dir, not args.no_install)]
        for s in sides:
            s.info["listening"] = listeners(s.pids)
            s.info["non_loopback_listeners"] = non_loopback(s.info["listening"])
            print(f"{s.name}: {s.url or s.error}", flush=True)
        results = bench(sides, args)
        paced_out = (paced(sides, args.paced_pairs, args.paced_gap_ms / 1e3)
                     if args.paced_pairs else None)
    report["wall_s"] = time.monotonic() - t0
    report["sides"] = {s.name: {"error": s.error, "url": s.url, **s.info} for s in sides}
    dyn = report["sides"]["dynamo"].get("install", {})
    report["versions"].update(dyn.get("versions", {}))
    report["loadavg_after"] = os.getloadavg()
    report["results"] = results
    rows = rep.build_rows(results)
    report["rows"] = rows
    report["goal"] = rep.goal(rows.get("closed", []))
    if paced_out is not None:
        report["paced"] = paced_out
        met, void = rep.paced_goal(paced_out)
        report["goal"]["paced_p50_ratio_le_1"] = met
        if void is not None:
            report["paced"]["void"] = void
            print(f"[paced] void: {void}", flush=True)
    title = (f"kvmesh ({args.router} router) vs Dynamo {dyn.get('versions', {}).get('ai-dynamo')}"
             f": zero-cost engines, {args.requests} req × {args.words} words, "
             f"{args.max_tokens} tokens, {os.cpu_count()} shared cores, medians of "
             f"{args.rounds} round(s)")
    try:
        rep.plot(rows, out / f"{args.name}.png", title)
    except Exception as exc:  # noqa: BLE001 - the JSON is the result; say why no PNG
        report["plot_error"] = f"{type(exc).__name__}: {exc}"
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1, default=str))
    for mode, rs in rows.items():
        if rs:
            print(f"\n{mode} loop\n" + rep.format_table(rs, mode))
            for r in rs:
                cpu = {n: r[n]["cpu_us_per_req"] for n in rep.SIDES}
                print(f"  {r['point']:g}: CPU µs/req of each side's processes "
                      + " ".join(f"{n}={v:.0f}" if v is not None else f"{n}=—"
                                 for n, v in cpu.items()))
                for n in rep.SIDES:
                    by = r[n].get("cpu_us_per_req_by_process") or {}
                    if by:
                        print(f"     {n}: " + " ".join(f"{k}={v:.0f}" for k, v in by.items()))
    print(f"\ngoal: {report['goal']}\n-> {out}/{args.name}.json", flush=True)
    for s in sides:
        if s.error:
            print(f"{s.name} failed: {s.error[:600]}", file=sys.stderr)
    return 0


def entry() -> None:
    sys.exit(main())
