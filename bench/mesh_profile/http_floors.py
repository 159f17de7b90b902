"""The paced floor of one HTTP hop on this machine: what a lone request (``--gap-ms``
apart, as at 100 req/s without overlap) costs through five Python HTTP servers that do no
work, from the lean client, so that the frontend's own cost and the added-latency goal
of issue 17 (mesh − direct worker call: p50 < 1 ms at 100 req/s) can be read against
the least an HTTP hop of Python costs here.

``python -m bench.mesh_profile.http_floors [--pairs 600] [--gap-ms 10] [--out
bench/results] [--name http_floors]``

Contracts:

- Each server runs in a child process of its own (``--serve KIND PORT``, uvloop, a free
  loopback port), stopped by PID at the end. Every one reads the request's JSON body and
  answers the same fixed one-token completion (:data:`ANSWER`, with a content-length):
  - ``asyncio-httptools``: an ``asyncio.Protocol`` feeding httptools' parser (the
    parser uvicorn runs), one request at a time per keep-alive connection, the answer in
    one write: about the least Python an HTTP/1.1 hop can run;
  - ``uvicorn-asgi``: uvicorn (httptools) and a bare ASGI callable;
  - ``kvmesh-http``: the frontend's HTTP layer with nothing behind it: uvicorn under
    :func:`services.frontend.http_server.http_config` with the completion route served
    by the protocol itself (``direct``: :class:`services.frontend.http_api.DirectRoute`,
    the body read under the limits and decoded as the frontend decodes it, a
    ``JsonAnswer``), as the frontend serves its completions;
  - ``kvmesh-asgi``: the same app and route served through uvicorn's ASGI cycle (the
    app's ASGI entry for direct POSTs: what the frontend ran before);
  - ``uvicorn-fastapi``: uvicorn and a FastAPI route (:func:`bench.mesh_profile.floors`'
    HTTP floor).
- Load: :func:`bench.frontend_vs_dynamo.client.paced_pairs` from this process, the five
  in a random order per round, each request ``--gap-ms`` after the one before (64 token
  ids, ``max_tokens`` 1, the answer checked), after 50 warm-up rounds; a failed answer
  fails the bench.
- Reports per server p50 / p90 / p99 and failed answers, ``paired_diff_p50_ms``
  (kvmesh-http − asyncio-httptools, round by round) and ``over_asyncio_p50_ms`` per
  server (its p50 − asyncio-httptools' p50). Writes ``<out>/<name>.json`` and a PNG of
  the p50s and p90s. Only on this machine's loopback; numbers drift with the machine, so
  only one run's servers are compared with each other.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import httptools

from bench.frontend_vs_dynamo.client import paced_pairs
from bench.mesh_profile.floors import http_app
from bench.router_overhead.run import MODEL
from services.common.procs import free_port, port_open, spawn, wait_until
from services.common.server import event_loop_factory

KINDS = ("kvmesh-http", "asyncio-httptools", "kvmesh-asgi", "uvicorn-asgi", "uvicorn-fastapi")
WARMUP_ROUNDS = 50
ANSWER: dict[str, Any] = {
    "id": "cmpl-floor", "object": "text_completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "text": " w", "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 64, "completion_tokens": 1, "total_tokens": 65}}
_BODY = json.dumps(ANSWER).encode()
_RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d"
             b"\r\n\r\n%s" % (len(_BODY), _BODY))


class _Hop(asyncio.Protocol):
    """``asyncio-httptools``' connection (module docstring); a request it cannot parse
    closes the connection."""

    def __init__(self) -> None:
        self._parser = httptools.HttpRequestParser(self)
        self._body: list[bytes] = []
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            assert self._transport is not None
            self._transport.close()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body, self._body = b"".join(self._body), []
        json.loads(body)
        assert self._transport is not None
        self._transport.write(_RESPONSE)


async def _asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """``uvicorn-asgi``'s app (lifespan off)."""
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    json.loads(b"".join(parts))
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(_BODY)).encode())]})
    await send({"type": "http.response.body", "body": _BODY})


