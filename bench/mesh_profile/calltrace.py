"""Runs ``python -m MODULE ARGS`` recording every Python function call of its main thread
(the event loop) between two SIGUSR1s: ``python -m bench.mesh_profile.calltrace
OUT_PREFIX MODULE [ARGS...]``. The runner of :mod:`bench.mesh_profile.calls`.

Contract: from the first SIGUSR1 to the second, a ``sys.setprofile`` hook on the main
thread appends ``(time.perf_counter_ns(), file, qualified name)`` for each ``call`` event
(a Python function entered, or a generator or coroutine resumed; not C functions); the
second signal writes them to ``OUT_PREFIX.calls.json``. The k-th signal also writes
``OUT_PREFIX.k.done``, as the profiler does. Only for benchmarks: the hook slows Python
code several times, so count calls with it, never time them.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from bench.mesh_profile.prof import command_line, record_between_signals

_log: list[tuple[int, str, str]] = []


def _hook(frame: FrameType, event: str, _: Any) -> None:
    if event == "call":
        code = frame.f_code
        _log.append((time.perf_counter_ns(), code.co_filename, code.co_qualname))


def main() -> None:
    prefix, module = command_line()

    def stop_and_write() -> None:
        sys.setprofile(None)
        Path(f"{prefix}.calls.json").write_text(json.dumps(_log))

    record_between_signals(prefix, module, lambda: sys.setprofile(_hook), stop_and_write)


if __name__ == "__main__":
    main()
