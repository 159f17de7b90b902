"""AFD timing: connector and FFN wrappers that measure, and the Prometheus metrics.

The engine core keeps cumulative :class:`~workers.engines.afd.engine.ExecStats` and
:class:`~workers.engines.afd.ffn_server.FfnStats`; what they cannot see (per message
round trips, the FFN's queueing) is measured by wrapping the connector and the FFN side,
so the core stays unchanged. Every wrapper is an exact pass-through (same tensors, same
exceptions); it only reads the clock around the inner call.

Definitions (what each metric means):

- *transfer* (per layer message, either side): the time in ``send_*`` — the staging copy
  into the pre-registered slot plus the notification (shared memory: a 32-byte header on
  the socket; NIXL: the WRITE polled to completion).
- *round trip* (attention side, per layer message): end of the attention output's send →
  the FFN's answer in hand: both transfers, the FFN's queue and its compute.
- *FFN queue* (FFN side, per message): the message's arrival (``recv_attn_output``
  returned it) → the start of the FFN compute of the batch it went into.
- *idle*: attention side, the time blocked in ``recv_ffn_output`` (waiting for the FFN);
  FFN side, the time blocked in ``recv_attn_output`` (nothing to do).
- *overlap ratio* (attention side, cumulative): ``1 - wait / round_trip``: the share of
  the remote leg (transfer + FFN queue + FFN compute) hidden behind this side's own
  attention compute. One microbatch hides nothing (about 0); with two microbatch
  ping-pong one microbatch's remote leg runs during the other's attention.
- *TPOT*: per request, (last token − first token) / (tokens − 1).

:class:`AfdMetrics` is a Prometheus ``Collector`` (the worker's ``/metrics`` registers
it, :func:`workers.metrics.serve_metrics`); metric names are listed in its
``collect``. All observation methods are thread-safe (the engine thread observes, the
scrape thread reads).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from workers.engines.afd.connector import AfdConnector, AfdContext
from workers.engines.afd.model import FfnSide

Clock = Callable[[], float]
_LAYER_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025,
                  0.05, 0.1, 0.5)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


@dataclass
class LegTotals:
    """Cumulative seconds and counts of one side's connector (thread-safe via the lock of
    the owner)."""

    transfer_s: float = 0.0
    wait_s: float = 0.0
    round_trip_s: float = 0.0
    messages: int = 0
    queue_s: float = 0.0
    compute_s: float = 0.0

    def copy(self) -> LegTotals:
        return LegTotals(self.transfer_s, self.wait_s, self.round_trip_s, self.messages,
                         self.queue_s, self.compute_s)


class AfdMetrics(Collector):
    """One AFD worker's metrics (module docstring); ``side`` is attention or ffn."""

    def __init__(self, worker_id: str, side: str) -> None:
        r = CollectorRegistry(auto_describe=True)
        self._registry = r
        self.side = side
        self._lock = threading.Lock()
        self.totals = LegTotals()
        self.attn_compute_s = 0.0
        self.idle_no_work_s = 0.0
        labels = ["worker_id", "side"]
        self._labels = [worker_id, side]
        self.transfer = Histogram(
            "kvmesh_afd_layer_transfer_seconds",
            "AFD: one layer's activation send (staging copy + notification)", labels,
            buckets=_LAYER_BUCKETS, registry=r).labels(worker_id, side)
        self.round_trip = Histogram(
            "kvmesh_afd_layer_round_trip_seconds",
            "AFD attention side: a layer's send end -> the FFN's answer in hand", labels,
            buckets=_LAYER_BUCKETS, registry=r).labels(worker_id, side)
        self.ffn_queue = Histogram(
            "kvmesh_afd_ffn_queue_seconds",
            "AFD FFN side: a message's arrival -> its batch's compute start", labels,
            buckets=_LAYER_BUCKETS, registry=r).labels(worker_id, side)
        self.tpot = Histogram("kvmesh_afd_tpot_seconds", "AFD: time per output token",
                              labels, buckets=_TPOT_BUCKETS, registry=r).labels(worker_id, side)
        self.transport_errors = Counter(
            "kvmesh_afd_transport_errors", "AFD: steps ended by a transport error (peer gone, "
            "timeout)", labels, registry=r).labels(worker_id, side)

    # --- observations (any thread)
    def observe_send(self, seconds: float) -> None:
        self.transfer.observe(seconds)
        with self._lock:
            self.totals.transfer_s += seconds
            self.totals.messages += 1

    def observe_recv(self, wait_s: float, round_trip_s: float | None) -> None:
        if round_trip_s is not None:
            self.round_trip.observe(round_trip_s)
        with self._lock:
            self.totals.wait_s += wait_s
            if round_trip_s is not None:
                self.totals.round_trip_s += round_trip_s

    def observe_queue(self, seconds: float) -> None:
        self.ffn_queue.observe(max(0.0, seconds))
        with self._lock:
            self.totals.queue_s += max(0.0, seconds)

    def add_compute(self, seconds: float) -> None:
        with self._lock:
            if self.side == "ffn":
                self.totals.compute_s += seconds
            else:
                self.attn_compute_s += seconds

    def add_no_work(self, seconds: float) -> None:
        with self._lock:
            self.idle_no_work_s += seconds

    def snapshot(self) -> LegTotals:
        with self._lock:
            return self.totals.copy()

    def overlap_ratio(self) -> float:
        with self._lock:
            rt, wait = self.totals.round_trip_s, self.totals.wait_s
        return max(0.0, min(1.0, 1.0 - wait / rt)) if rt > 0 else 0.0

    def collect(self) -> Iterator[Metric]:
        yield from self._registry.collect()
        with self._lock:
            t = self.totals.copy()
            attn, no_work = self.attn_compute_s, self.idle_no_work_s
        names = ["worker_id", "side"]
        counters = [("kvmesh_afd_idle_seconds", "AFD: time blocked waiting for the peer "
                     "(attention: for the FFN's answers; ffn: for attention outputs)",
                     t.wait_s),
                    ("kvmesh_afd_messages", "AFD: layer messages sent", t.messages)]
        if self.side == "attention":
            counters += [("kvmesh_afd_attention_compute_seconds", "AFD: attention compute",
                          attn),
                         ("kvmesh_afd_no_work_seconds", "AFD: time with no request to run",
                          no_work)]
        else:
            counters.append(("kvmesh_afd_ffn_compute_seconds", "AFD: FFN compute",
                             t.compute_s))
        for name, doc, value in counters:
            # Gauge families of monotonic totals ("_total" naming kept by hand), so a
            # scrape never sees prometheus_client's created-timestamp samples.
            g = GaugeMetricFamily(name + "_total", doc, labels=names)
            g.add_metric(self._labels, float(value))
            yield g
        if self.side == "attention":
            g = GaugeMetricFamily("kvmesh_afd_overlap_ratio", "AFD: share of the remote leg "
                                  "(transfer + FFN) hidden behind attention compute",
                                  labels=names)
            g.add_metric(self._labels, self.overlap_ratio())
            yield g

    def sample(self, name: str) -> float:
        """A sample's value by full name (0 when absent), for tests."""
        for family in self.collect():
            for s in family.samples:
                if s.name == name:
                    return float(s.value)
        return 0.0


