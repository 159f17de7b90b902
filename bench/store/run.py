"""kvmesh store benchmark: put/get throughput, and TTFT with store reuse vs recompute.

``python -m bench.store [--part ops,tls,ttft] [--sizes 64KiB,1MiB,4MiB,16MiB]
[--model smollm2] [--prefixes 1024,2048,4096] [--reps 3] [--tls both] [--out bench/results]``

Contracts:

- Starts its own etcd (temporary directory), a store master child (``python -m
  services.store_master``, read lease 0.5 s, no persistence) and one store node child
  (``--node-mib``), all on 127.0.0.1; stops them by their own PIDs at the end. The process
  ends with ``os._exit`` (NIXL).
- ``ops``: a :class:`StoreClient` in this process (no segment; UCX tcp,self,sm on lo, cma
  zero-copy to the node). For each object size it puts ``n`` objects (``--batch`` keys per
  ``put_many``: pipelined PutStart, one NIXL WRITE, pipelined PutEnd), then gets them
  (``get_many``), checks every byte once, and removes them. GB/s is decimal over the whole
  phase; ops/s is objects per second. A ``batch=1`` row at the smallest size gives the
  per-op latency floor (two RPCs + one transfer). Written to ``<out>/store.json``/``.png``.
- ``tls``: the master's RPCs plaintext vs mTLS, in the same run, for the modes of ``--tls``
  (``off``, ``on``, ``both`` = default). The mTLS master is a second master (and store
  node) with ``--tls-dir`` (certificates from ``write_mesh_certs``; client certificates
  required, role authorization interceptor), the bench calling as ``store_client`` (and
  ``admin`` for RemoveAll) through :func:`services.common.grpc_client.sync_channel`, as
  :class:`StoreClient` does. ``rpc``: per-RPC latency on one long-lived channel per mode,
  one call in flight, the modes alternating call by call, ``--rpc-rounds`` ×
  ``--rpc-calls`` (PutStart, PutEnd, GetReplicaList, ExistKey on 4 KiB objects; their
  Batch* forms with 8 keys: the data path, :data:`STORE_DATA_PATH`; Ping and Stats), and
  ``connect``: a fresh channel until READY (the TCP + TLS handshake); then each RPC alone
  per mode for its CPU µs per call (this process and the master). Per RPC and mode
  p50/p99/mean µs, the TLS / plaintext ratio, the cost in µs (wall p50 and CPU), and for
  the data path whether it is within 10 % (reported, never asserted). ``ops``: the ``ops`` phases
  through a StoreClient of each mode, the modes alternating per phase,
  ``--tls-ops-rounds`` times (medians; bytes move over NIXL, not TLS). Written to
  ``<out>/store_tls.json``/``.png`` (``store.json`` keeps the plaintext figures that the
  Mooncake comparison pairs with).
- ``ttft``: for each prefix length L, prompts = a shared L-token prefix + a 16-token unique
  suffix, ``max_tokens=1``, TTFT = wall time to the first output. Configurations:
  ``plain`` (engine without connector: pure recompute after a prefix-cache reset),
  ``store_miss`` (engine with the store connector, a fresh prefix: compute + save) and
  ``store_hit`` (same prefix again after a prefix-cache reset: loaded from the store);
  with ``--l1-mib`` also ``store_l1_miss`` / ``store_l1_hit`` (an engine with an L1 pool:
  saves written behind, reloads from L1), and with ``--embedded-mib`` (default 2048)
  ``store_embedded_*`` (the engine contributes a segment of its own and its objects land
  there: the topology of Mooncake's embedded mode, which vLLM's connector uses). Medians
  over ``--reps``; the miss/hit protocol
  is :class:`bench.store.reuse.ReuseProbe` (``<name>_hit_tokens``: the hit's
  ``cached_tokens``; ``<name>_same_first``: greedy first token of a full reload equals the
  computed one). With ``--mooncake-python``, ``"mooncake_connector"`` holds the same
  measurement of vLLM's own ``MooncakeStoreConnector`` on the real Mooncake Store
  (:mod:`bench.store.mooncake_vllm`, in a loopback-only netns). Written to
  ``<out>/store_ttft.json``/``.png``.
- ``--mooncake-python PY`` (a Python with ``mooncake-transfer-engine-non-cuda``, kept out
  of kvmesh's requirements): the real Mooncake Store the same way, in the same run
  (``mooncake_master`` with its HTTP metadata server, a node and a client of
  ``mooncake_peer.py``; 127.0.0.1 inside a loopback-only network namespace; TCP
  transport), under ``"mooncake"`` in ``store.json``: its rows, or the error it ended
  with; ``"ratio"`` holds kvmesh / Mooncake per (size, batch) for the rows both have.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.process import run_and_exit
from bench.tls_cost import (
    TLS_FLAG,
    connect_times_sync,
    cpu_block_sync,
    interleaved_sync,
    modes_of,
    plot_rpc,
    print_rows,
    round_order,
    summarize,
    verdict,
)
from bench.transfer.run import parse_sizes
from services.common.grpc_client import sync_channel
from services.common.tls import MeshTls, write_mesh_certs

REPO_ROOT = Path(__file__).resolve().parents[2]
UCX_ENV = {"UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo", "VLLM_HOST_IP": "127.0.0.1"}
MOONCAKE_NOTE = "not run (pass --mooncake-python)"
PEER = Path(__file__).resolve().parent / "mooncake_peer.py"


class OpsRunner:
    """One client's put/get phases (see the module docstring): source and destination
    buffers registered once, ``remove_all`` clears the master between phases."""

    def __init__(self, client: Any, biggest: int, remove_all: Callable[[], Any]) -> None:
        self.client = client
        self.remove_all = remove_all
        self.src = np.random.default_rng(0).integers(0, 255, biggest, dtype=np.uint8)
        self.dst = np.zeros_like(self.src)
        client.register(int(self.src.ctypes.data), self.src.nbytes)
        client.register(int(self.dst.ctypes.data), self.dst.nbytes)

    def phase(self, size: int, b: int, budget_bytes: int, tag: str = "") -> dict[str, Any]:
        """Puts then gets ``n`` objects of ``size`` in batches of ``b``; one row."""
        client, src, dst = self.client, self.src, self.dst
        n = max(b * 4, min(512, budget_bytes // size)) // b * b
        keys = [f"bench/{tag}{size}/{b}/{i}" for i in range(n)]
        batches = [keys[i:i + b] for i in range(0, n, b)]
        regions = [[(int(src.ctypes.data) + j * size, size)] for j in range(b)]
        out_regions = [[(int(dst.ctypes.data) + j * size, size)] for j in range(b)]
        t0 = time.perf_counter()
        for ks in batches:
            res = client.put_many(list(zip(ks, regions, strict=True)))
            assert all(r == "ok" for r in res), res
        put_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for ks in batches:
            res = client.get_many(list(zip(ks, out_regions, strict=True)))
            assert all(r == "ok" for r in res), res
        get_s = time.perf_counter() - t0
        ok = bool(np.array_equal(dst[:b * size], src[:b * size]))
        time.sleep(0.6)  # read leases (0.5 s) run out
        self.remove_all()
        return {"size": size, "batch": b, "objects": n, "verified": ok,
                "put_s": put_s, "get_s": get_s,
                "put_gbps": n * size / put_s / 1e9, "get_gbps": n * size / get_s / 1e9,
                "put_ops": n / put_s, "get_ops": n / get_s}


def _print_row(row: dict[str, Any], label: str = "") -> None:
    print(f"{label}size {row['size']:>9} batch {row['batch']:>2}: put {row['put_gbps']:.2f} "
          f"GB/s {row['put_ops']:.0f} op/s, get {row['get_gbps']:.2f} GB/s "
          f"{row['get_ops']:.0f} op/s, verified={row['verified']}", flush=True)


def ops_plan(sizes: list[int], batch: int) -> list[tuple[int, int]]:
    """(size, batch) per phase: every size at ``batch``, then the smallest at batch 1."""
    return [(s, batch) for s in sizes] + [(min(sizes), 1)]


def bench_ops(master_addr: str, sizes: list[int], batch: int, budget_bytes: int,
              client_cls: Any) -> list[dict[str, Any]]:
    """Put/get phases per size (see the module docstring)."""
    client = client_cls(master_addr, client_id="bench-ops")
    rows = []
    try:
        runner = OpsRunner(client, max(sizes) * batch,
                           lambda: client.stub.RemoveAll(client_cls_pb().RemoveAllRequest()))
        for size, b in ops_plan(sizes, batch):
            rows.append(runner.phase(size, b, budget_bytes))
            _print_row(rows[-1])
    finally:
        client.close()
    return rows


@dataclass
class Master:
    """A store master of one mode: its address, the bench's client TLS (store_client
    role) and the admin's (RemoveAll); None = plaintext."""

    address: str
    tls: MeshTls | None = None
    admin: MeshTls | None = None
    pids: tuple[int, ...] = ()  # the master's process (its CPU time)


