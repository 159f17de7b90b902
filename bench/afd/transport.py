"""Round-trip latency of one AFD layer message, per transport, in one run.

``python -m bench.afd.transport [--tokens 1,8,64] [--hidden 576] [--iters 2000] [--out DIR]``

Contracts:

- For every transport in :data:`TRANSPORTS` that is available here (a missing module is
  reported as ``skipped`` with the reason), the benchmark spawns one FFN process that echoes
  every attention output back unchanged (``send_ffn_output(hidden, ctx.answer())``: no
  compute, so only the transport is measured). This process is the attention side. The
  FFN's endpoint info crosses over a pipe, as the mesh will carry it over etcd/gRPC.
- A sample is one ``send_attn_output`` + ``recv_ffn_output`` of ``[num_tokens, hidden]``
  float32 (one microbatch, one layer), start to returned tensor; ``--warmup`` untimed
  samples first. The first returned tensor per size is checked with ``torch.equal``.
  Reported per transport and size: p50, p90, p99, mean and min in microseconds, and the
  send-only p50 (the attention side's share of the call: staging copy + WRITE to DONE).
- Both processes run torch with one thread (more threads cost 10-100x per small op here).
- Writes ``<out>/afd_transport.json`` and ``<out>/afd_transport.png`` (skipped with a warning
  without matplotlib). Exit code 0 iff every transport that ran passed its checks.
- The FFN process is always stopped (asked, then killed by its PID); the process entry
  ends with ``os._exit`` because NIXL may segfault at interpreter exit.

Adding a transport is one entry in :data:`TRANSPORTS`: a name and a :class:`Transport`
saying how its two endpoints pair (NIXL: endpoint infos both ways; shared memory: a name).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import multiprocessing as mp
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from bench.process import run_and_exit

REPO_ROOT = Path(__file__).resolve().parents[2]
UCX_ENV = {"UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo"}


class Transport:
    """How one transport pairs an FFN endpoint with an attention endpoint.

    ``ffn(config)`` → (connector, token for the attention side); ``attention(config,
    token)`` → (connector, token back to the FFN side, b"" if none); ``ffn_finish(ffn,
    back)`` completes the FFN side with it. ``target`` (``module:Class``) says what must
    import for the transport to count as available.
    """

    target = ""

    def ffn(self, config: Any) -> tuple[Any, bytes]:
        raise NotImplementedError

    def attention(self, config: Any, token: bytes) -> tuple[Any, bytes]:
        raise NotImplementedError

    def ffn_finish(self, ffn: Any, back: bytes) -> None:
        """Nothing to do unless the transport needs the attention side's token."""


def _load(target: str) -> Any:
    mod, cls = target.split(":")
    return getattr(importlib.import_module(mod), cls)


