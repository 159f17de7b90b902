"""What each mesh adds to a request over a direct call to one of its workers, kvmesh and
Dynamo 1.6.1 side by side in one run: issue 17's added-latency goal (mesh − direct worker
call) measured on Dynamo too.

``python -m bench.frontend_vs_dynamo.added [--pairs 600] [--gap-ms 10] [--workers 2]
[--no-install] [--seed 0] [--out bench/results] [--name added_vs_dynamo]``

Contracts:

- Starts, as child processes on free loopback ports (every one stopped by PID at the end):
  kvmesh's mesh as :func:`bench.router_overhead.run.start_mesh` starts it with the router
  embedded (etcd, Redis, one fleet of ``--workers`` zero-timing mock workers, the
  frontend); Dynamo's (:class:`~.dynamo_side.DynamoMesh`: ``dynamo.frontend --router-mode
  kv`` and ``--workers`` × ``dynamo.mocker`` at speedup 10000 on the tiny model's folder;
  ``.dynvenv`` installed on demand unless ``--no-install``); and Dynamo's direct caller
  (:mod:`.dynamo_direct`, run by ``.dynvenv``'s Python in the mesh's discovery folder);
  and the **floor**: :mod:`bench.mesh_profile.proxy_floor` in front of kvmesh's first
  worker (the least Python a frontend hop can be: HTTP parsed, one frame to the worker's
  request plane, the answer written; no routing, checks, metrics or tracing).
- Five calls, each of a 64-token prompt (:func:`bench.router_overhead.run.prompt`: a
  shared 32-token head) and one output token, temperature 0:
  - ``kvmesh_direct``: a worker's TCP request plane (the frontend's own carrier), round
    robin, from :class:`~bench.router_overhead.lean.PlaneClient`;
  - ``kvmesh_http``: ``POST /v1/completions`` to kvmesh's frontend
    (:class:`~bench.router_overhead.lean.LeanHttp`);
  - ``dynamo_direct``: ``client.round_robin`` of a mocker's ``generate`` endpoint on
    Dynamo's request plane (what Dynamo's frontend calls), timed in the direct caller;
  - ``dynamo_http``: the same POST to Dynamo's frontend;
  - ``floor_http``: the same POST to the floor.
  The three HTTP calls and kvmesh's direct call are timed in this process (send → whole
  answer); Dynamo's runtime client exists only in ``.dynvenv``, so its direct call is
  timed in that process, which this one commands over a pipe (outside the timing).
- Load: 40 warm-up rounds, then ``--pairs`` rounds; each round makes the five calls once,
  in a random order (seeded), each ``--gap-ms`` after the answer before it (one request
  at a time, as at 100 req/s without overlap: ``bench.router_overhead --paced`` found
  kvmesh's added latency as large one at a time as at 100 req/s). A failed call is counted, not
  timed; more than 1 % failed calls of any kind fail the bench.
- Reports per call p50 / p90 / p99 / mean ms, errors, and the client's CPU µs per direct
  call (median; this process's for kvmesh's, the direct caller's, with Dynamo's runtime
  threads, for Dynamo's: what each anchor's own client costs); per system (``kvmesh``,
  ``dynamo``, and ``floor`` over kvmesh's direct call) ``added_p50_ms`` (HTTP p50 −
  direct p50), ``added_p99_ms`` and ``paired_added_p50_ms`` (the median over rounds
  where both answered of HTTP − direct); and ``kvmesh_over_dynamo`` of those. Writes
  ``<out>/<name>.json`` and a PNG (each call's latency distribution). Only on this
  machine's loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.frontend_vs_dynamo.dynamo_side import (
    DYNVENV,
    DynamoError,
    DynamoMesh,
    dynamo_env,
    ensure_dynvenv,
)
from bench.router_overhead.lean import LeanHttp, PlaneClient
from bench.router_overhead.run import (
    MODEL,
    PORT,
    Rounds,
    Timed,
    paced_rounds,
    prompt,
    start_mesh,
    start_server,
)
from protos import common_pb2, worker_pb2

RESULTS = Path(__file__).resolve().parents[1] / "results"
DIRECT = Path(__file__).with_name("dynamo_direct.py")
ENDPOINT = "dynamo.backend.generate"  # dynamo.mocker's default
CALLS = ("kvmesh_direct", "kvmesh_http", "dynamo_direct", "dynamo_http", "floor_http")
# system: (its HTTP call, the direct call it is measured over)
SYSTEMS = {"kvmesh": ("kvmesh_http", "kvmesh_direct"), "dynamo": ("dynamo_http", "dynamo_direct"),
           "floor": ("floor_http", "kvmesh_direct")}
WARMUP_ROUNDS = 40
CALL_TIMEOUT_S = 30.0
MAX_ERROR_SHARE = 0.01
NOTE = ("The two HTTP calls are the same client and request. The direct calls are not: "
        "Dynamo's request plane has no client outside its Rust frontend but its Python "
        "binding, whose CPU per call (client_cpu_us_p50) is several times the lean "
        "request-plane client's; what an anchor's client costs beyond the other's "
        "inflates that anchor and shrinks its system's added latency by as much.")


class DirectCaller:
    """The direct caller child (:mod:`.dynamo_direct`): ``await start()`` (the child
    killed by PID when it does not come up), then ``await call(token_ids)`` → (seconds,
    CPU seconds) as it timed them (raises RuntimeError with its error, DynamoError when no
    answer to this call came in :data:`CALL_TIMEOUT_S`: a late answer to a call given up
    on, or any line that is no answer, is skipped by its id), ``await close()`` (quit,
    then killed by PID if it has not exited)."""

    def __init__(self, python: str, env: dict[str, str], log: Path) -> None:
        self._argv = [python, str(DIRECT), ENDPOINT]
        self._env, self._log = env, log
        self._proc: asyncio.subprocess.Process | None = None
        self.pid: int | None = None  # the child's, once started
        self._calls = 0

    async def start(self, timeout_s: float = 120.0) -> None:
        self._log.parent.mkdir(parents=True, exist_ok=True)
        with self._log.open("wb") as err:
            self._proc = await asyncio.create_subprocess_exec(
                *self._argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=err, env=self._env)
        self.pid = self._proc.pid
        try:
            await self._answer(lambda a: a.get("ready") is True, timeout_s, "ready")
        except BaseException:
            await self.close(kill=True)
            raise

    async def _answer(self, wanted: Callable[[dict[str, Any]], bool], timeout_s: float,
                      what: str) -> dict[str, Any]:
        """The next line of the child's that ``wanted`` accepts (others are skipped)."""
        assert self._proc is not None and self._proc.stdout is not None
        try:
            async with asyncio.timeout(timeout_s):
                while line := await self._proc.stdout.readline():
                    with contextlib.suppress(ValueError):
                        answer = json.loads(line)
                        if isinstance(answer, dict) and wanted(answer):
                            return answer
        except TimeoutError:
            raise DynamoError(f"the direct caller gave no {what} in {timeout_s:g} s; its "
                              f"log: {self._tail()}") from None
        raise DynamoError(f"the direct caller exited; its log: {self._tail()}")

    def _tail(self) -> str:
        with contextlib.suppress(OSError):
            return self._log.read_text(errors="replace")[-1500:]
        return "(none)"

    async def call(self, token_ids: list[int]) -> tuple[float, float]:
        assert self._proc is not None and self._proc.stdin is not None
        self._calls += 1
        k = self._calls
        self._proc.stdin.write(json.dumps({"op": "call", "id": k, "token_ids": token_ids,
                                           "max_tokens": 1}).encode() + b"\n")
        await self._proc.stdin.drain()
        answer = await self._answer(lambda a: a.get("id") == k, CALL_TIMEOUT_S,
                                    f"answer to call {k}")
        if not answer.get("ok"):
            raise RuntimeError(str(answer.get("error")))
        return float(answer["s"]), float(answer["cpu_s"])

    async def close(self, kill: bool = False) -> None:
        """Asks the child to quit (``kill``: kills it at once) and waits for it; killed by
        PID after 10 s."""
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        if kill:
            proc.kill()
        else:
            with contextlib.suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.write(b'{"op": "quit"}\n')
                proc.stdin.close()
        try:
            async with asyncio.timeout(10):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()


