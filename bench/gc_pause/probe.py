"""Runs ``python -m MODULE ARGS`` and times one full garbage collection per SIGUSR1:
``python -m bench.gc_pause.probe OUT_PREFIX MODULE [ARGS...]``.

Contract: the k-th SIGUSR1 runs ``gc.collect()`` in the signal handler, so in the main
thread, the one the process's event loop runs on (what every request in flight would
wait for), and writes ``OUT_PREFIX.k.json``: ``full_collection_ms`` (its wall time),
``frozen`` (``gc.get_freeze_count()``) and ``tracked`` (objects the collector still
traverses, counted after the timing). Only for benchmarks.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

from bench.mesh_profile.prof import command_line, run_module


def main() -> None:
    prefix, module = command_line()
    signals = 0

    def probe(*_: object) -> None:
        nonlocal signals
        signals += 1
        t0 = time.perf_counter()
        gc.collect()
        ms = (time.perf_counter() - t0) * 1e3
        out = {"full_collection_ms": ms, "frozen": gc.get_freeze_count(),
               "tracked": len(gc.get_objects())}
        tmp = Path(f"{prefix}.{signals}.tmp")
        tmp.write_text(json.dumps(out))
        tmp.rename(f"{prefix}.{signals}.json")

    run_module(module, probe)


if __name__ == "__main__":
    main()
