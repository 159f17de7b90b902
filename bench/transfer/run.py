"""NIXL READ/WRITE throughput between two processes on 127.0.0.1, against same-process memcpy.

``python -m bench.transfer [--sizes 4KiB..256MiB] [--iters N] [--out bench/results]``

Contracts:

- The benchmark spawns one peer (``python -m bench.transfer.agent``) that registers a DRAM
  buffer of the largest size and sends its NIXL agent metadata over a loopback control socket.
  Both agents use UCX with the progress thread off; UCX is pinned to ``lo``.
- For every size, the benchmark (the initiator) first checks one READ and one WRITE byte for
  byte against a seed-dependent pattern (READ: compared here; WRITE: compared by the peer),
  then times ``--warmup`` + ``--iters`` transfers of each op, then times the same number of
  ``numpy.copyto`` (and single-threaded ``torch.Tensor.copy_`` when torch imports) copies
  between two local buffers. A sample is one Python-level call, start to DONE, so small sizes
  measure per-call overhead on both sides of the ratio. During NIXL timing the peer progresses
  UCX every ~1 ms (``--peer-poll idle``) or spins (``busy``); during memcpy it is quiet.
- GB/s are decimal (1e9 B/s) over samples; median, p10 and p90 are reported. ``ratio`` is NIXL
  median / numpy memcpy median.
- Writes ``<out>/transfer.json`` and ``<out>/transfer.png`` (log-scale size axis; the PNG is
  skipped with a warning when matplotlib is missing). Exit code 0 iff every check passed.
- The peer is always stopped: asked to exit, then SIGTERM/SIGKILL by its own PID. The
  process entry (:func:`entry`) ends with ``os._exit`` because NIXL may segfault at exit.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.process import run_and_exit
from bench.transfer.agent import (
    REPO_ROOT,
    Peer,
    alloc_buffer,
    check_pattern,
    configure_ucx_env,
    fill_pattern,
    make_agent,
)

DEFAULT_SIZES = "4KiB..256MiB"
DEFAULT_UCX_TLS = "tcp,self,sm"
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"4KiB"``/``"4k"``/``"4096"`` -> bytes (binary units). Raises ValueError."""
    m = _SIZE_RE.match(text)
    if not m or int(m.group(1)) <= 0:
        raise ValueError(f"bad size {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def parse_sizes(text: str) -> list[int]:
    """Comma-separated sizes; ``A..B`` expands to A, 4A, 16A, ... up to B. Sorted, unique."""
    out: set[int] = set()
    for item in filter(None, (s.strip() for s in text.split(","))):
        if ".." in item:
            lo, hi = (parse_size(x) for x in item.split("..", 1))
            while lo <= hi:
                out.add(lo)
                lo *= 4
        else:
            out.add(parse_size(item))
    if not out:
        raise ValueError("no sizes given")
    return sorted(out)


def fmt_size(n: int) -> str:
    """Bytes -> shortest exact binary label (``4096`` -> ``"4KiB"``)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def summarize(size: int, seconds: list[float]) -> dict[str, float]:
    """GB/s median/p10/p90 of ``size`` bytes moved in each of ``seconds``."""
    gbps = size / np.asarray(seconds, dtype=np.float64) / 1e9
    p10, med, p90 = np.percentile(gbps, [10, 50, 90])
    return {"median": float(med), "p10": float(p10), "p90": float(p90), "n": len(seconds)}


def time_calls(fn: Callable[[], None], iters: int, warmup: int) -> list[float]:
    """Seconds of each of ``iters`` calls of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e9)
    return out


class Initiator:
    """This process's agent, its registered buffer and the peer's buffer coordinates."""

    def __init__(self, agent: Any, local: np.ndarray, peer_info: dict[str, Any],
                 peer_md: bytes) -> None:
        self.agent = agent
        self.local_addr = int(local.ctypes.data)
        self.reg = agent.register_memory([(self.local_addr, local.nbytes, 0, "")], "DRAM")
        self.remote = agent.add_remote_agent(peer_md)
        self.remote_addr = int(peer_info["addr"])
        t0 = time.perf_counter()
        agent.make_connection(self.remote)
        self.connect_s = time.perf_counter() - t0

    def timed(self, op: str, size: int, iters: int, warmup: int) -> list[float]:
        """Post one ``op`` ("READ"/"WRITE") of ``size`` bytes repeatedly; seconds per post."""
        local = self.agent.get_xfer_descs([(self.local_addr, size, 0)], "DRAM")
        remote = self.agent.get_xfer_descs([(self.remote_addr, size, 0)], "DRAM")
        handle = self.agent.initialize_xfer(op, local, remote, self.remote)
        agent = self.agent

        def once() -> None:
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL {op} of {size} B ended in state {state}")

        try:
            return time_calls(once, iters, warmup)
        finally:
            agent.release_xfer_handle(handle)

    def close(self) -> None:
        """Drop the peer and deregister (best effort)."""
        for step in (lambda: self.agent.remove_remote_agent(self.remote),
                     lambda: self.agent.deregister_memory(self.reg)):
            try:
                step()
            except Exception as exc:  # cleanup must not mask the real error
                print(f"cleanup: {exc}", file=sys.stderr)


