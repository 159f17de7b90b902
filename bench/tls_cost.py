"""Insecure vs mTLS in one benchmark run: modes, interleaved rounds, the per-RPC table.

Used by :mod:`bench.router_overhead` and :mod:`bench.store` (``--tls {off,on,both}``).
"mTLS" is exactly what ``--tls-dir`` turns on in the services: TLS with client
certificates from :func:`services.common.tls.write_mesh_certs`, the role authorization
interceptor on every server (:mod:`services.common.authz`), and clients dialling through
:mod:`services.common.grpc_client` with their role's certificate.

Contracts:

- :func:`modes_of` maps the flag to the modes measured: ``off`` → ``("insecure",)``,
  ``on`` → ``("tls",)``, ``both`` → ``("insecure", "tls")``.
- :func:`round_order` gives round ``i``'s order: the modes as given on even rounds,
  reversed on odd ones (ABBA), so drift in the machine's load hits both modes alike.
- :func:`interleaved` / :func:`interleaved_sync` time ``n`` sequential calls per mode (one
  in flight, on whatever long-lived channel each mode's call uses), the modes alternating
  call by call (ABBA), so a burst of load on this shared machine hits both: seconds per
  call and mode. :func:`connect_times_sync` times ``n`` fresh blocking channels from
  creation to READY (TCP connect, plus the TLS handshake with client certificate in TLS
  mode, plus HTTP/2 settings): what a long-lived channel pays once.
- :func:`cpu_s` is the CPU time (every thread's on-CPU ns from
  ``/proc/*/task/*/schedstat``, else user + system ticks) the given processes and all
  their descendants have used; :func:`cpu_block` / :func:`cpu_block_sync` run ``n``
  calls of one mode alone and return the CPU µs per call of this process (``client_us``)
  and of the mode's server processes (``servers_us``). CPU time does not stretch with the
  run queue as wall time does on a shared, loaded machine, so it shows what TLS costs
  in work; background work of the servers (keepalives, polls) is included.
- :func:`summarize` turns ``{rpc: {mode: [seconds]}}`` into one row per RPC: per mode
  ``n``, ``p50_us``, ``p99_us``, ``mean_us`` (plus ``cpu_client_us``, ``cpu_servers_us``,
  ``cpu_us`` when ``cpu`` has them); with both modes also ``ratio`` (TLS p50 / insecure
  p50), ``cost_us`` (TLS p50 − insecure p50), ``cpu_ratio`` / ``cpu_cost_us`` (the same of
  ``cpu_us``) and, for RPCs named in ``data_path``, ``within_10pct`` (ratio ≤ 1.10) and
  ``cpu_within_10pct``. It reports; nothing asserts a figure.
- :func:`verdict` is ``all(within_10pct)`` over the data-path rows (None when a mode is
  missing). :func:`plot_rpc` draws the per-RPC p50 bars of both modes into an axis.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

MODES = ("insecure", "tls")
TLS_FLAG = {"off": ("insecure",), "on": ("tls",), "both": MODES}
LIMIT_RATIO = 1.10


def modes_of(flag: str) -> tuple[str, ...]:
    """The modes ``--tls`` measures (see the module docstring)."""
    return TLS_FLAG[flag]


def round_order(modes: Sequence[str], i: int) -> list[str]:
    """Round ``i``'s order of ``modes`` (ABBA)."""
    return list(modes) if i % 2 == 0 else list(reversed(modes))


async def interleaved(n: int, calls: Mapping[str, Callable[[int], Awaitable[Any]]]
                      ) -> dict[str, list[float]]:
    """Seconds of each of ``n`` sequential ``await calls[mode](i)`` per mode, the modes
    alternating call by call (:func:`round_order` of ``i``)."""
    out: dict[str, list[float]] = {m: [] for m in calls}
    for i in range(n):
        for mode in round_order(list(calls), i):
            t0 = time.perf_counter()
            await calls[mode](i)
            out[mode].append(time.perf_counter() - t0)
    return out


def interleaved_sync(n: int, calls: Mapping[str, Callable[[int], Any]]
                     ) -> dict[str, list[float]]:
    """:func:`interleaved` for blocking calls."""
    out: dict[str, list[float]] = {m: [] for m in calls}
    for i in range(n):
        for mode in round_order(list(calls), i):
            t0 = time.perf_counter()
            calls[mode](i)
            out[mode].append(time.perf_counter() - t0)
    return out


def connect_times_sync(n: int, make_channel: Callable[[], Any],
                       timeout_s: float = 10.0) -> list[float]:
    """Seconds from creating each of ``n`` fresh blocking channels to READY."""
    import grpc

    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        ch = make_channel()
        try:
            grpc.channel_ready_future(ch).result(timeout=timeout_s)
            out.append(time.perf_counter() - t0)
        finally:
            ch.close()
    return out


def _task_cpu_s(pid: int, ticks: int) -> float:
    """On-CPU seconds of every thread of ``pid`` (schedstat, ns), else its stat ticks."""
    import os

    try:
        total = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):  # gone, or no schedstat
        return ticks / os.sysconf("SC_CLK_TCK")


