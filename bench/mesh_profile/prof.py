"""Runs ``python -m MODULE ARGS`` under cProfile (thread CPU time, every thread included)
and writes a snapshot of the merged stats on each SIGUSR1:
``python -m bench.mesh_profile.prof OUT_PREFIX MODULE [ARGS...]``.

Contract: every thread started after the profiler (``asyncio.to_thread`` workers: the
tokenizer) gets its own ``cProfile.Profile`` timed by ``time.thread_time`` (CPU, not
wall: waiting in epoll costs nothing), from its start. The main thread (the event loop)
is profiled from the first SIGUSR1 to the second only: its profiler is enabled by the
first and disabled by the second (in the main thread, where signal handlers run), since
taking stats from a running profiler closes every frame on its stack as if it had
returned, which garbles the event loop's deep, long-lived coroutine stacks (a worker
thread waiting in its queue has a shallow one). The k-th SIGUSR1 (k = 1, 2, ...) writes
the merged stats so far to ``OUT_PREFIX.k.pstats`` (a ``marshal``-ed pstats dict, as
``pstats.Stats.dump_stats``) and then the empty file ``OUT_PREFIX.k.done``; the
difference of the first two snapshots is what the process did between the signals. Threads the
profiler cannot see (gRPC's C core, Rust tokenizers' own pools) are not in it.
Only for benchmarks: the profiler slows Python code several times, so read the shares,
not the absolute times.
"""

from __future__ import annotations

import cProfile
import importlib
import marshal
import runpy
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_profiles: list[cProfile.Profile] = []
_lock = threading.Lock()
_snapshots = 0


def _new_profile() -> cProfile.Profile:
    prof = cProfile.Profile(time.thread_time)
    with _lock:
        _profiles.append(prof)
    return prof


def _thread_start(*_: object) -> None:
    """``threading.setprofile`` hook: the new thread's own profiler, enabled at once."""
    sys.setprofile(None)
    _new_profile().enable()


def merged() -> dict[Any, Any]:
    """Every profiler's stats so far, summed per function and per caller edge."""
    out: dict[Any, Any] = {}
    with _lock:
        profs = list(_profiles)
    for p in profs:
        p.snapshot_stats()  # type: ignore[attr-defined]  # no disable: it may be another thread's
        for func, (cc, nc, tt, ct, callers) in p.stats.items():  # type: ignore[attr-defined]
            a = out.get(func)
            if a is None:
                out[func] = (cc, nc, tt, ct, dict(callers))
                continue
            edges = a[4]
            for caller, edge in callers.items():
                old = edges.get(caller)
                edges[caller] = edge if old is None else tuple(
                    x + y for x, y in zip(old, edge, strict=True))
            out[func] = (a[0] + cc, a[1] + nc, a[2] + tt, a[3] + ct, edges)
    return out


def command_line() -> tuple[str, str]:
    """``OUT_PREFIX MODULE [ARGS...]`` of a runner: the prefix and the module, with
    ``sys.argv`` left as the module would see it."""
    prefix, module, *args = sys.argv[1:]
    sys.argv = [module, *args]
    return prefix, module


def wrap_function(module: str, path: str,
                  wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replaces ``path`` of ``module`` (``function`` or ``Class.method``) by ``wrap`` of it;
    a module-level function also wherever a ``services.*`` / ``workers.*`` module
    imported it by name. ImportError or AttributeError when it does not exist; what
    ``wrap`` raises, with nothing replaced."""
    *owners, attr = path.split(".")
    owner: Any = importlib.import_module(module)
    for part in owners:
        owner = getattr(owner, part)
    func = getattr(owner, attr)
    wrapped = wrap(func)
    setattr(owner, attr, wrapped)
    if not owners:  # ``from module import func`` elsewhere: rebind those names too
        for other in list(sys.modules.values()):
            if getattr(other, "__name__", "").startswith(("services.", "workers.")) \
                    and getattr(other, attr, None) is func:
                setattr(other, attr, wrapped)


def run_module(module: str, on_sigusr1: Callable[..., None]) -> None:
    """Runs ``python -m module`` here (``sys.argv`` already its own), ``on_sigusr1``
    handling each SIGUSR1; returns when it exits."""
    signal.signal(signal.SIGUSR1, on_sigusr1)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass


def record_between_signals(prefix: str, module: str, start: Callable[[], None],
                           stop_and_write: Callable[[], None]) -> None:
    """Runs ``module`` here: the first SIGUSR1 calls ``start``, the second
    ``stop_and_write``; the k-th signal then writes ``<prefix>.k.done`` (the runners of
    :mod:`.stamps` and :mod:`.calltrace`)."""
    signals = 0

    def on_signal(*_: object) -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            start()
        elif signals == 2:
            stop_and_write()
        Path(f"{prefix}.{signals}.done").touch()

    run_module(module, on_signal)


def main() -> None:
    prefix, module = command_line()

    main_thread: list[cProfile.Profile] = []

    def snapshot(*_: object) -> None:
        global _snapshots
        _snapshots += 1
        if _snapshots == 2 and main_thread:
            main_thread[0].disable()
        path = Path(f"{prefix}.{_snapshots}.pstats")
        path.write_bytes(marshal.dumps(merged()))
        if _snapshots == 1:  # after the stats: the main thread adds nothing to snapshot 1
            main_thread.append(_new_profile())
            main_thread[0].enable()
        Path(f"{prefix}.{_snapshots}.done").touch()

    threading.setprofile(_thread_start)
    run_module(module, snapshot)


if __name__ == "__main__":
    main()
