"""How many Python calls a lone request's path makes in the frontend and in the worker
fleet: the measure of a request's code footprint, which is what a lone request pays for
on this machine (a process idle for milliseconds runs cold, ~1-2 µs per call; the floor of
a Python hop, :mod:`bench.mesh_profile.proxy_floor`, makes ~20).

``python -m bench.mesh_profile.calls [--requests 20] [--out bench/results] [--name
mesh_calls]``

Contracts:

- Starts :func:`bench.mesh_profile.run.start`'s mesh with the router embedded (etcd,
  Redis, one ``workers.fleet`` of 2 zero-timing mock workers, the frontend), the frontend
  and the fleet under :mod:`bench.mesh_profile.calltrace`; every child is stopped by PID.
- Load, from this process: 100 warm-up requests 10 ms apart, then ``--requests`` POSTs of
  ``/v1/completions`` (64 token ids, ``max_tokens`` 1, temperature 0) one at a time, 50
  ms apart (each request's calls alone in its window), with the lean HTTP client.
- Per request, the frontend's calls from the first after its send: ``before_worker``, up
  to the first write of a frame to the worker (:data:`TO_WORKER`, included);
  ``after_worker``, from the first frame read from the worker after it
  (:data:`FROM_WORKER`) up to the answer's write (:data:`ANSWER`, included); and the
  fleet's ``worker``: from its first call in the window to its first frame written back.
  Each a count of Python call events (a function entered, a generator or coroutine
  resumed). Reported: per count the median over the requests, and for the request with
  the median total its calls by module and in order (``sequence``). A request whose
  markers are missing fails the bench (the path changed: update the markers).
- Writes ``<out>/<name>.json`` and prints the counts. Only on this machine's loopback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.mesh_profile.stages import record_lone

RESULTS = Path(__file__).resolve().parents[1] / "results"
WARMUP = 100
TO_WORKER = "FramedProtocol._send"  # a frame written: the worker's, or the answer's
FROM_WORKER = "FramedProtocol.data_received"
ANSWER = "DirectPostsMixin._direct_write"

Call = tuple[int, str, str]  # (ns, file, qualified name)


def _where(file: str) -> str:
    """A call's module, short: ``services/frontend/pipeline.py``, ``uvicorn``, ..."""
    for root in ("/services/", "/workers/", "/bench/"):
        if root in file:
            return root.strip("/") + "/" + file.split(root, 1)[1]
    if "site-packages/" in file:
        return file.split("site-packages/", 1)[1].split("/", 1)[0]
    if "/lib/python" in file:
        return "stdlib/" + file.rsplit("/", 1)[-1]
    return file


def _index(calls: Sequence[Call], name: str, start: int = 0) -> int:
    for i in range(start, len(calls)):
        if calls[i][2] == name:
            return i
    raise RuntimeError(f"no call of {name} in the request's window: the path changed")


def split(front: Sequence[Call], fleet: Sequence[Call]) -> dict[str, Any]:
    """One request's counts (see the module docstring) from its window's calls."""
    to_worker = _index(front, TO_WORKER)
    back = _index(front, FROM_WORKER, to_worker + 1)
    answer = _index(front, ANSWER, back)
    worker_end = _index(fleet, TO_WORKER)
    return {"before_worker": to_worker + 1, "after_worker": answer - back + 1,
            "worker": worker_end + 1,
            "path": [f"{_where(c[1])}:{c[2]}" for c in
                     (*front[:to_worker + 1], *front[back:answer + 1])]}


def summarize(windows: Sequence[tuple[Sequence[Call], Sequence[Call]]]) -> dict[str, Any]:
    """The report's counts over the requests' windows (frontend's calls, fleet's)."""
    rows = [split(f, w) for f, w in windows]
    if not rows:
        raise RuntimeError("no request was measured")
    totals = [r["before_worker"] + r["after_worker"] for r in rows]
    median = rows[int(np.argsort(totals)[len(totals) // 2])]
    by_module = Counter(p.rsplit(":", 1)[0] for p in median["path"])
    return {
        "frontend_calls_p50": float(np.median(totals)),
        "before_worker_p50": float(np.median([r["before_worker"] for r in rows])),
        "after_worker_p50": float(np.median([r["after_worker"] for r in rows])),
        "worker_calls_p50": float(np.median([r["worker"] for r in rows])),
        "median_request": {"by_module": dict(by_module.most_common()),
                           "sequence": median["path"]},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    requests, logs = record_lone("bench.mesh_profile.calltrace", "calls.json", args.requests,
                                 0.05, WARMUP, 0.01)

    def window(calls: list[Call], sent: int, answered: int) -> list[Call]:
        return [c for c in calls if sent <= c[0] <= answered]

    windows = [(window(logs["frontend"], s, a), window(logs["fleet"], s, a))
               for s, a in requests]
    return {"benchmark": "mesh_calls", "requests": args.requests, "router": "embedded",
            "engine": "mock (zero timing), 2 workers", **summarize(windows)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.mesh_profile.calls",
                                description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="mesh_calls")
    args = p.parse_args(argv)
    report = run(args)
    print(json.dumps({k: v for k, v in report.items() if k != "median_request"}, indent=1))
    print(json.dumps(report["median_request"]["by_module"], indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"-> {out}/{args.name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