class TimedAttentionConnector(AfdConnector):
    """Attention side pass-through that measures transfer, wait and round trip."""

    def __init__(self, inner: AfdConnector, metrics: AfdMetrics,
                 clock: Clock = time.perf_counter) -> None:
        self.inner = inner
        self.metrics = metrics
        self.clock = clock
        self._sent: dict[tuple[int, int, int], float] = {}

    def send_attn_output(self, hidden: torch.Tensor, ctx: AfdContext) -> None:
        t0 = self.clock()
        self.inner.send_attn_output(hidden, ctx)
        t1 = self.clock()
        self._sent[(ctx.layer, ctx.microbatch, ctx.step)] = t1
        self.metrics.observe_send(t1 - t0)

    def recv_ffn_output(self, ctx: AfdContext, timeout: float) -> torch.Tensor:
        t0 = self.clock()
        try:
            out = self.inner.recv_ffn_output(ctx, timeout)
        finally:
            t1 = self.clock()
        sent = self._sent.pop((ctx.layer, ctx.microbatch, ctx.step), None)
        self.metrics.observe_recv(t1 - t0, None if sent is None else t1 - sent)
        return out

    def close(self) -> None:
        self._sent.clear()
        self.inner.close()


class TimedFfnConnector(AfdConnector):
    """FFN side pass-through: idle (time in recv), transfer (send) and queue time (arrival
    → the compute start that :class:`TimedFfnSide` recorded last)."""

    def __init__(self, inner: AfdConnector, metrics: AfdMetrics,
                 clock: Clock = time.perf_counter) -> None:
        self.inner = inner
        self.metrics = metrics
        self.clock = clock
        self.last_compute_start = 0.0
        self._arrived: dict[tuple[int, int, int, int], float] = {}

    def recv_attn_output(self, timeout: float) -> tuple[torch.Tensor, AfdContext]:
        t0 = self.clock()
        try:
            hidden, ctx = self.inner.recv_attn_output(timeout)
        finally:
            t1 = self.clock()
            self.metrics.observe_recv(t1 - t0, None)
        self._arrived[(ctx.attention_id, ctx.layer, ctx.microbatch, ctx.step)] = t1
        return hidden, ctx

    def send_ffn_output(self, hidden: torch.Tensor, ctx: AfdContext) -> None:
        arrived = self._arrived.pop((ctx.attention_id, ctx.layer, ctx.microbatch, ctx.step),
                                    None)
        if arrived is not None:
            self.metrics.observe_queue(self.last_compute_start - arrived)
        t0 = self.clock()
        self.inner.send_ffn_output(hidden, ctx)
        self.metrics.observe_send(self.clock() - t0)

    def close(self) -> None:
        self._arrived.clear()
        self.inner.close()


class TimedFfnSide(FfnSide):
    """An :class:`FfnSide` whose ``forward`` notes its start on the connector wrapper and
    its duration in the metrics."""

    def __init__(self, inner: FfnSide, conn: TimedFfnConnector) -> None:
        super().__init__(inner.config, inner.layers)
        self._conn = conn

    def forward(self, layer: int, mid: torch.Tensor) -> torch.Tensor:
        t0 = self._conn.clock()
        self._conn.last_compute_start = t0
        out = super().forward(layer, mid)
        self._conn.metrics.add_compute(self._conn.clock() - t0)
        return out