def _median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over the rounds of one (size, batch)."""
    out = dict(rows[0])
    for k in ("put_s", "get_s", "put_gbps", "get_gbps", "put_ops", "get_ops"):
        out[k] = statistics.median(r[k] for r in rows)
    out["verified"] = all(r["verified"] for r in rows)
    out["rounds"] = len(rows)
    return out


def bench_tls_ops(masters: dict[str, Master], sizes: list[int], batch: int,
                  budget_bytes: int, client_cls: Any, rounds: int) -> dict[str, Any]:
    """The ``ops`` phases through each mode's master, the modes alternating per phase
    (ABBA) and every phase repeated ``rounds`` times: per mode the medians, and the
    TLS / insecure ratio per (size, batch)."""
    from protos import store_pb2, store_pb2_grpc

    clients, runners = {}, {}
    try:
        for mode, m in masters.items():
            clients[mode] = client_cls(m.address, client_id=f"bench-tls-{mode}", tls=m.tls)
            admin = store_pb2_grpc.StoreMasterStub(sync_channel(m.address, m.admin, "store_master"))
            runners[mode] = OpsRunner(clients[mode], max(sizes) * batch,
                                      functools.partial(admin.RemoveAll,
                                                        store_pb2.RemoveAllRequest(), timeout=30))
        samples: dict[str, dict[tuple[int, int], list[dict[str, Any]]]] = {
            mode: {} for mode in masters}
        k = 0
        for _ in range(rounds):
            for size, b in ops_plan(sizes, batch):
                for mode in round_order(list(masters), k):
                    row = runners[mode].phase(size, b, budget_bytes, tag=f"{mode}/")
                    samples[mode].setdefault((size, b), []).append(row)
                    _print_row(row, f"{mode:>8} ")
                k += 1
    finally:
        for c in clients.values():
            c.close()
    out: dict[str, Any] = {mode: [_median_row(v) for v in by.values()]
                           for mode, by in samples.items()}
    if len(masters) == 2:
        out["ratio"] = [{"size": a["size"], "batch": a["batch"],
                         **{f: b[f] / a[f] for f in ("put_gbps", "get_gbps")}}
                        for a, b in zip(out["insecure"], out["tls"], strict=True)]
    return out


CPU_BLOCK = 4  # a CPU block is this many rounds' calls: long enough to measure
STORE_DATA_PATH = ("PutStart", "PutEnd", "GetReplicaList", "ExistKey", "BatchPutStart (8)",
                   "BatchPutEnd (8)", "BatchGetReplicaList (8)", "BatchExistKey (8)")


def _rpc_calls(st: Any, tag: str, calls: int) -> dict[str, tuple[int, Callable[[int], Any]]]:
    """One round's calls of :func:`bench_rpc` on stub ``st``: per RPC (count, call(i)), in
    the protocol's order (start, end, lookup)."""
    from protos import store_pb2 as pb

    keys = [f"{tag}/{i}" for i in range(calls)]
    groups = [[f"{tag}/b{i}/{j}" for j in range(8)] for i in range(calls // 4)]
    nb = len(groups)
    return {
        "PutStart": (calls, lambda i: st.PutStart(pb.PutStartRequest(key=keys[i], size=4096))),
        "PutEnd": (calls, lambda i: st.PutEnd(pb.KeyRequest(key=keys[i]))),
        "GetReplicaList": (calls, lambda i: st.GetReplicaList(pb.KeyRequest(key=keys[i]))),
        "ExistKey": (calls, lambda i: st.ExistKey(pb.KeyRequest(key=keys[i]))),
        "BatchPutStart (8)": (nb, lambda i: st.BatchPutStart(pb.BatchPutStartRequest(
            items=[pb.PutStartRequest(key=k, size=4096) for k in groups[i]]))),
        "BatchPutEnd (8)": (nb, lambda i: st.BatchPutEnd(pb.BatchKeysRequest(keys=groups[i]))),
        "BatchGetReplicaList (8)": (nb, lambda i: st.BatchGetReplicaList(
            pb.BatchKeysRequest(keys=groups[i]))),
        "BatchExistKey (8)": (nb, lambda i: st.BatchExistKey(pb.BatchExistKeyRequest(
            keys=groups[i]))),
        "Ping": (calls // 2, lambda _: st.Ping(pb.PingRequest(client_id="bench-rpc"))),
        "Stats": (calls // 4, lambda _: st.Stats(pb.StatsRequest())),
    }


def bench_rpc(masters: dict[str, Master], rounds: int, calls: int) -> dict[str, Any]:
    """Per-RPC latency of the master's RPCs as a store client makes them (blocking stubs
    on one long-lived :func:`sync_channel` per mode, one call in flight, the modes
    alternating call by call; 4 KiB objects, batches of 8 keys) and the connect cost of a
    fresh channel."""
    from protos import store_pb2 as pb
    from protos import store_pb2_grpc

    names = [*STORE_DATA_PATH, "Ping", "Stats"]
    samples: dict[str, dict[str, list[float]]] = {n: {m: [] for m in masters} for n in names}
    connect: dict[str, dict[str, list[float]]] = {"connect: channel to READY (master)": {
        m: [] for m in masters}}
    stubs = {mode: store_pb2_grpc.StoreMasterStub(sync_channel(m.address, m.tls, "store_master"))
             for mode, m in masters.items()}
    for r in range(rounds):
        plans = {mode: _rpc_calls(st, f"rpc/{mode}/{r}", calls) for mode, st in stubs.items()}
        for name in names:
            n = plans[next(iter(plans))][name][0]
            got = interleaved_sync(n, {mode: plan[name][1] for mode, plan in plans.items()})
            for mode, secs in got.items():
                samples[name][mode] += secs
        for i in range(5):
            for mode in round_order(list(masters), i):
                m = masters[mode]
                connect["connect: channel to READY (master)"][mode] += connect_times_sync(
                    1, functools.partial(sync_channel, m.address, m.tls,
                                         "store_master"))
    cpu: dict[str, dict[str, dict[str, float]]] = {n: {} for n in names}
    plans = {mode: _rpc_calls(st, f"cpu/{mode}", calls * CPU_BLOCK) for mode, st in
             stubs.items()}
    for name in names:  # CPU per call, each mode alone
        for mode in masters:
            n, call = plans[mode][name]
            cpu[name][mode] = cpu_block_sync(n, call, masters[mode].pids)
    time.sleep(0.6)  # read leases (0.5 s) run out
    for m in masters.values():
        store_pb2_grpc.StoreMasterStub(sync_channel(m.address, m.admin, "store_master")).RemoveAll(
            pb.RemoveAllRequest(), timeout=30)
    rows = summarize(samples, STORE_DATA_PATH, cpu)
    conn = summarize(connect)
    print_rows(rows, f"store master per RPC ({rounds} rounds x {calls} calls, one in flight):")
    print_rows(conn, "connect (a fresh channel, once per long-lived channel):")
    return {"rounds": rounds, "calls_per_round": calls, "rows": rows, "connect": conn,
            "data_path": list(STORE_DATA_PATH), "data_path_within_10pct": verdict(rows),
            "data_path_cpu_within_10pct": verdict(rows, "cpu_within_10pct")}


def run_in_loopback_netns(python: str, argv: list[str], timeout_s: int) -> dict[str, Any]:
    """``python *argv`` in a network namespace of its own with only loopback up
    (``unshare -rn``): the last JSON object line it prints, plus the Mooncake version and
    the namespace, or ``{"error": ...}``. Mooncake binds wildcard listeners whatever it is
    told; the namespace keeps them off the host's interfaces (no namespace: not run).
    Lines starting with ``mooncake `` (progress) are echoed."""
    import shutil
    import subprocess

    if not shutil.which("unshare"):
        return {"error": "unshare(1) missing: Mooncake is only run in a loopback-only netns"}
    cmd = ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *argv]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s} s"}
    for ln in proc.stdout.splitlines():
        if ln.startswith("mooncake "):
            print(ln, flush=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"}
    return {"version": _mooncake_version(python), "netns": "unshare -rn (loopback only)",
            **json.loads(lines[-1])}


def bench_mooncake(python: str, sizes: list[int], batch: int, node_mib: int,
                   budget: int) -> dict[str, Any]:
    """``mooncake_peer.py bench`` (master, node, clients) in a loopback-only netns."""
    out = run_in_loopback_netns(python, [
        python, str(PEER), "bench", ",".join(map(str, sizes)), str(batch), str(budget),
        str(node_mib)], 900)
    return out if "error" in out else {"protocol": "tcp", **out}


def _mooncake_version(python: str) -> str:
    import subprocess

    code = ("import importlib.metadata as m; "
            "print(m.version('mooncake-transfer-engine-non-cuda'))")
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    return "mooncake-transfer-engine-non-cuda==" + (proc.stdout.strip() or "?")


def ratios(ours: list[dict[str, Any]], theirs: Any) -> list[dict[str, Any]]:
    """kvmesh / Mooncake for each (size, batch) both measured without error."""
    if not isinstance(theirs, list):
        return []
    by_shape = {(r["size"], r["batch"]): r for r in theirs if "error" not in r}
    out = []
    for r in ours:
        m = by_shape.get((r["size"], r["batch"]))
        if m is not None:
            out.append({"size": r["size"], "batch": r["batch"],
                        **{k: r[k] / m[k] for k in ("put_gbps", "get_gbps", "put_ops",
                                                     "get_ops")}})
    return out


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1))


def client_cls_pb() -> Any:
    from protos import store_pb2

    return store_pb2


async def bench_ttft(master_addr: str, model: str, prefixes: list[int], reps: int,
                     kv_gib: float, l1_mib: int = 0,
                     mooncake_python: str = "", embedded_mib: int = 0) -> dict[str, Any]:
    """TTFT per configuration and prefix length (see the module docstring)."""
    from bench.store.reuse import ReuseProbe, vocab_of
    from workers.engines.vllm_engine import VllmEngine, VllmEngineConfig
    from workers.kv.configs import store_kv_transfer_config

    path = resolve_model(model)
    probe = ReuseProbe(random.Random(0), vocab_of(path))
    max_len = max(prefixes) + 64

    def config(ktc: dict[str, Any] | None) -> VllmEngineConfig:
        return VllmEngineConfig(model_path=str(path), max_model_len=max_len, block_size=32,
                                kv_cache_space_gib=kv_gib, seed=0, kv_transfer_config=ktc,
                                env=dict(UCX_ENV))

    result: dict[str, Any] = {"model": str(path), "prefixes": prefixes, "reps": reps,
                              "plain": {}}
    plain = VllmEngine(config(None))
    await plain.start()
    try:
        await probe.first_token(plain, probe.tokens(64))  # warm-up
        for n in prefixes:
            samples = []
            for _ in range(reps):
                await plain.reset_prefix_cache()
                samples.append((await probe.first_token(
                    plain, probe.tokens(n) + probe.tokens(16))).ttft_s)
            result["plain"][n] = statistics.median(samples)
            print(f"plain {n}: {result['plain'][n] * 1e3:.0f} ms", flush=True)
    finally:
        await plain.shutdown()
    variants: list[tuple[str, dict[str, Any]]] = [("store", {})]
    if l1_mib:
        variants.append(("store_l1", {"l1_mib": l1_mib}))
    if embedded_mib:
        variants.append(("store_embedded", {"segment_mib": embedded_mib}))
    for name, extra in variants:
        eng = VllmEngine(config(store_kv_transfer_config(master_addr, extra=extra)))
        await eng.start()
        try:
            await probe.first_token(eng, probe.tokens(64))
            await probe.miss_then_hit(eng, name, prefixes, reps, result)
        finally:
            await eng.shutdown()
    if mooncake_python:
        result["mooncake_connector"] = await asyncio.to_thread(
            mooncake_connector_ttft, mooncake_python, str(path), prefixes, reps, kv_gib)
        result["hit_ratio_vs_mooncake"] = ttft_ratios(result)
    return result


def ttft_ratios(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """kvmesh hit TTFT / vLLM MooncakeStoreConnector hit TTFT, per variant and prefix."""
    theirs = {str(k): float(v) for k, v in
              ((result.get("mooncake_connector") or {}).get("mooncake_hit") or {}).items()}
    out: dict[str, dict[str, float]] = {}
    for name in ("store", "store_l1", "store_embedded"):
        ours = {str(k): float(v) for k, v in (result.get(f"{name}_hit") or {}).items()}
        out[name] = {k: v / theirs[k] for k, v in ours.items() if theirs.get(k)}
    return out


def mooncake_connector_ttft(python: str, model: str, prefixes: list[int], reps: int,
                            kv_gib: float) -> dict[str, Any]:
    """:mod:`bench.store.mooncake_vllm` (vLLM's MooncakeStoreConnector) in a loopback-only
    netns."""
    out = run_in_loopback_netns(python, [
        sys.executable, "-m", "bench.store.mooncake_vllm", "--mooncake-python", python,
        "--model", model, "--prefixes", ",".join(map(str, prefixes)), "--reps", str(reps),
        "--kv-gib", str(kv_gib)], 1800)
    return out if "error" in out else {"connector": "MooncakeStoreConnector", **out}


def resolve_model(model: str) -> Path:
    if model == "tiny":
        from workers.model.tiny import ensure_tiny_model

        return Path(ensure_tiny_model())
    if model == "smollm2":
        from workers.model.prepare import prepare_smollm2

        return Path(prepare_smollm2(progress=False))
    return Path(model)


def plot(out: Path, ops: list[dict[str, Any]] | None, ttft: dict[str, Any] | None,
         mooncake: Any = None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG", file=sys.stderr)
        return
    if ops:
        rows = [r for r in ops if r["batch"] > 1]
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = [r["size"] for r in rows]
        ax.plot(xs, [r["put_gbps"] for r in rows], "o-",
                label="kvmesh put (BatchPutStart+NIXL WRITE+BatchPutEnd)")
        ax.plot(xs, [r["get_gbps"] for r in rows], "s-",
                label="kvmesh get (BatchGetReplicaList+NIXL READ)")
        theirs = mooncake.get("preferred_node") if isinstance(mooncake, dict) else None
        if isinstance(theirs, list):
            mrows = [r for r in theirs if r["batch"] > 1 and "error" not in r]
            mx = [r["size"] for r in mrows]
            ax.plot(mx, [r["put_gbps"] for r in mrows], "o--", label="Mooncake Store put (tcp)")
            ax.plot(mx, [r["get_gbps"] for r in mrows], "s--", label="Mooncake Store get (tcp)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("object size (bytes)")
        ax.set_ylabel("GB/s")
        ax.set_title("store put/get, one store node, 127.0.0.1 (batch "
                     f"{rows[0]['batch'] if rows else '?'})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "store.png", dpi=120)
        plt.close(fig)
    if ttft:
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = ttft["prefixes"]
        mc = ttft.get("mooncake_connector") or {}
        series = {**ttft, **{k: v for k, v in mc.items() if k.startswith("mooncake_")}}
        for name, mark in (("plain", "o-"), ("store_miss", "^-"), ("store_hit", "s-"),
                           ("store_l1_miss", "v--"), ("store_l1_hit", "D--"),
                           ("store_embedded_miss", "<-."), ("store_embedded_hit", ">-."),
                           ("mooncake_miss", "^:"), ("mooncake_hit", "s:")):
            vals = series.get(name)
            if isinstance(vals, dict) and vals:
                label = name.replace("mooncake", "vLLM MooncakeStoreConnector")
                by_len = {int(k): float(v) for k, v in vals.items()}  # JSON keys are str
                ms = [by_len.get(int(n), float("nan")) * 1e3 for n in xs]
                ax.plot(xs, ms, mark, label=label)
        ax.set_yscale("log")  # hits are ~50x below misses
        ax.set_xlabel("shared prefix (tokens)")
        ax.set_ylabel("TTFT (ms, median, log scale)")
        ax.set_title(f"TTFT: store reuse vs recompute ({Path(ttft['model']).name})")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(out / "store_ttft.png", dpi=120)
        plt.close(fig)


def plot_tls(out: Path, report: dict[str, Any]) -> None:
    """``store_tls.png``: per-RPC p50 of both modes, and put/get GB/s per mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG", file=sys.stderr)
        return
    rpc, ops = report.get("rpc"), report.get("ops")
    panels = [x for x in (rpc, ops) if x]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    ax = list(axes[0])
    if rpc:
        plot_rpc(ax[0], rpc["rows"], "store master per RPC: insecure vs mTLS (* data path)")
    if ops:
        a = ax[-1]
        for mode, style in (("insecure", "-"), ("tls", "--")):
            rows = [r for r in ops.get(mode) or [] if r["batch"] > 1]
            xs = [r["size"] for r in rows]
            a.plot(xs, [r["put_gbps"] for r in rows], "o" + style, label=f"put ({mode})")
            a.plot(xs, [r["get_gbps"] for r in rows], "s" + style, label=f"get ({mode})")
        a.set_xscale("log", base=2)
        a.set(xlabel="object size (bytes)", ylabel="GB/s",
              title="put/get, insecure vs mTLS master RPCs (bytes over NIXL)")
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "store_tls.png", dpi=110)
    plt.close(fig)


def start_master(tmp: Path, etcd_address: str, namespace: str,
                 tls_dir: str = "") -> tuple[Any, str]:
    """A ``services.store_master`` child (read lease 0.5 s, no persistence); with
    ``tls_dir`` mTLS + role authorization. Returns (child, address)."""
    from services.common.procs import free_port, port_open, spawn, wait_until

    port = free_port()
    child = spawn(f"store-master-{namespace}", [
        sys.executable, "-m", "services.store_master", "--etcd-endpoint", etcd_address,
        "--namespace", namespace, "--port", str(port), "--read-lease-ttl-s", "0.5",
        "--persist", "none", *(["--tls-dir", tls_dir] if tls_dir else [])], tmp)
    wait_until(lambda: port_open("127.0.0.1", port), child, 60, "store master")
    return child, f"127.0.0.1:{port}"


async def amain(args: argparse.Namespace) -> int:
    from services.common.procs import start_etcd
    from workers.kv.store_client import StoreClient
    from workers.store_node import StoreNodeProcess

    os.environ.update(UCX_ENV)
    parts = set(args.part.split(","))
    out = Path(args.out)
    meta: dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(), "ucx": UCX_ENV,
            "mooncake": MOONCAKE_NOTE, "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        etcd = start_etcd(Path(tmp), Path(tmp))
        children: list[Any] = []  # stopped newest first
        try:
            master, addr = start_master(Path(tmp), etcd.address, "benchstore")
            children.append(master)
            children.append(await asyncio.to_thread(StoreNodeProcess, addr, args.node_mib,
                                                    env=UCX_ENV))
            ops = ttft = None
            if "ops" in parts:
                ops = await asyncio.to_thread(bench_ops, addr, parse_sizes(args.sizes),
                                              args.batch, args.node_mib << 19, StoreClient)
                if args.mooncake_python:
                    mc = await asyncio.to_thread(
                        bench_mooncake, args.mooncake_python, parse_sizes(args.sizes),
                        args.batch, args.node_mib, args.node_mib << 19)
                    mc["ratio"] = ratios(ops, mc.get("preferred_node"))
                    meta["mooncake"] = mc
                    for r in mc["ratio"]:
                        print(f"kvmesh/mooncake size {r['size']:>9} batch {r['batch']:>2}: "
                              f"put {r['put_gbps']:.2f}x, get {r['get_gbps']:.2f}x", flush=True)
                write_json(out / "store.json", {**meta, "rows": ops})
            if "tls" in parts:
                modes = modes_of(args.tls)
                masters: dict[str, Master] = {}
                if "insecure" in modes:
                    masters["insecure"] = Master(addr, pids=(master.pid,))
                if "tls" in modes:
                    certs = Path(tmp) / "certs"
                    write_mesh_certs(certs)
                    tls_master, tls_addr = start_master(Path(tmp), etcd.address,
                                                        "benchstoretls", str(certs))
                    children.append(tls_master)
                    children.append(await asyncio.to_thread(
                        StoreNodeProcess, tls_addr, args.node_mib,
                        env={**UCX_ENV, "KVMESH_TLS_DIR": str(certs)}))
                    masters["tls"] = Master(tls_addr, MeshTls.load(certs, "store_client"),
                                            MeshTls.load(certs, "admin"), (tls_master.pid,))
                report: dict[str, Any] = {**meta, "tls": args.tls, "modes": list(modes)}
                load_before = os.getloadavg()
                report["rpc"] = await asyncio.to_thread(bench_rpc, masters, args.rpc_rounds,
                                                        args.rpc_calls)
                if args.tls_ops_rounds > 0:
                    report["ops"] = await asyncio.to_thread(
                        bench_tls_ops, masters, parse_sizes(args.sizes), args.batch,
                        args.node_mib << 19, StoreClient, args.tls_ops_rounds)
                report["loadavg_1_5_15"] = {"before": load_before, "after": os.getloadavg()}
                write_json(out / "store_tls.json", report)
                await asyncio.to_thread(plot_tls, out, report)
            if "ttft" in parts:
                if args.mooncake_python and "ops" not in parts:
                    meta["mooncake"] = "ops not run; see mooncake_connector"
                prefixes = [int(x) for x in args.prefixes.split(",")]
                ttft = await bench_ttft(addr, args.model, prefixes, args.reps, args.kv_gib,
                                        args.l1_mib, args.mooncake_python,
                                        args.embedded_mib)
                write_json(out / "store_ttft.json", {**meta, **ttft})
            await asyncio.to_thread(plot, out, ops, ttft, meta["mooncake"])
        finally:
            for child in reversed(children):
                child.stop()
            etcd.stop()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.store")
    p.add_argument("--part", default="ops,tls,ttft")
    p.add_argument("--sizes", default="64KiB,256KiB,1MiB,4MiB,16MiB")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--node-mib", type=int, default=1024)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prefixes", default="1024,2048,4096")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kv-gib", type=float, default=1.0)
    p.add_argument("--l1-mib", type=int, default=512,
                   help="also measure an engine with an L1 pool of this size (0: skip)")
    p.add_argument("--embedded-mib", type=int, default=2048,
                   help="also measure an engine contributing a segment of this size, where "
                        "its own objects land (Mooncake's embedded mode; 0: skip)")
    p.add_argument("--mooncake-python", default="",
                   help="Python of an environment with mooncake-transfer-engine-non-cuda")
    p.add_argument("--tls", default="both", choices=tuple(TLS_FLAG),
                   help="part tls: plaintext master, mTLS master (--tls-dir: certificates + "
                        "role authorization), or both side by side, interleaved")
    p.add_argument("--rpc-rounds", type=int, default=6, help="part tls: per-RPC rounds")
    p.add_argument("--rpc-calls", type=int, default=200, help="part tls: calls per round")
    p.add_argument("--tls-ops-rounds", type=int, default=3,
                   help="part tls: rounds of the put/get phases per mode (0: skip)")
    p.add_argument("--out", default=str(REPO_ROOT / "bench" / "results"))
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return asyncio.run(amain(args))


def entry() -> None:
    """Process entry: :func:`main` through :func:`bench.process.run_and_exit`."""
    run_and_exit(main)
