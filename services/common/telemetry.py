"""OpenTelemetry setup shared by every kvmesh process.

Contract:

- :func:`setup_tracing` installs the global TracerProvider once per process. When
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, spans go to that OTLP/gRPC collector (Jaeger,
  Tempo, ...) through a batch processor. Later calls return the same provider. The
  sampler: the SDK's ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` when set (e.g.
  ``parentbased_traceidratio`` with ``0.01`` records 1 % of new traces, and every hop
  follows the frontend's decision); else, with an exporter, ``parentbased_always_on``
  (full tracing), and without one ``parentbased_always_off``: a process that exports
  nowhere records no span of its own traces (spans cost ~1 ms of CPU per request and hop),
  while context still propagates (trace ids, the sampled flag) and a caller's sampled
  trace is still recorded.
- :func:`setup_in_memory_tracing` (tests) installs a provider with an in-memory exporter
  and a synchronous processor, and returns the exporter so tests can read finished spans.
- :func:`tracer` returns the tracer for a kvmesh component.
- gRPC spans come from opentelemetry-instrumentation-grpc interceptors, wired in
  ``services.common.server`` (servers) and ``services.common.grpc_client`` (clients).
"""

from __future__ import annotations

import os
import threading

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

_lock = threading.Lock()
_provider: TracerProvider | None = None
_memory: InMemorySpanExporter | None = None


def setup_tracing(service_name: str) -> TracerProvider:
    """Installs the global provider (OTLP exporter when configured). Idempotent."""
    global _provider
    with _lock:
        if _provider is not None:
            return _provider
        exporting = bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
        sampler = None  # the SDK reads OTEL_TRACES_SAMPLER (default: parent-based, on)
        if not exporting and not os.environ.get("OTEL_TRACES_SAMPLER"):
            sampler = ParentBased(ALWAYS_OFF)
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                                  sampler=sampler)
        if exporting:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        _provider = provider
        return provider


def setup_in_memory_tracing() -> InMemorySpanExporter:
    """Installs a provider with an in-memory exporter (tests). Idempotent."""
    global _provider, _memory
    with _lock:
        if _memory is not None:
            return _memory
        if _provider is not None:
            raise RuntimeError("tracing already set up without the in-memory exporter")
        provider = TracerProvider(resource=Resource.create({"service.name": "kvmesh-test"}))
        exporter = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        _provider, _memory = provider, exporter
        return exporter


def tracer(component: str) -> trace.Tracer:
    """The tracer kvmesh component ``component`` records its spans with."""
    return trace.get_tracer(f"kvmesh.{component}")


def shutdown_tracing() -> None:
    """Flushes and shuts down the provider (end of process)."""
    if _provider is not None:
        _provider.shutdown()