def _torch_copy(dst: np.ndarray, src: np.ndarray) -> Callable[[], None] | None:
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)  # 2 threads are 10-100x slower here (thread wake-up per call)
    d, s = torch.from_numpy(dst), torch.from_numpy(src)

    def copy() -> None:
        d.copy_(s)

    return copy


def measure_size(ini: Initiator, peer: Peer, local: np.ndarray, scratch: np.ndarray,
                 size: int, seed: int, iters: int, warmup: int,
                 peer_busy: bool) -> dict[str, Any]:
    """Check and time READ, WRITE and memcpy for one size; return its result row."""
    peer.request(op="busy", on=peer_busy)
    peer.request(op="fill", size=size, seed=seed)
    local[:size] = 0
    ini.timed("READ", size, 1, 0)
    read_ok = check_pattern(local, size, seed)
    fill_pattern(local, size, seed + 1)
    ini.timed("WRITE", size, 1, 0)
    write_ok = bool(peer.request(op="verify", size=size, seed=seed + 1)["ok"])
    read = summarize(size, ini.timed("READ", size, iters, warmup))
    write = summarize(size, ini.timed("WRITE", size, iters, warmup))
    peer.request(op="busy", on=False)  # give the peer's core back for the memcpy anchor

    fill_pattern(local, size, seed + 2)
    src, dst = local[:size], scratch[:size]
    memcpy = summarize(size, time_calls(lambda: np.copyto(dst, src), iters, warmup))
    memcpy_ok = check_pattern(scratch, size, seed + 2)
    tcopy = _torch_copy(dst, src)
    torch_copy = summarize(size, time_calls(tcopy, iters, warmup)) if tcopy else None
    return {
        "size_bytes": size, "size": fmt_size(size),
        "read_gbps": read, "write_gbps": write,
        "memcpy_gbps": memcpy, "torch_copy_gbps": torch_copy,
        "read_ratio": read["median"] / memcpy["median"],
        "write_ratio": write["median"] / memcpy["median"],
        "verified": {"read": read_ok, "write": write_ok, "memcpy": memcpy_ok},
    }


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("nixl", "nixl-cu12", "numpy", "torch"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def run_benchmark(sizes: list[int], iters: int, warmup: int, ucx_tls: str,
                  err_mode: str, peer_poll: str = "idle") -> dict[str, Any]:
    """Run the whole benchmark and return the JSON-ready report."""
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    ucx_env = configure_ucx_env(ucx_tls)
    max_size = max(sizes)
    peer = Peer(max_size, err_mode)  # the peer imports NIXL while we do
    ini: Initiator | None = None
    rows: list[dict[str, Any]] = []
    try:
        t0 = time.perf_counter()
        import nixl._api  # noqa: F401 - timed apart from agent creation

        t1 = time.perf_counter()
        agent = make_agent(f"bench-{os.getpid()}", err_mode)
        t2 = time.perf_counter()
        local, scratch = alloc_buffer(max_size), alloc_buffer(max_size)
        info, md = peer.hello()
        peer_ready_s = time.perf_counter() - t_start
        ini = Initiator(agent, local, info, md)
        first_s = ini.timed("READ", sizes[0], 1, 0)[0]  # includes UCX endpoint wire-up
        for i, size in enumerate(sizes):
            row = measure_size(ini, peer, local, scratch, size, 3 * i + 1, iters, warmup,
                               peer_poll == "busy")
            rows.append(row)
            print(_row_line(row), file=sys.stderr, flush=True)
        report: dict[str, Any] = {
            "schema": "kvmesh.bench.transfer/1",
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                     "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
            "versions": _versions(),
            "config": {"iters": iters, "warmup": warmup, "sizes": sizes,
                       "ucx_env": ucx_env, "ucx_error_handling_mode": err_mode,
                       "progress_thread": False, "peer_poll": peer_poll,
                       "memcpy": "numpy.copyto",
                       "torch_copy": "torch.Tensor.copy_, 1 thread"},
            "setup_s": {"nixl_import": t1 - t0, "agent_create": t2 - t1,
                        "peer_ready": peer_ready_s, "make_connection": ini.connect_s,
                        "first_transfer": first_s},
            "results": rows,
            "all_verified": all(all(r["verified"].values()) for r in rows),
            "wall_s": time.perf_counter() - t_start,
        }
    finally:
        if ini is not None:
            ini.close()
        peer.close()
    report["peer"] = {"pid": peer.proc.pid, "exit_code": peer.proc.returncode}
    return report


def _row_line(r: dict[str, Any]) -> str:
    def g(k: str) -> str:
        return f"{r[k]['median']:8.2f}" if r.get(k) else f"{'-':>8}"

    ok = "ok" if all(r["verified"].values()) else "FAIL"
    return (f"{r['size']:>7} {g('read_gbps')} {g('write_gbps')} {g('memcpy_gbps')} "
            f"{g('torch_copy_gbps')} {r['read_ratio']:7.2f} {r['write_ratio']:7.2f}  {ok}")


def table(report: dict[str, Any]) -> str:
    """A plain-text table of the medians (GB/s) with p10–p90 of READ/WRITE."""
    lines = [f"{'size':>7} {'READ':>8} {'WRITE':>8} {'memcpy':>8} {'torch':>8} "
             f"{'R/mc':>7} {'W/mc':>7}  check  READ p10-p90   WRITE p10-p90"]
    for r in report["results"]:
        rd, wr = r["read_gbps"], r["write_gbps"]
        lines.append(f"{_row_line(r)}   {rd['p10']:6.2f}-{rd['p90']:<6.2f}  "
                     f"{wr['p10']:6.2f}-{wr['p90']:<6.2f}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> bool:
    """Write the PNG; False (with a warning) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    except ImportError:
        print("matplotlib not installed: skipping the PNG", file=sys.stderr)
        return False
    rows = report["results"]
    x = [r["size_bytes"] for r in rows]
    fig, (ax, axr) = plt.subplots(2, 1, figsize=(9, 8), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 1.4]})
    for key, label, style in (("read_gbps", "NIXL READ", "o-"), ("write_gbps", "NIXL WRITE", "s-"),
                              ("memcpy_gbps", "memcpy (numpy.copyto)", "^--"),
                              ("torch_copy_gbps", "torch copy_", "v:")):
        if not all(r.get(key) for r in rows):
            continue
        med = [r[key]["median"] for r in rows]
        line = ax.plot(x, med, style, label=label)[0]
        ax.fill_between(x, [r[key]["p10"] for r in rows], [r[key]["p90"] for r in rows],
                        color=line.get_color(), alpha=0.18)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel("GB/s (median, band p10–p90)")
    cfg = report["config"]
    ax.set_title(f"NIXL {report['versions'].get('nixl')} UCX, 2 processes on 127.0.0.1 "
                 f"(UCX_TLS={cfg['ucx_env'].get('UCX_TLS') or 'default'}, "
                 f"{cfg['iters']} iters)\nload average at start "
                 f"{report['host']['loadavg_before'][0]:.1f} on {report['host']['cpus']} CPUs",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    axr.plot(x, [r["read_ratio"] for r in rows], "o-", label="READ / memcpy")
    axr.plot(x, [r["write_ratio"] for r in rows], "s-", label="WRITE / memcpy")
    axr.axhline(1.0, color="grey", lw=0.8)
    axr.set_ylabel("NIXL / memcpy")
    axr.set_xlabel("transfer size")
    axr.set_xticks(x, [r["size"] for r in rows], rotation=45)
    axr.grid(True, alpha=0.3)
    axr.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m bench.transfer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help="comma list; A..B steps ×4 (default %(default)s)")
    p.add_argument("--iters", type=int, default=50, help="timed samples per op and size")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before sampling")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    p.add_argument("--ucx-tls", default=DEFAULT_UCX_TLS,
                   help="UCX_TLS for both agents; '' leaves it unset (default %(default)s)")
    p.add_argument("--ucx-err-mode", default="none", choices=["none", "peer"],
                   help="UCX backend ucx_error_handling_mode")
    p.add_argument("--peer-poll", default="idle", choices=["idle", "busy"],
                   help="peer progresses UCX every ~1 ms (idle) or in a tight loop (busy)")
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    try:
        args.size_list = parse_sizes(args.sizes)
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    """Run, print the table, write JSON (+PNG); 0 iff every check passed."""
    args = parse_args(argv)
    try:
        report = run_benchmark(args.size_list, args.iters, args.warmup, args.ucx_tls,
                               args.ucx_err_mode, args.peer_poll)
    except Exception:
        traceback.print_exc()
        print("benchmark failed", file=sys.stderr)
        return 1
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    report["png"] = "transfer.png" if plot(report, out / "transfer.png") else None
    (out / "transfer.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"wrote {out / 'transfer.json'} in {report['wall_s']:.1f} s; "
          f"checks {'passed' if report['all_verified'] else 'FAILED'}")
    return 0 if report["all_verified"] else 1


def entry() -> None:
    """Process entry: :func:`main` through :func:`bench.process.run_and_exit`."""
    run_and_exit(main)