def _ms(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q) * 1e3) if values else float("nan")


def summarize(timed: dict[str, Rounds]) -> dict[str, Any]:
    """The report's numbers (see the module docstring) from what
    :func:`~bench.router_overhead.run.paced_rounds` gave."""
    calls: dict[str, Any] = {}
    by_round: dict[str, dict[int, float]] = {}
    for name, rows in timed.items():
        ok = [r for r in rows if r is not None]
        lat = [r[1] for r in ok]
        cpus = [r[2] for r in ok if r[2] is not None]
        by_round[name] = {r[0]: r[1] for r in ok}
        calls[name] = {"sent": len(rows), "ok": len(ok), "errors": len(rows) - len(ok),
                       "p50_ms": _ms(lat, 50), "p90_ms": _ms(lat, 90), "p99_ms": _ms(lat, 99),
                       "mean_ms": float(np.mean(lat) * 1e3) if lat else float("nan")}
        if cpus:
            calls[name]["client_cpu_us_p50"] = float(np.median(cpus) * 1e6)
    systems: dict[str, Any] = {}
    for system, (http_name, direct_name) in SYSTEMS.items():
        if http_name not in calls:
            continue
        http, direct = calls[http_name], calls[direct_name]
        a, b = by_round[http_name], by_round[direct_name]
        diffs = [a[i] - b[i] for i in a if i in b]
        systems[system] = {
            "added_p50_ms": http["p50_ms"] - direct["p50_ms"],
            "added_p99_ms": http["p99_ms"] - direct["p99_ms"],
            "paired_added_p50_ms": float(np.median(diffs) * 1e3) if diffs else float("nan")}
    ratio = {k: (systems["kvmesh"][k] / systems["dynamo"][k]
                 if systems["dynamo"][k] > 0 else None) for k in systems["dynamo"]}
    return {"calls": calls, "added": systems, "kvmesh_over_dynamo": ratio}


