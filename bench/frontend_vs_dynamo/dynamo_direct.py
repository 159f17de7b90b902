"""A direct call to a Dynamo worker, timed in a process of Dynamo's own venv: the anchor of
Dynamo's added latency in :mod:`bench.frontend_vs_dynamo.added`.

Run by ``.dynvenv``'s Python as a script (``python dynamo_direct.py ENDPOINT``, in the
environment of :func:`~bench.frontend_vs_dynamo.dynamo_side.dynamo_env` for the mesh's
discovery folder): it imports only the standard library and Dynamo's runtime, never
kvmesh (``.dynvenv`` has none of kvmesh's dependencies).

Contracts:

- :func:`main` connects a ``DistributedRuntime`` (file discovery, TCP request plane, ZMQ
  event plane: the mesh's), takes a client of ``ENDPOINT`` (``namespace.component.
  endpoint``, the mocker's ``dynamo.backend.generate``), waits for its instances, and
  serves :func:`serve` on stdin / stdout. A call is Dynamo's direct worker call:
  ``client.round_robin(request)`` of a pre-processed request (the token ids, ``max_tokens``
  and ``ignore_eos``, temperature 0), the whole stream read; its answer must hold exactly
  ``max_tokens`` token ids, else the call fails.
- :func:`serve` (``call``, ``lines`` in, ``write`` out) answers one JSON line per command
  line, in order: first ``{"ready": true}``; then for ``{"op": "call", "id": k,
  "token_ids": [...], "max_tokens": n}`` one call timed here (``time.perf_counter``: send
  to the end of its stream) as ``{"id": k, "ok": true, "s": seconds, "cpu_s": this
  process's CPU seconds over the call (every thread: Dynamo's runtime threads too)}`` or
  ``{"id": k, "ok": false, "error": "..."}``; for ``{"op": "quit"}`` (or the end of
  input) it returns. Any other line is answered ``{"id": null, "ok": false, "error":
  ...}`` naming it. The ``id`` lets the caller tell an answer from a late one to a call
  it gave up on. Only for benchmarks.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

Call = Callable[[list[int], int], Awaitable[None]]


async def serve(call: Call, lines: AsyncIterator[str], write: Callable[[str], None]) -> None:
    """The command loop (see the module docstring)."""
    write(json.dumps({"ready": True}))
    async for line in lines:
        try:
            cmd = json.loads(line)
            op = cmd.get("op") if isinstance(cmd, dict) else None
        except ValueError:
            op = None
        if op == "quit":
            return
        if op != "call":
            write(json.dumps({"id": None, "ok": False,
                              "error": f"unknown command {line.strip()[:80]!r}"}))
            continue
        cpu0, t0 = time.process_time(), time.perf_counter()
        try:
            await call(list(cmd["token_ids"]), int(cmd["max_tokens"]))
        except Exception as exc:  # noqa: BLE001 - reported to the caller, which counts it
            write(json.dumps({"id": cmd.get("id"), "ok": False,
                              "error": f"{type(exc).__name__}: {exc}"}))
            continue
        took, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        write(json.dumps({"id": cmd.get("id"), "ok": True, "s": took, "cpu_s": cpu}))


async def _stdin_lines() -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        yield line.decode()


def _write(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def _main(endpoint: str) -> None:
    from dynamo._core import DistributedRuntime  # .dynvenv only
    from dynamo.runtime.logging import configure_dynamo_logging

    configure_dynamo_logging()  # DYN_LOG (warn): no log line per call
    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp",
                                 event_plane="zmq")
    client = await runtime.endpoint(endpoint).client()
    await client.wait_for_instances()

    async def call(token_ids: list[int], max_tokens: int) -> None:
        request: dict[str, Any] = {
            "token_ids": token_ids, "stop_conditions": {"max_tokens": max_tokens,
                                                        "ignore_eos": True},
            "sampling_options": {"temperature": 0.0}, "output_options": {},
            "eos_token_ids": [], "annotations": []}
        got = 0
        async for out in await client.round_robin(request, annotated=False):
            got += len(out.get("token_ids") or ())
        if got != max_tokens:
            raise RuntimeError(f"{got} tokens, not {max_tokens}")

    try:
        await serve(call, _stdin_lines(), _write)
    finally:
        runtime.shutdown()


def main() -> None:
    asyncio.run(_main(sys.argv[1]))  # the default loop, as the measuring process's


if __name__ == "__main__":
    main()