def _kvmesh_app() -> Any:
    """The ``kvmesh-*`` floors' app: the frontend's app class and completion route
    (:class:`services.frontend.http_api.DirectRoute`: no API keys, the body read and
    decoded as the frontend does) with a fixed answer, registered both ways."""
    from starlette.requests import Request

    from services.frontend import http_api
    from services.frontend.auth import ApiKeys, Tenant
    from services.frontend.json_codec import JsonAnswer

    app = http_api.DirectPostsApp(docs_url=None, redoc_url=None)
    limits = http_api.HttpLimits()
    keys = ApiKeys(())

    async def fixed(body: Any, who: Tenant) -> JsonAnswer:
        return JsonAnswer(ANSWER)

    async def completions(request: Request) -> JsonAnswer:
        await http_api._json_body(request, limits)
        return JsonAnswer(ANSWER)

    app.direct_posts["/v1/completions"] = completions
    app.direct_routes[b"/v1/completions"] = http_api.DirectRoute(
        "/v1/completions", limits, lambda header: http_api.authenticate(keys, header), fixed)
    return app


async def _serve(kind: str, port: int) -> None:
    if kind == "asyncio-httptools":
        server = await asyncio.get_running_loop().create_server(_Hop, "127.0.0.1", port)
        await server.serve_forever()
        return
    import uvicorn

    from services.frontend.http_server import http_config

    if kind.startswith("kvmesh-"):
        app = _kvmesh_app()
        config = http_config(app, max_connections=64, keep_alive_s=60, header_timeout_s=60,
                             direct=app.direct_routes if kind == "kvmesh-http" else None)
    else:
        app = _asgi if kind == "uvicorn-asgi" else http_app(ANSWER)
        config = uvicorn.Config(app, log_level="warning", lifespan="off", http="httptools")
    config.host, config.port, config.loop, config.access_log = "127.0.0.1", port, "none", False
    await uvicorn.Server(config).serve()


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(report["servers"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(kinds))
    ax.bar([x - 0.2 for x in xs], [report["servers"][k]["p50_ms"] for k in kinds], 0.4,
           label="p50")
    ax.bar([x + 0.2 for x in xs], [report["servers"][k]["p90_ms"] for k in kinds], 0.4,
           label="p90")
    ax.set_xticks(list(xs), kinds, fontsize=8)
    ax.set_ylabel("ms per request")
    ax.set_title(f"one HTTP hop, a request every {report['gap_ms']:.0f} ms (lean client)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure(pairs: int, gap_s: float) -> dict[str, Any]:
    """Starts the servers, runs the paced rounds, stops them (module docstring)."""
    logs = Path(tempfile.mkdtemp(prefix="kvmesh-http-floors-"))
    children, urls = [], {}
    try:
        for kind in KINDS:
            port = free_port()
            children.append(spawn(f"floor-{kind}", [
                sys.executable, "-m", "bench.mesh_profile.http_floors", "--serve", kind,
                str(port)], logs))
            wait_until(functools.partial(port_open, "127.0.0.1", port), children[-1], 60,
                       f"{kind} to listen")
            urls[kind] = f"http://127.0.0.1:{port}"
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            warm = runner.run(paced_pairs(urls, MODEL, WARMUP_ROUNDS, 0.0, seed=1,
                                          offset=10_000_000))
            got = runner.run(paced_pairs(urls, MODEL, pairs, gap_s))
    finally:
        for child in children:
            child.stop()
    failed = {k: warm[k]["first_errors"] or got[k]["first_errors"] for k in KINDS
              if warm[k]["errors"] or got[k]["errors"]}
    if failed:  # a floor that answers wrongly measures nothing
        raise RuntimeError(f"a floor server failed its answers: {failed}")
    base = got["asyncio-httptools"]["p50_ms"]
    return {"servers": {k: got[k] for k in KINDS},
            "paired_diff_p50_ms": got["paired_diff_p50_ms"], "gap_ms": got["gap_ms"],
            "over_asyncio_p50_ms": {k: got[k]["p50_ms"] - base for k in KINDS}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.mesh_profile.http_floors",
                                description=__doc__.splitlines()[0])
    p.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    p.add_argument("--pairs", type=int, default=600)
    p.add_argument("--gap-ms", type=float, default=10.0)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--name", default="http_floors")
    args = p.parse_args(argv)
    if args.serve:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(_serve(args.serve[0], int(args.serve[1])))
        return 0
    report = {"benchmark": "http_floors", "pairs": args.pairs, "cpus": os.cpu_count(),
              **measure(args.pairs, args.gap_ms / 1e3)}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps(report, indent=1))
    plot(report, path.with_suffix(".png"))
    for kind in KINDS:
        s = report["servers"][kind]
        print(f"{kind:>18}  p50 {s['p50_ms']:.3f} ms  p90 {s['p90_ms']:.3f}  p99 "
              f"{s['p99_ms']:.3f}  failed {s['errors']}")
    print(f"kvmesh-http − asyncio-httptools, paired p50: {report['paired_diff_p50_ms']:.3f} ms")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
