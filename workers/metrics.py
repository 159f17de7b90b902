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

The process's garbage collector too (``kvmesh_gc_*``, ``python_gc_*``,
:func:`~services.common.gc_heap.register_gc_metrics`). An engine with a
``metrics_collector`` (a Prometheus ``Collector``) has it served too: the AFD engines'
``kvmesh_afd_*`` timings (:mod:`workers.engines.afd.observe`).

Per-request metrics, observed by the servicer (:mod:`workers.service`) into the
:class:`WorkerMetrics` of its worker id (:func:`worker_metrics`, shared by the servicer
and this endpoint; label ``worker_id``):

| metric | meaning |
|---|---|
| ``kvmesh_worker_queue_seconds`` | the LM engine's queue time per request (vLLM: queued \
→ first scheduled, from EngineCore's timestamps), observed with its first token |
| ``kvmesh_worker_embedding_transfer_seconds`` | one embedding's NIXL READ from E (EPD \
consumer: header + payload, then the header again), issue → seen complete by a \
scheduling step |
| ``kvmesh_worker_embedding_transfer_bytes_total`` | embedding bytes READ from encoders |
| ``kvmesh_worker_embedding_transfers_total{outcome}`` | embeddings a request came with, \
by outcome: ``read`` (its READ), ``shared`` (another live request's READ brought it), \
``fallback`` (encoded here instead), ``unreported`` (no report came back: the prefix \
cache held the image's tokens so nothing was read, or vLLM ended the request without a \
final EngineCore output, e.g. a stop string or an abort) |
| ``kvmesh_worker_embedding_fallbacks_total{reason}`` | embeddings encoded here after a \
failed READ, by reason (``bad_descriptor``, ``no_staging_space``, ``read_error``, \
``timeout``, ``bad_slot``) |
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.gc_heap import register_gc_metrics
from workers.ec.core import TransferReport
from workers.engines.base import Engine

_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                     2.5, 10)


class WorkerMetrics(Collector):
    """One worker's per-request metrics (see the module docstring); a Collector, so an
    endpoint's registry can serve it."""

    def __init__(self, worker_id: str) -> None:
        r = CollectorRegistry(auto_describe=True)
        self._registry = r
        self.worker_id = worker_id
        names = ["worker_id"]
        self.queue = Histogram("kvmesh_worker_queue_seconds",
                               "LM engine queue time per request", names,
                               buckets=_QUEUE_BUCKETS, registry=r).labels(worker_id)
        self.transfer = Histogram("kvmesh_worker_embedding_transfer_seconds",
                                  "NIXL READ of one embedding from an encoder", names,
                                  buckets=_TRANSFER_BUCKETS, registry=r).labels(worker_id)
        self.transfer_bytes = Counter("kvmesh_worker_embedding_transfer_bytes",
                                      "Embedding bytes READ from encoders", names,
                                      registry=r).labels(worker_id)
        self._transfers = Counter("kvmesh_worker_embedding_transfers",
                                  "Embeddings a request came with, by outcome",
                                  [*names, "outcome"], registry=r)
        self._fallbacks = Counter("kvmesh_worker_embedding_fallbacks",
                                  "Embeddings encoded here after a failed READ, by reason",
                                  [*names, "reason"], registry=r)

    def observe_queue(self, seconds: float) -> None:
        self.queue.observe(max(0.0, seconds))

    def observe_transfers(self, reports: Iterable[TransferReport], unreported: int) -> None:
        """One request's transfer reports, and how many of its embeddings had none."""
        for rep in reports:
            self._transfers.labels(self.worker_id, rep.outcome).inc()
            if rep.outcome == "read":
                self.transfer.observe(rep.seconds)
                self.transfer_bytes.inc(rep.nbytes)
            elif rep.outcome == "fallback":
                self._fallbacks.labels(self.worker_id, rep.reason or "unknown").inc()
        if unreported:
            self._transfers.labels(self.worker_id, "unreported").inc(unreported)

    def collect(self) -> Iterator[Metric]:
        yield from self._registry.collect()

    def sample(self, name: str, **labels: str) -> float:
        """A sample's value (0 when absent), e.g. for tests."""
        value = self._registry.get_sample_value(name, {"worker_id": self.worker_id, **labels})
        return value or 0.0


_LOCK = threading.Lock()
_BY_WORKER: dict[str, WorkerMetrics] = {}


def worker_metrics(worker_id: str) -> WorkerMetrics:
    """The :class:`WorkerMetrics` of ``worker_id`` (one per id in the process)."""
    with _LOCK:
        m = _BY_WORKER.get(worker_id)
        if m is None:
            m = _BY_WORKER[worker_id] = WorkerMetrics(worker_id)
        return m


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
    register_gc_metrics(registry)
    registry.register(EngineCollector(engine, worker_id, role))
    registry.register(worker_metrics(worker_id))
    extra = getattr(engine, "metrics_collector", None)  # an engine's own (AFD: timings)
    if extra is not None:
        registry.register(extra)
    server, _ = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