def cpu_s(pids: Iterable[int]) -> float:
    """CPU seconds used so far by ``pids`` and all their descendants (Linux)."""
    import os

    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        parent[int(entry)] = int(fields[1])
        ticks[int(entry)] = int(fields[11]) + int(fields[12])
    roots = set(pids)

    def under(pid: int) -> bool:
        while pid > 0:
            if pid in roots:
                return True
            pid = parent.get(pid, 0)
        return False
    return sum(_task_cpu_s(pid, t) for pid, t in ticks.items() if under(pid))


async def cpu_block(n: int, call: Callable[[int], Awaitable[Any]],
                    pids: Sequence[int]) -> dict[str, float]:
    """CPU µs per call of ``n`` sequential ``await call(i)``: this process, the servers
    (``{}`` when ``n`` is 0)."""
    if n <= 0:
        return {}
    c0, s0 = time.process_time(), cpu_s(pids)
    for i in range(n):
        await call(i)
    return {"client_us": (time.process_time() - c0) / n * 1e6,
            "servers_us": (cpu_s(pids) - s0) / n * 1e6}


def cpu_block_sync(n: int, call: Callable[[int], Any], pids: Sequence[int]
                   ) -> dict[str, float]:
    """:func:`cpu_block` for blocking calls."""
    if n <= 0:
        return {}
    c0, s0 = time.process_time(), cpu_s(pids)
    for i in range(n):
        call(i)
    return {"client_us": (time.process_time() - c0) / n * 1e6,
            "servers_us": (cpu_s(pids) - s0) / n * 1e6}


def _stats(samples: Sequence[float]) -> dict[str, float | int]:
    a = np.asarray(samples, dtype=float) * 1e6
    return {"n": int(a.size), "p50_us": float(np.percentile(a, 50)),
            "p99_us": float(np.percentile(a, 99)), "mean_us": float(a.mean())}


def summarize(samples: Mapping[str, Mapping[str, Sequence[float]]],
              data_path: Iterable[str] = (),
              cpu: Mapping[str, Mapping[str, Mapping[str, float]]] | None = None
              ) -> list[dict[str, Any]]:
    """One row per RPC (see the module docstring)."""
    data = set(data_path)
    rows = []
    for rpc, by_mode in samples.items():
        row: dict[str, Any] = {"rpc": rpc, "data_path": rpc in data}
        for mode, s in by_mode.items():
            if s:
                row[mode] = _stats(s)
                used = (cpu or {}).get(rpc, {}).get(mode)
                if used:
                    row[mode] |= {"cpu_client_us": used["client_us"],
                                  "cpu_servers_us": used["servers_us"],
                                  "cpu_us": used["client_us"] + used["servers_us"]}
        if all(m in row for m in MODES):
            ins, tls = row["insecure"], row["tls"]
            row["ratio"] = tls["p50_us"] / ins["p50_us"]
            row["cost_us"] = tls["p50_us"] - ins["p50_us"]
            if "cpu_us" in ins and "cpu_us" in tls:
                row["cpu_ratio"] = tls["cpu_us"] / ins["cpu_us"]
                row["cpu_cost_us"] = tls["cpu_us"] - ins["cpu_us"]
            if row["data_path"]:
                row["within_10pct"] = bool(row["ratio"] <= LIMIT_RATIO)
                if "cpu_ratio" in row:
                    row["cpu_within_10pct"] = bool(row["cpu_ratio"] <= LIMIT_RATIO)
        rows.append(row)
    return rows


def verdict(rows: Sequence[Mapping[str, Any]], key: str = "within_10pct") -> bool | None:
    """Whether every data-path row is within 10 % (``key``: wall p50, or
    ``cpu_within_10pct``); None when a row lacks the figure (not both modes measured)."""
    data = [r for r in rows if r["data_path"]]
    if not data or any(key not in r for r in data):
        return None
    return all(r[key] for r in data)


def print_rows(rows: Sequence[Mapping[str, Any]], title: str) -> None:
    """One line per RPC: both p50s, ratio, cost."""
    print(title, flush=True)
    for r in rows:
        figs = "  ".join(f"{m} p50 {r[m]['p50_us']:8.1f} us" for m in MODES if m in r)
        tail = (f"  x{r['ratio']:.3f}  +{r['cost_us']:.1f} us" if "ratio" in r else "")
        if "cpu_ratio" in r:
            tail += (f"  | CPU {r['insecure']['cpu_us']:.0f} -> {r['tls']['cpu_us']:.0f} us"
                     f" x{r['cpu_ratio']:.3f}")
        mark = " (data path)" if r["data_path"] else ""
        print(f"  {r['rpc']:<34} {figs}{tail}{mark}", flush=True)


def plot_rpc(ax: Any, rows: Sequence[Mapping[str, Any]], title: str) -> None:
    """Per-RPC p50 bars, insecure beside mTLS, ratios above the TLS bars."""
    names = [r["rpc"] for r in rows]
    x = np.arange(len(names))
    for k, mode in enumerate(MODES):
        vals = [r[mode]["p50_us"] if mode in r else np.nan for r in rows]
        bars = ax.bar(x + (k - 0.5) * 0.4, vals, 0.4, label=f"{mode} p50")
        if mode == "tls":
            for bar, r in zip(bars, rows, strict=True):
                if "ratio" in r:
                    ax.annotate(f"x{r['ratio']:.2f}", (bar.get_x() + 0.2, bar.get_height()),
                                ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [n + (" *" if r["data_path"] else "") for n, r in
                      zip(names, rows, strict=True)], rotation=30, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set(ylabel="µs per call (p50, log scale)", title=title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
