"""The real Mooncake Store measured like :func:`bench.store.run.bench_ops` (same machine).

Run by :mod:`bench.store.run` with the Python of a separate environment holding
``mooncake-transfer-engine-non-cuda`` (``--mooncake-python``; it is not a kvmesh
requirement), and with no kvmesh import: ``python bench/store/mooncake_peer.py ROLE ...`` (not named
mooncake.py: its folder comes first on sys.path and would shadow the package).

- ``bench SIZES BATCH BUDGET NODE_MIB``: the whole comparison: starts ``mooncake_master``
  (found next to this Python, HTTP metadata server, read lease 0.5 s), one ``node`` child
  and two ``client`` runs (``preferred_node``: objects in the node's segment, as kvmesh's
  store node holds them; ``default``: the master's choice), stops its children by PID and
  prints one JSON object ``{"preferred_node": rows | {"error"}, "default": ...}``.
  :mod:`bench.store.run` runs it inside a network namespace of its own that has only
  loopback (``unshare -rn``): Mooncake 0.3.13's transfer-engine RPC and TCP data listeners
  and the master's HTTP metadata server bind the wildcard address whatever they are told,
  so the namespace is what keeps them off the host's interfaces. With
  ``MC_LEGACY_RPC_PORT_BINDING=1`` every advertised address is 127.0.0.1.
- ``node MASTER META SEG_MIB HOST:PORT``: a MooncakeDistributedStore contributing a
  SEG_MIB global segment under that name (the counterpart of ``kvmesh store-node``);
  prints ``ready`` and waits on stdin.
- ``client MASTER META SIZES BATCH BUDGET NODE``: a client with the minimum global segment
  Mooncake accepts (16 MiB) and ``preferred_segment=NODE`` so objects land in the node,
  with a registered buffer; per size, ``put_from`` /
  ``get_into`` (batch 1) or ``batch_put_from`` / ``batch_get_into`` (batch > 1), checks
  the bytes, removes the keys; prints one JSON line of rows like ``bench_ops``.
Protocol "tcp" (Mooncake's transfer engine; no RDMA here).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def make_store(master: str, meta: str, seg_bytes: int, local_bytes: int,
               hostname: str = "127.0.0.1") -> object:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    # Positional form: (local_hostname, metadata_server, global_segment_size,
    # local_buffer_size, protocol, device_name, master_server_addr).
    rc = store.setup(hostname, meta, seg_bytes, local_bytes, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup failed: {rc}")
    return store


def node(master: str, meta: str, seg_mib: int, hostname: str) -> None:
    # Keep the reference: a collected store tears itself down and unmounts its segment
    # (the master then allocates from the client's own small segment only).
    store = make_store(master, meta, seg_mib << 20, 16 << 20, hostname)
    print("ready", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    del store


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def client(master: str, meta: str, sizes: list[int], batch: int, budget: int,
           node_segment: str) -> None:
    from mooncake.store import ReplicateConfig

    # a name of its own: "127.0.0.1" alone collides with the node's on one host
    own = f"127.0.0.1:{free_port()}"
    store = make_store(master, meta, 16 << 20, max(sizes) * batch + (16 << 20), own)
    cfg = ReplicateConfig()
    if node_segment != "-":
        cfg.preferred_segment = node_segment  # the node's memory, not the client's own
    biggest = max(sizes) * batch
    src = np.random.default_rng(0).integers(0, 255, biggest, dtype=np.uint8)
    dst = np.zeros_like(src)
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    for buf in (src, dst):
        rc = store.register_buffer(int(buf.ctypes.data), buf.nbytes)  # type: ignore[attr-defined]
        if rc != 0:
            raise RuntimeError(f"register_buffer failed: {rc}")
    rows = []
    for size, b in [(x, batch) for x in sizes] + [(min(sizes), 1)]:
        try:
            rows.append(_measure(store, cfg, s, d, src, dst, size, b, budget))
        except RuntimeError as exc:  # one failing shape does not hide the others
            print(f"mooncake size {size} batch {b}: {exc}", file=sys.stderr, flush=True)
            rows.append({"size": size, "batch": b, "error": str(exc)})
    print(json.dumps(rows), flush=True)


def _measure(store: object, cfg: object, s: int, d: int, src: object, dst: object,
             size: int, b: int, budget: int) -> dict[str, object]:
    """One (size, batch) shape: timed puts then gets, checked, then removed."""
    n = max(b * 4, min(512, budget // size)) // b * b
    keys = [f"mc/{size}/{b}/{i}" for i in range(n)]
    t0 = time.perf_counter()
    for i in range(0, n, b):
        ks = keys[i:i + b]
        if b == 1:
            rcs = [store.put_from(ks[0], s, size, cfg)]  # type: ignore[attr-defined]
        else:
            rcs = store.batch_put_from(  # type: ignore[attr-defined]
                ks, [s + j * size for j in range(b)], [size] * b, cfg)
        if any(r != 0 for r in rcs):
            raise RuntimeError(f"put failed: {rcs}")
    put_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(0, n, b):
        ks = keys[i:i + b]
        if b == 1:
            got = [store.get_into(ks[0], d, size)]  # type: ignore[attr-defined]
        else:
            got = store.batch_get_into(  # type: ignore[attr-defined]
                ks, [d + j * size for j in range(b)], [size] * b)
        if any(g != size for g in got):
            raise RuntimeError(f"get failed: {got}")
    get_s = time.perf_counter() - t0
    ok = bool(np.array_equal(dst[:b * size], src[:b * size]))  # type: ignore[index]
    time.sleep(0.6)  # the read leases (0.5 s) run out, then remove
    for k in keys:
        store.remove(k)  # type: ignore[attr-defined]
    print(f"mooncake size {size} batch {b}: put {n * size / put_s / 1e9:.2f} GB/s, "
          f"get {n * size / get_s / 1e9:.2f} GB/s", file=sys.stderr, flush=True)
    return {"size": size, "batch": b, "objects": n, "verified": ok, "put_s": put_s,
            "get_s": get_s, "put_gbps": n * size / put_s / 1e9,
            "get_gbps": n * size / get_s / 1e9, "put_ops": n / put_s, "get_ops": n / get_s}


def stop(proc: subprocess.Popen[str] | None) -> None:
    """Terminate (then kill) a child we started, by its PID."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def start_master(binary: Path, *flags: str) -> tuple[subprocess.Popen[str], str, str]:
    """``mooncake_master`` on 127.0.0.1 with its HTTP metadata server, once its RPC port
    accepts: (process, master address, metadata URL). Raises RuntimeError (child stopped)
    when it does not start within 30 s."""
    rpc, meta_port, metrics = free_port(), free_port(), free_port()
    master = subprocess.Popen(
        [str(binary), "-rpc_port", str(rpc), "-rpc_address", "127.0.0.1",
         "-enable_http_metadata_server=true", "-http_metadata_server_host", "127.0.0.1",
         "-http_metadata_server_port", str(meta_port), "-metrics_host", "127.0.0.1",
         "-metrics_port", str(metrics), *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", rpc), 0.5).close()
            return master, f"127.0.0.1:{rpc}", f"http://127.0.0.1:{meta_port}/metadata"
        except OSError:
            if master.poll() is not None or time.monotonic() > deadline:
                stop(master)
                raise RuntimeError(
                    f"mooncake_master did not start (exit {master.poll()})") from None
            time.sleep(0.1)


def bench(sizes: str, batch: int, budget: int, node_mib: int) -> dict[str, object]:
    """Master + node + two client runs; see the module docstring."""
    import mooncake

    binary = Path(mooncake.__file__).parent / "mooncake_master"
    if not binary.exists():
        return {"error": f"{binary} not found"}
    try:
        master, master_addr, meta = start_master(binary, "-default_kv_lease_ttl", "500")
    except RuntimeError as exc:
        return {"error": str(exc)}
    node_proc = None
    try:
        node_port = free_port()
        node_name = f"127.0.0.1:{node_port}"
        node_proc = subprocess.Popen(
            [sys.executable, __file__, "node", master_addr, meta, str(node_mib), node_name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True)
        assert node_proc.stdout is not None
        if "ready" not in node_proc.stdout.readline():
            return {"error": "mooncake node did not start"}
        out: dict[str, object] = {}
        for label, target in (("preferred_node", node_name), ("default", "-")):
            proc = subprocess.run(
                [sys.executable, __file__, "client", master_addr, meta, sizes, str(batch),
                 str(budget), target], capture_output=True, text=True, timeout=300)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
            if proc.returncode == 0 and lines:
                out[label] = json.loads(lines[-1])
            else:
                done = [ln for ln in proc.stderr.splitlines() if ln.startswith("mooncake size")]
                tail = [ln for ln in proc.stderr.splitlines()
                        if "Error" in ln or "failed" in ln][-3:]
                out[label] = {"error": f"exit {proc.returncode}: " + " | ".join(tail),
                              "completed": done}
        return out
    finally:
        stop(node_proc)
        stop(master)


if __name__ == "__main__":
    role = sys.argv[1]
    os.environ.setdefault("MC_LEGACY_RPC_PORT_BINDING", "1")
    if role == "bench":
        print(json.dumps(bench(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                               int(sys.argv[5]))), flush=True)
    elif role == "node":
        node(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        client(sys.argv[2], sys.argv[3], [int(x) for x in sys.argv[4].split(",")],
               int(sys.argv[5]), int(sys.argv[6]), sys.argv[7])