def check_errors(timed: dict[str, Rounds]) -> None:
    """Raises RuntimeError when a call failed more than :data:`MAX_ERROR_SHARE` of times."""
    for name, rows in timed.items():
        failed = sum(r is None for r in rows)
        if rows and failed > MAX_ERROR_SHARE * len(rows):
            raise RuntimeError(f"{name}: {failed} of {len(rows)} calls failed")


def plot(timed: dict[str, Rounds],
         report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, rows in timed.items():
        lat = sorted(r[1] * 1e3 for r in rows if r is not None)
        if lat:
            ax.plot(lat, np.linspace(0, 1, len(lat)), label=name)
    added = report["added"]
    floor = (f", the floor {added['floor']['added_p50_ms']:.2f} ms" if "floor" in added
             else "")
    ax.set_title(f"one at a time: added p50 kvmesh {added['kvmesh']['added_p50_ms']:.2f} ms, "
                 f"Dynamo {added['dynamo']['added_p50_ms']:.2f} ms{floor}", fontsize=10)
    ax.set_xlabel("latency, send → whole answer (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_xlim(0, max(4.0, report["calls"]["kvmesh_http"]["p99_ms"] * 1.2))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def measure(kv_url: str, kv_planes: list[str], dyn_url: str, caller: DirectCaller,
                  pairs: int, gap_s: float, seed: int, floor_url: str | None = None
                  ) -> dict[str, Rounds]:
    """Connects the clients, warms up, runs
    :func:`~bench.router_overhead.run.paced_rounds`."""
    planes = [PlaneClient(a) for a in kv_planes]
    for plane in planes:
        await plane.connect()
    https = {}
    urls = {"kvmesh": kv_url, "dynamo": dyn_url}
    if floor_url is not None:
        urls["floor"] = floor_url
    for name, url in urls.items():
        host, _, port = url.removeprefix("http://").rpartition(":")
        https[name] = LeanHttp(host, int(port))

    async def kv_direct(i: int) -> tuple[float, float | None]:
        req = worker_pb2.GenerateRequest(
            request_id=f"a{i}-{time.monotonic_ns()}", token_ids=prompt(i), model=MODEL,
            sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0))
        cpu0, t0 = time.process_time(), time.perf_counter()
        await planes[i % len(planes)].generate(req)
        return time.perf_counter() - t0, time.process_time() - cpu0

    def http_call(http: LeanHttp) -> Timed:
        async def call(i: int) -> tuple[float, float | None]:
            body = {"model": MODEL, "prompt": prompt(i), "max_tokens": 1, "temperature": 0}
            t0 = time.perf_counter()
            answer = json.loads(await http.post("/v1/completions", body))
            took = time.perf_counter() - t0
            if answer["usage"]["completion_tokens"] != 1:
                raise RuntimeError(f"not one token: {answer['usage']}")
            return took, None
        return call

    async def dyn_direct(i: int) -> tuple[float, float | None]:
        return await caller.call(prompt(i))

    calls: dict[str, Timed] = {"kvmesh_direct": kv_direct,
                               "kvmesh_http": http_call(https["kvmesh"]),
                               "dynamo_direct": dyn_direct,
                               "dynamo_http": http_call(https["dynamo"])}
    if "floor" in https:
        calls["floor_http"] = http_call(https["floor"])
    try:
        await paced_rounds(calls, WARMUP_ROUNDS, gap_s, seed + 1)
        return await paced_rounds(calls, pairs, gap_s, seed)
    finally:
        for http in https.values():
            http.close()
        for plane in planes:
            await plane.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from workers.model.tiny import ensure_tiny_model

    if args.no_install and not (DYNVENV / "bin" / "python").exists():
        raise DynamoError(".dynvenv is missing and --no-install was given")
    install = ensure_dynvenv()
    model_dir = ensure_tiny_model()
    load_before = os.getloadavg()
    with contextlib.ExitStack() as stack:
        kv = start_mesh(stack, "insecure", argparse.Namespace(
            router="embedded", workers=args.workers, policy="kv", indexer="embedded"))
        dyn = stack.enter_context(DynamoMesh(install["python"], model_dir, MODEL,
                                             workers=args.workers))
        caller = DirectCaller(install["python"], dynamo_env(dyn.tmp / "kv"),
                              dyn.tmp / "logs" / "direct-caller.log")
        # the floor (module docstring) in front of kvmesh's first worker
        floor_url = start_server(stack, "proxy-floor", "bench.mesh_profile.proxy_floor",
                                 [PORT, kv.planes[0]], dyn.tmp / "logs")

        async def go() -> dict[str, Rounds]:
            try:
                await caller.start()
                return await measure(kv.url, kv.planes, dyn.url, caller, args.pairs,
                                     args.gap_ms / 1e3, args.seed, floor_url)
            finally:
                await caller.close()
        timed = asyncio.run(go())
    check_errors(timed)
    report = {"benchmark": "added_vs_dynamo", "pairs": args.pairs, "gap_ms": args.gap_ms,
              "workers": args.workers, "engines": "kvmesh: mock, zero timing; Dynamo: "
              "dynamo.mocker, speedup 10000", "router": "kvmesh: embedded kv; Dynamo: kv",
              "cpus": os.cpu_count(), "versions": install.get("versions"),
              "loadavg_1_5_15": {"before": load_before, "after": os.getloadavg()},
              "note": NOTE, **summarize(timed)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(timed, report, out / f"{args.name}.png")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.frontend_vs_dynamo.added",
                                description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=600)
    p.add_argument("--gap-ms", type=float, default=10.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-install", action="store_true",
                   help="fail instead of installing Dynamo into .dynvenv")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="added_vs_dynamo")
    args = p.parse_args(argv)
    report = run(args)
    print(json.dumps({k: report[k] for k in ("added", "kvmesh_over_dynamo")}, indent=2))
    print(f"-> {Path(args.out) / args.name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
