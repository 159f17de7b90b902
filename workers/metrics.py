"""The worker's Prometheus endpoint: engine load and cumulative engine counters.

Contract: :func:`serve_metrics` starts an HTTP server on ``host:port`` (0 = any free port)
in a daemon thread, with a registry of its own holding one collector that reads the
engine at scrape time, and returns the bound port. Metrics (labels ``worker_id``, ``role``):

- ``kvmesh_worker_requests_running`` / ``_waiting`` / ``kvmesh_worker_kv_usage`` /
  ``kvmesh_worker_kv_blocks``: the engine's load. On a prefill worker, KV usage with no
  running request is the blocks still held for decode workers to read.
- ``kvmesh_engine_<counter>_total``: the engine's counters, e.g. ``kv_transfer_bytes``
  (bytes this side moved over NIXL), ``kv_transfers``, ``kv_transfer_failures`` (incl.
  holds released after their lease expired), ``kv_external_loaded_tokens`` (tokens
  received from a peer), ``prefix_cache_hits_tokens``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from workers.engines.base import Engine


class EngineCollector(Collector):
    """Reads load and counters from the engine at each scrape."""

    def __init__(self, engine: Engine, worker_id: str, role: str) -> None:
        self._engine = engine
        self._labels = [worker_id, role]

    def collect(self) -> Iterator[Metric]:
        load = self._engine.load()
        names = ["worker_id", "role"]
        for name, doc, value in (
            ("kvmesh_worker_requests_running", "Requests running", load.num_running),
            ("kvmesh_worker_requests_waiting", "Requests waiting", load.num_waiting),
            ("kvmesh_worker_kv_usage", "Used fraction of KV blocks", load.kv_usage),
            ("kvmesh_worker_kv_blocks", "KV blocks in the cache", load.kv_total_blocks),
        ):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(self._labels, float(value))
            yield g
        for key, value in sorted(self._engine.counters().items()):
            c = CounterMetricFamily(f"kvmesh_engine_{key}", f"Engine counter {key}",
                                    labels=names)
            c.add_metric(self._labels, float(value))
            yield c


def serve_metrics(engine: Engine, worker_id: str, role: str, host: str, port: int) -> int:
    """Starts the endpoint; returns its port."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, worker_id, role))
    server, _ = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
