"""Runs ``python -m MODULE ARGS`` with wall-clock stamps at the entry and exit of chosen
functions, and writes them between two SIGUSR1s:
``python -m bench.mesh_profile.stamps OUT_PREFIX MODULE [ARGS...]``.

The stage timeline's runner (:mod:`bench.mesh_profile.stages`). Where the profiler and
the timers say what a step costs in CPU, stamps say *when* it runs: the gaps between a
request's steps (waiting for a wake-up, for the loop to come round, for another process)
are where latency goes that no CPU counter shows.

Contract:

- Before the module runs, the :data:`STEPS` of its kind of process (a frontend's, or a
  worker fleet's: :func:`steps_for`) are imported and wrapped (``Class.method`` or
  ``function``; synchronous or ``async def``; a function's name is rebound in every
  ``services.*`` / ``workers.*`` module that imported the function itself). A step
  that is missing is skipped with a line on stderr.
- Between the first SIGUSR1 and the second, every call of a wrapped step appends
  ``(time.perf_counter_ns(), step, "+")`` at entry and ``(..., "-")`` at exit
  (``perf_counter`` is CLOCK_MONOTONIC: one clock for every process of this machine);
  the second signal writes them to ``OUT_PREFIX.stamps.json``. The k-th signal also
  writes ``OUT_PREFIX.k.done``, as the profiler does. A stamp costs ~1 µs.
- Only for benchmarks.
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.mesh_profile.prof import command_line, record_between_signals, wrap_function

# (module, function or Class.method): a non-streamed completion's steps, in order
FRONTEND_STEPS: tuple[tuple[str, str], ...] = (
    ("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol.data_received"),
    ("services.frontend.http_api", "_json_body"),
    ("services.frontend.openai_schema", "parse_completion"),
    ("services.frontend.fanout", "run"),
    ("services.frontend.pipeline", "Pipeline.prepare"),
    ("services.frontend.jobs", "sampling_proto"),
    ("services.frontend.router_calls", "RouterCalls.route"),
    ("services.router.service", "RouterServicer._check_route"),
    ("services.router.service", "RouterServicer._start"),
    ("services.router.overlaps", "EmbeddedSource.find_now"),
    ("services.router.core", "RouterCore.route"),
    ("services.router.core", "RouterCore._pick"),
    ("services.router.service", "RouterServicer._decide"),
    ("services.frontend.handoff", "Request.generate_request"),
    ("services.frontend.worker_stream", "WorkerStream.generate"),
    ("services.common.frames", "FramedProtocol.write"),
    ("services.common.frames", "FramedProtocol.data_received"),
    ("services.frontend.worker_stream", "StreamCall.feed"),
    ("services.frontend.pipeline", "Pipeline._finish"),
    ("services.frontend.shapes", "Shapes.full"),
    ("services.frontend.json_codec", "JsonAnswer.__init__"),
    ("uvicorn.protocols.http.httptools_impl", "RequestResponseCycle.send"),
    ("services.indexer.feed", "IndexFeed._apply"),
    ("services.router.embedded", "InProcessRouterStub.release_nowait"),
)
FLEET_STEPS: tuple[tuple[str, str], ...] = (
    ("services.common.frames", "FramedProtocol.data_received"),
    ("services.common.frames", "FramedProtocol.read"),
    ("workers.generate_stream", "GenerateStreams._take"),
    ("workers.generate_stream", "GenerateStreams._call"),
    ("services.common.telemetry", "remote_context"),
    ("workers.service", "WorkerServicer._engine_request"),
    ("workers.engines.mock.scheduler", "Scheduler.schedule"),
    ("workers.engines.mock.scheduler", "Scheduler.complete"),
    ("workers.kv.event_relay", "KvEventRelay.submit"),
    ("services.common.frames", "FramedProtocol.write"),
)

_log: list[tuple[int, str, str]] = []
_on = False


def steps_for(module: str) -> tuple[tuple[str, str], ...]:
    """The steps stamped in a process running ``module``."""
    if module.startswith("services.frontend"):
        return FRONTEND_STEPS
    if module.startswith("workers"):
        return FLEET_STEPS
    return ()


def stamped(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func``, stamping its entry and exit while recording is on."""
    clock = time.perf_counter_ns
    log = _log

    if inspect.iscoroutinefunction(func):
        @functools.wraps(func)
        async def stamped_async(*args: Any, **kwargs: Any) -> Any:
            if not _on:
                return await func(*args, **kwargs)
            log.append((clock(), name, "+"))
            try:
                return await func(*args, **kwargs)
            finally:
                log.append((clock(), name, "-"))
        return stamped_async

    @functools.wraps(func)
    def stamped_sync(*args: Any, **kwargs: Any) -> Any:
        if not _on:
            return func(*args, **kwargs)
        log.append((clock(), name, "+"))
        try:
            return func(*args, **kwargs)
        finally:
            log.append((clock(), name, "-"))
    return stamped_sync


def install(steps: tuple[tuple[str, str], ...]) -> list[str]:
    """Wraps ``steps``; returns the names of those found."""
    done = []
    for module, path in steps:
        try:
            wrap_function(module, path, functools.partial(stamped, path))
        except (ImportError, AttributeError) as exc:
            print(f"stamps: {module}.{path} skipped: {exc}", file=sys.stderr)
            continue
        done.append(path)
    return done


def set_recording(on: bool) -> None:
    """Starts (or stops) recording stamps (tests; the runner's signals)."""
    global _on
    _on = on


def recorded() -> list[tuple[int, str, str]]:
    """The stamps recorded so far."""
    return list(_log)


def main() -> None:
    prefix, module = command_line()
    install(steps_for(module))

    def stop_and_write() -> None:
        set_recording(False)
        Path(f"{prefix}.stamps.json").write_text(json.dumps(recorded()))

    record_between_signals(prefix, module, lambda: set_recording(True), stop_and_write)


if __name__ == "__main__":
    main()
