"""The router's Prometheus metrics and their HTTP endpoint.

Contract: :class:`RouterMetrics` holds one registry per router (several routers may share
a process in tests); the gauges read the core at scrape time (from the endpoint's thread:
they call only the core's thread-safe counts). :func:`serve_metrics` serves the registry
at ``http://host:port/metrics`` (0 = any free port) in a daemon thread and returns a
:class:`MetricsEndpoint` (its ``port``; ``close()`` stops it).

| metric | meaning |
|---|---|
| ``kvmesh_router_inflight_requests`` | requests routed and not yet released (gauge) |
| ``kvmesh_router_inflight_expired_total`` | in-flight entries dropped by the TTL: each \
one a caller that never released (a bug) |
| ``kvmesh_router_failure_reports_total`` | ``ReportFailure`` calls about a known worker |
| ``kvmesh_router_unroutable_workers`` | workers marked unroutable now (gauge) |
| ``kvmesh_router_errors_total{method}`` | requests that failed unexpectedly (INTERNAL) |
| ``kvmesh_router_routes_total{plan}`` | requests routed, by plan: ``agg``, ``disagg``, \
``decode_alone`` (D prefills itself), ``prefill_whole`` (P serves it whole) |
| ``kvmesh_router_replica_peers`` | other router replicas whose in-flight load counts \
here (replica sync; gauge) |
| ``kvmesh_router_replica_sync_failures_total{op}`` | replica sync Redis failures: \
``publish`` or ``read`` |
| ``kvmesh_router_load_poll_failures_total`` | worker ``GetLoad`` polls that failed (the \
worker's last load report stays in use) |
| ``kvmesh_gc_*``, ``python_gc_*`` | the process's garbage collector \
(:func:`~services.common.gc_heap.register_gc_metrics`) |
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from services.common.gc_heap import register_gc_metrics
from services.router.core import RouterCore


class RouterMetrics:
    """The metrics of one router (see the module docstring)."""

    def __init__(self, core: RouterCore) -> None:
        r = self.registry = CollectorRegistry()
        register_gc_metrics(r)
        self.inflight = Gauge("kvmesh_router_inflight_requests",
                              "Requests routed and not yet released", registry=r)
        self.inflight.set_function(core.in_flight_count)
        self.expired = Counter("kvmesh_router_inflight_expired",
                               "In-flight entries dropped by the TTL (never released)",
                               registry=r)
        self.failure_reports = Counter("kvmesh_router_failure_reports",
                                       "Failure reports about known workers", registry=r)
        self.unroutable = Gauge("kvmesh_router_unroutable_workers",
                                "Workers marked unroutable by failure reports", registry=r)
        self.unroutable.set_function(core.unroutable_count)
        self.errors = Counter("kvmesh_router_errors", "Requests that failed unexpectedly",
                              ["method"], registry=r)
        self.routes = Counter("kvmesh_router_routes", "Requests routed, by plan", ["plan"],
                              registry=r)
        self._routed: dict[str, Any] = {}  # plan kind -> its child of ``routes``
        self.peers = Gauge("kvmesh_router_replica_peers",
                           "Other router replicas whose in-flight load counts here",
                           registry=r)
        self.peers.set_function(core.peers.count)
        self.sync_failures = Counter("kvmesh_router_replica_sync_failures",
                                     "Replica sync Redis failures", ["op"], registry=r)
        self.load_poll_failures = Counter("kvmesh_router_load_poll_failures",
                                          "Worker GetLoad polls that failed", registry=r)

    def routed(self, kind: str) -> None:
        """Counts one request routed with a plan of ``kind`` (``routes``' child, kept:
        no label checks or lock per request)."""
        child = self._routed.get(kind)
        if child is None:
            child = self._routed[kind] = self.routes.labels(kind)
        child.inc()


@dataclass
class MetricsEndpoint:
    """A running ``/metrics`` HTTP server."""

    port: int
    _server: Any

    async def close(self) -> None:
        """Stops the server (its loop polls every 0.5 s: waited for off the event loop)."""
        await asyncio.to_thread(self._server.shutdown)
        self._server.server_close()


def serve_metrics(metrics: RouterMetrics, host: str, port: int) -> MetricsEndpoint:
    """Starts the endpoint on ``host:port`` (0 = any free)."""
    server, _ = start_http_server(port, addr=host, registry=metrics.registry)
    return MetricsEndpoint(int(server.server_port), server)
