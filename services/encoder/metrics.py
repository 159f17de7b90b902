"""The encoder's Prometheus metrics and their ``/metrics`` endpoint.

Contract: :class:`EncoderMetrics` holds one registry per encoder: the histograms the
servicer observes (``kvmesh_encoder_queue_seconds``: a miss's wait in E's engine queue;
``kvmesh_encoder_encode_seconds``: its encode, scheduling to answer;
``kvmesh_encoder_embedding_bytes``: bytes of each embedding handed out) and a collector
that reads the servicer's ``stats()`` at scrape time (``kvmesh_encoder_cache_hits_total``,
``_misses_total``, ``_evictions_total``, ``_stale_total``, ``kvmesh_encoder_encodes_total``
(vision encoder runs, E's connector), ``kvmesh_encoder_refused_total``,
``kvmesh_encoder_cache_entries`` / ``_bytes`` / ``_budget_bytes``), and the process's
garbage collector's (``kvmesh_gc_*``, ``python_gc_*``,
:func:`~services.common.gc_heap.register_gc_metrics`).
:func:`serve_metrics` serves it (0 = any free port) and returns the router's
:class:`~services.router.metrics.MetricsEndpoint` (``port``, ``close()``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.gc_heap import register_gc_metrics
from services.router.metrics import MetricsEndpoint

_COUNTERS = ("hits", "misses", "evictions", "stale", "encodes", "published", "refused")
_GAUGES = ("entries", "bytes", "budget_bytes", "retained")
_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _StatsCollector(Collector):
    def __init__(self, stats: Callable[[], Mapping[str, int]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        for name in _COUNTERS:
            prefix = "cache_" if name in ("hits", "misses", "evictions", "stale") else ""
            c = CounterMetricFamily(f"kvmesh_encoder_{prefix}{name}", f"encoder {name}")
            c.add_metric([], float(s.get(name, 0)))
            yield c
        for name in _GAUGES:
            g = GaugeMetricFamily(f"kvmesh_encoder_cache_{name}", f"embedding cache {name}")
            g.add_metric([], float(s.get(name, 0)))
            yield g


class EncoderMetrics:
    """See the module docstring."""

    def __init__(self, stats: Callable[[], Mapping[str, int]]) -> None:
        r = self.registry = CollectorRegistry()
        register_gc_metrics(r)
        self.queue = Histogram("kvmesh_encoder_queue_seconds",
                               "Wait of an image in the encoder engine's queue",
                               buckets=_SECONDS, registry=r)
        self.encode = Histogram("kvmesh_encoder_encode_seconds",
                                "Encode time of an image (scheduled to answered)",
                                buckets=_SECONDS, registry=r)
        self.embedding_bytes = Histogram(
            "kvmesh_encoder_embedding_bytes", "Bytes of each embedding handed out",
            buckets=tuple(float(1 << k) for k in range(10, 27, 2)), registry=r)
        r.register(_StatsCollector(stats))


def serve_metrics(metrics: EncoderMetrics, host: str, port: int) -> MetricsEndpoint:
    """Starts the endpoint on ``host:port`` (0 = any free)."""
    server, _ = start_http_server(port, addr=host, registry=metrics.registry)
    return MetricsEndpoint(int(server.server_port), server)
