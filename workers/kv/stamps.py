"""Per-request stage stamps for benchmarks (``bench.pd_overhead``), opt-in by environment.

Contract: with ``KVMESH_PD_STAMPS=<folder>`` in a process's environment,
:func:`stamp_writer` returns that process's :class:`StampWriter`, which appends one JSON
object per line to ``<folder>/stamps-<pid>.jsonl``: ``{"t": time.time(), "ev": ...,
"req": request id or null, "pid": ...}`` plus the event's fields. Without the variable it
returns None and nothing is written. The events of the NIXL handoff are listed in
:mod:`workers.kv.nixl_quiet`; :mod:`workers.engines.vllm_engine` adds ``e_first_token``
(see there). Imports no vLLM.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

STAMPS_ENV = "KVMESH_PD_STAMPS"


class StampWriter:
    """Appends stage stamps as JSON lines to ``<folder>/stamps-<pid>.jsonl`` (thread-safe:
    the NIXL handshake runs in a background thread)."""

    def __init__(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        self._file = open(  # noqa: SIM115 - lives as long as the process
            os.path.join(folder, f"stamps-{os.getpid()}.jsonl"), "a", buffering=1)
        self._lock = threading.Lock()

    def __call__(self, ev: str, req: str | None = None, **fields: Any) -> None:
        line = json.dumps({"t": time.time(), "ev": ev, "req": req, "pid": os.getpid(),
                           **fields})
        with self._lock:
            self._file.write(line + "\n")


def handoff_role(params: dict[str, Any] | None) -> str | None:
    """A request's side of a P/D handoff by its ``kv_transfer_params``: ``d`` (remote
    prefill), ``p`` (remote decode), None (no handoff)."""
    if not params:
        return None
    if params.get("do_remote_prefill"):
        return "d"
    if params.get("do_remote_decode"):
        return "p"
    return None


_WRITER: StampWriter | None = None


def stamp_writer() -> StampWriter | None:
    """The process's writer when ``KVMESH_PD_STAMPS`` is set, else None."""
    global _WRITER
    folder = os.environ.get(STAMPS_ENV)
    if not folder:
        return None
    if _WRITER is None:
        _WRITER = StampWriter(folder)
    return _WRITER
