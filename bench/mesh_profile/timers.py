"""Runs ``python -m MODULE ARGS`` with thread-CPU timers around chosen functions, and
writes what they measured between two SIGUSR1s:
``python -m bench.mesh_profile.timers OUT_PREFIX MODULE [ARGS...]``.

Unlike the profiler (:mod:`bench.mesh_profile.prof`), which slows every Python call and
so inflates call-heavy code, a timer costs one pair of ``time.thread_time_ns`` calls per
timed call and nothing elsewhere: its numbers are what those functions cost in place,
under the mesh's load (cold caches, other processes on the cores), which can be several
times a micro-benchmark's.

Contract:

- Before the module runs, the :data:`TARGETS` of its kind of process
  (:data:`PROCESS_PREFIXES`: a frontend's are the ``services.*`` and starlette ones, a
  worker fleet's the ``workers.*`` and ``services.common.*`` ones) are imported and
  each (``Class.method`` or ``function``; synchronous only: an ``async def`` returns at
  its first await, so it is refused with TypeError) is replaced by a wrapper that adds
  the thread CPU time of each call to that function's total; a function's name is
  rebound in every ``services.*`` / ``workers.*`` module that imported the function
  itself. Totals are inclusive: a timed function called by another timed one counts in
  both.
- A timer sees its caller's thread only: work a function hands to another thread (the
  frontend's encode thread, the tokenizers library's own pool) is in the process's CPU,
  not in that function's total.
- The first SIGUSR1 starts counting; the second stops and writes
  ``OUT_PREFIX.timers.json`` (``cpu_ns``: the process's CPU between the signals, all
  threads; ``functions``: per target its total ``ns`` and ``calls``); the k-th signal
  also writes ``OUT_PREFIX.k.done``, as the profiler does.
- Only for benchmarks.
"""

from __future__ import annotations

import functools
import inspect
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.mesh_profile.prof import command_line, run_module, wrap_function

# (module, function or Class.method): the request path's synchronous steps
TARGETS: tuple[tuple[str, str], ...] = (
    ("services.frontend.openai_schema", "parse_completion"),
    ("services.frontend.json_checks", "check_json"),
    ("services.frontend.pipeline", "sampling_proto"),
    ("services.frontend.pipeline", "Pipeline._finish"),
    ("services.frontend.models", "Tokenizer.encode"),
    ("services.frontend.encode_thread", "EncodeThread.encode"),
    ("services.frontend.handoff", "Request.generate_request"),
    ("services.frontend.handoff_machine", "HandoffMachine.handle"),
    ("services.frontend.worker_stream", "WorkerStream.generate"),
    ("services.frontend.worker_stream", "StreamCall.feed"),
    ("services.frontend.shapes", "Shapes.add"),
    ("services.frontend.shapes", "Shapes.full"),
    ("services.frontend.metrics", "FrontendMetrics.observe_cache_prediction"),
    ("services.common.telemetry", "propagation_metadata"),
    ("services.common.block_hash", "block_hashes"),
    ("services.router.embedded", "InProcessRouterStub.route_now"),
    ("services.router.embedded", "InProcessRouterStub.release_nowait"),
    ("services.router.service", "RouterServicer._check_route"),
    ("services.router.service", "RouterServicer._start"),
    ("services.router.service", "RouterServicer._decide"),
    ("services.router.core", "RouterCore.route"),
    ("services.router.core", "RouterCore._pick"),
    ("services.router.core", "RouterCore._states"),
    ("services.router.policies.profile", "Profile.select"),
    ("services.router.history", "PrefixHistory.record"),
    ("services.router.overlaps", "EmbeddedSource.find_now"),
    ("services.indexer.core", "KvIndex.apply"),
    ("services.common.event_bus", "decode_entry"),
    ("services.common.event_bus", "encode_batch"),
    ("starlette.responses", "JSONResponse.__init__"),
    ("workers.service", "WorkerServicer._engine_request"),
    ("workers.service", "sampling_from_proto"),
    ("workers.kv.event_relay", "KvEventRelay.submit"),
    ("workers.engines.mock.scheduler", "Scheduler.schedule"),
    ("workers.engines.mock.scheduler", "Scheduler.complete"),
)

_ns: dict[str, int] = {}
_calls: dict[str, int] = {}
_lock = threading.RLock()  # timed functions may run on several threads; RLock: the
# SIGUSR1 handler runs in the main thread, maybe inside a timer's own update
_on = False


def _timed(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    clock = time.thread_time_ns

    @functools.wraps(func)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if not _on:
            return func(*args, **kwargs)
        t0 = clock()
        try:
            return func(*args, **kwargs)
        finally:
            spent = clock() - t0
            with _lock:
                _ns[name] = _ns.get(name, 0) + spent
                _calls[name] = _calls.get(name, 0) + 1
    return timed


# which targets each kind of process loads before it runs (by module prefix)
PROCESS_PREFIXES: dict[str, tuple[str, ...]] = {
    "services.frontend": ("services.", "starlette."),
    "services.router": ("services.router.", "services.common.", "services.indexer."),
    "services.indexer": ("services.indexer.", "services.common."),
    "workers": ("workers.", "services.common."),
}


def _prefixes(process: str) -> tuple[str, ...]:
    for name, prefixes in PROCESS_PREFIXES.items():
        if process == name or process.startswith(f"{name}."):
            return prefixes
    return ()


def install(process: str, targets: tuple[tuple[str, str], ...] = TARGETS) -> list[str]:
    """Imports the targets of ``process`` (the module about to run, see
    :data:`PROCESS_PREFIXES`) and wraps them; returns their names."""
    done = []
    for module, path in targets:
        if not module.startswith(_prefixes(process)):
            continue
        name = f"{module}.{path}"

        def timed(func: Callable[..., Any], name: str = name) -> Callable[..., Any]:
            if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
                raise TypeError(f"{name} is asynchronous: a timer cannot measure it")
            return _timed(name, func)
        wrap_function(module, path, timed)
        done.append(name)
    return done


def main() -> None:
    prefix, module = command_line()
    install(module)
    snapshots = 0
    cpu0 = 0

    def snapshot(*_: object) -> None:
        global _on
        nonlocal snapshots, cpu0
        snapshots += 1
        if snapshots == 1:
            cpu0, _on = time.process_time_ns(), True
        elif snapshots == 2:
            _on = False
            with _lock:
                functions = {n: {"ns": _ns[n], "calls": _calls[n]} for n in _ns}
            Path(f"{prefix}.timers.json").write_text(json.dumps({
                "cpu_ns": time.process_time_ns() - cpu0, "functions": functions}))
        Path(f"{prefix}.{snapshots}.done").touch()

    run_module(module, snapshot)


if __name__ == "__main__":
    main()