@dataclass(frozen=True)
class Nixl(Transport):
    """:class:`NixlAfdConnector`: endpoint infos both ways (``info()`` / ``connect()``)."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    target = "workers.engines.afd.transport_nixl:NixlAfdConnector"

    def ffn(self, config: Any) -> tuple[Any, bytes]:
        c = _load(self.target)("ffn", config, **self.kwargs)
        return c, c.info()

    def attention(self, config: Any, token: bytes) -> tuple[Any, bytes]:
        c = _load(self.target)("attention", config, 0, **self.kwargs)
        c.connect(token)
        return c, c.info()

    def ffn_finish(self, ffn: Any, back: bytes) -> None:
        ffn.connect(back)


@dataclass(frozen=True)
class Shm(Transport):
    """The shared-memory connectors: the FFN side names the segment, the attention joins."""

    target = "workers.engines.afd.transport_local:ShmFfnConnector"

    def ffn(self, config: Any) -> tuple[Any, bytes]:
        from workers.engines.afd.transport_local import make_shm_connector_pair_name

        name = make_shm_connector_pair_name()
        return _load(self.target)(name, config), name.encode()

    def attention(self, config: Any, token: bytes) -> tuple[Any, bytes]:
        from workers.engines.afd.transport_local import ShmAttentionConnector

        return ShmAttentionConnector(token.decode(), 0, config), b""


TRANSPORTS: dict[str, Transport] = {
    "nixl": Nixl(),
    # UCX error handling "peer": the notification lane moves from sysv shm to tcp
    "nixl_errpeer": Nixl({"ucx_err_mode": "peer"}),
    "shm": Shm(),
}


def _ffn_main(conn: Connection, name: str, cfg: tuple[int, ...]) -> None:
    """The FFN process: echo every attention output until told to stop; os._exit."""
    code = 1
    try:
        os.environ.update(UCX_ENV)
        import torch

        torch.set_num_threads(1)
        from workers.engines.afd.connector import AfdPeerGone, AfdTimeout, AfdTransportConfig

        transport = TRANSPORTS[name]
        ffn, token = transport.ffn(AfdTransportConfig(*cfg))
        conn.send(token)
        transport.ffn_finish(ffn, conn.recv())
        conn.send("ready")
        while not conn.poll():
            try:
                hidden, ctx = ffn.recv_attn_output(timeout=0.2)
            except AfdTimeout:
                continue
            except AfdPeerGone:  # the attention side closed first: the run is over
                break
            ffn.send_ffn_output(hidden, ctx.answer())
        ffn.close()
        code = 0
    except BaseException as exc:  # report, then hard-exit
        print(f"FFN ({name}): {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    finally:
        sys.stderr.flush()
        os._exit(code)


def _stats(samples_s: list[float]) -> dict[str, float]:
    us = np.asarray(samples_s, dtype=np.float64) * 1e6
    p50, p90, p99 = np.percentile(us, [50, 90, 99])
    return {"p50_us": float(p50), "p90_us": float(p90), "p99_us": float(p99),
            "mean_us": float(us.mean()), "min_us": float(us.min()), "n": len(samples_s)}


def measure(name: str, tokens: list[int], hidden: int, iters: int,
            warmup: int) -> dict[str, Any]:
    """Spawn the FFN echo for ``name``, time round trips for each size; one result dict."""
    import torch

    from workers.engines.afd.connector import STAGE_ATTN_OUTPUT, AfdContext, AfdTransportConfig

    cfg = (hidden, max(tokens), 1, 1)
    spawn = mp.get_context("spawn")
    ours, theirs = spawn.Pipe()
    child = spawn.Process(target=_ffn_main, args=(theirs, name, cfg), daemon=True)
    child.start()
    attn = None
    rows = []
    try:
        t0 = time.perf_counter()
        if not ours.poll(120):
            raise TimeoutError("FFN process did not start")
        attn, back = TRANSPORTS[name].attention(AfdTransportConfig(*cfg), ours.recv())
        ours.send(back)
        if not ours.poll(60) or ours.recv() != "ready":
            raise TimeoutError("FFN process did not connect")
        setup_s = time.perf_counter() - t0
        gen = torch.Generator().manual_seed(0)
        step = 0
        for n in tokens:
            x = torch.randn(n, hidden, generator=gen)
            rtt, send = [], []
            ok = True
            for i in range(warmup + iters):
                ctx = AfdContext(0, step % 30, 0, STAGE_ATTN_OUTPUT, step, n)
                step += 1
                a = time.perf_counter()
                attn.send_attn_output(x, ctx)
                b = time.perf_counter()
                y = attn.recv_ffn_output(ctx, timeout=30.0)
                c = time.perf_counter()
                if i == 0:
                    ok = bool(torch.equal(x, y))
                if i >= warmup:
                    rtt.append(c - a)
                    send.append(b - a)
            row: dict[str, Any] = {"num_tokens": n, "bytes": n * hidden * 4, "verified": ok,
                   "round_trip": _stats(rtt), "send_p50_us": _stats(send)["p50_us"]}
            rows.append(row)
            print(f"{name:>5} {n:>4} tok {row['bytes']:>7} B  p50 "
                  f"{row['round_trip']['p50_us']:8.1f} us  p99 {row['round_trip']['p99_us']:8.1f}"
                  f" us  send p50 {row['send_p50_us']:6.1f} us  {'ok' if ok else 'FAIL'}",
                  file=sys.stderr, flush=True)
    finally:
        if attn is not None:
            attn.close()
        try:
            ours.send("stop")
        except OSError:
            pass
        child.join(15)
        if child.is_alive():
            child.kill()
            child.join(5)
    return {"status": "ran", "setup_s": setup_s, "results": rows,
            "ffn_exit_code": child.exitcode,
            "verified": all(r["verified"] for r in rows) and child.exitcode == 0}


def _available(name: str) -> str:
    """"" if the transport's module and class import, else why not."""
    try:
        _load(TRANSPORTS[name].target)
    except (ImportError, AttributeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("nixl", "nixl-cu12", "torch", "numpy"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def run(names: list[str], tokens: list[int], hidden: int, iters: int,
        warmup: int) -> dict[str, Any]:
    """The whole benchmark as a JSON-ready report."""
    os.environ.update(UCX_ENV)
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    transports: dict[str, Any] = {}
    for name in names:
        why = _available(name)
        transports[name] = ({"status": "skipped", "reason": why} if why
                            else measure(name, tokens, hidden, iters, warmup))
    ran = [t for t in transports.values() if t["status"] == "ran"]
    return {
        "schema": "kvmesh.bench.afd_transport/1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                 "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "versions": _versions(),
        "config": {"tokens": tokens, "hidden": hidden, "dtype": "float32", "iters": iters,
                   "warmup": warmup, "ucx_env": UCX_ENV, "torch_threads": 1,
                   "ffn": "echo (no compute)", "microbatches": 1},
        "transports": transports,
        "all_verified": bool(ran) and all(t["verified"] for t in ran),
        "wall_s": time.perf_counter() - t0,
    }


def plot(report: dict[str, Any], path: Path) -> bool:
    """p50 bars with p99 whiskers per size and transport; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipping the PNG", file=sys.stderr)
        return False
    ran = {k: v for k, v in report["transports"].items() if v["status"] == "ran"}
    tokens = report["config"]["tokens"]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    width = 0.8 / max(len(ran), 1)
    for j, (name, t) in enumerate(ran.items()):
        xs = [i + j * width for i in range(len(tokens))]
        p50 = [r["round_trip"]["p50_us"] for r in t["results"]]
        p99 = [r["round_trip"]["p99_us"] for r in t["results"]]
        ax.bar(xs, p50, width, label=f"{name} p50")
        ax.errorbar(xs, p50, yerr=[[0] * len(p50), [b - a for a, b in zip(p50, p99,
                                                                          strict=True)]],
                    fmt="none", ecolor="black", capsize=4)
    ax.set_xticks([i + width * (len(ran) - 1) / 2 for i in range(len(tokens))],
                  [f"{n} tok\n{n * report['config']['hidden'] * 4} B" for n in tokens])
    ax.set_yscale("log")
    ax.set_ylabel("round trip, µs (bar p50, whisker p99)")
    ax.set_title(f"AFD layer message round trip, FFN echo, {report['config']['iters']} iters\n"
                 f"load average at start {report['host']['loadavg_before'][0]:.1f} on "
                 f"{report['host']['cpus']} CPUs", fontsize=10)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    """Run, write JSON (+PNG); 0 iff every transport that ran passed its checks."""
    p = argparse.ArgumentParser(prog="python -m bench.afd.transport", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transports", default=",".join(TRANSPORTS))
    p.add_argument("--tokens", default="1,8,64")
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = p.parse_args(argv)
    names = [n for n in args.transports.split(",") if n]
    unknown = [n for n in names if n not in TRANSPORTS]
    if unknown or not names:
        p.error(f"--transports: unknown {unknown}; known {sorted(TRANSPORTS)}")
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        p.error("--tokens must be comma-separated integers")
    if min(tokens) < 1 or args.hidden < 1 or args.iters < 1 or args.warmup < 0:
        p.error("--tokens, --hidden and --iters must be >= 1, --warmup >= 0")
    try:
        report = run(names, tokens, args.hidden, args.iters, args.warmup)
    except Exception:
        traceback.print_exc()
        return 1
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    report["png"] = "afd_transport.png" if plot(report, out / "afd_transport.png") else None
    (out / "afd_transport.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out / 'afd_transport.json'} in {report['wall_s']:.1f} s; checks "
          f"{'passed' if report['all_verified'] else 'FAILED'}")
    return 0 if report["all_verified"] else 1


def entry() -> None:
    """Process entry: :func:`main` through :func:`bench.process.run_and_exit`."""
    run_and_exit(main)


if __name__ == "__main__":
    entry()
