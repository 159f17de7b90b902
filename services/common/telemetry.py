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
- **Lean mode** (:func:`lean`): true while the provider installed is that
  ``parentbased_always_off`` default. Then a span can only record under a sampled parent,
  so the gRPC hooks (:mod:`services.common.grpc_client`, :mod:`services.common.server`)
  skip OpenTelemetry's interceptors for every call whose context is not sampled: a
  server attaches the caller's propagated context (:func:`remote_context`) for the
  handler, a client injects the current context (:func:`propagation_metadata`; a fresh
  unsampled trace id when there is none, as the interceptor's unrecorded client span
  would carry). What is recorded and what propagates (trace ids, the sampled flag) is
  unchanged; a sampled call still goes through the interceptors in full.
  :func:`may_record` tells code whether a span started now could be recorded;
  :func:`leaf_span` skips, for a block with nothing traced under it, even the
  unrecorded span when it could not record.
- :func:`tracer` returns the tracer for a kvmesh component (one object per component).
  In lean mode a span it starts under an unsampled parent (or none) skips the SDK: it is
  a ``NonRecordingSpan`` with the parent's trace id (a fresh one at a root), a fresh span
  id and the parent's unsampled flag and trace state, exactly what the SDK's
  ``parentbased_always_off`` sampler would make, at a fraction of its cost. Any other
  span (sampled parent, or not lean) is the SDK's.
- **The current context, read directly**: :func:`current_span_context` is
  ``trace.get_current_span(ctx).get_span_context()``, :func:`span_in_context` is
  ``trace.set_span_in_context(span)``, ``attach`` / :func:`detach` are
  ``opentelemetry.context.attach`` / ``detach`` (a token that cannot be reset logged on
  OpenTelemetry's context logger, not raised, as there; :class:`Attached`: the two
  around a block), and the sampled and baggage
  checks here read the same values, in a few C calls instead of OpenTelemetry's layers of
  Python ones (a request's path asks a dozen times). With OpenTelemetry's default
  runtime context (its ContextVar, found at import) and its own span classes; with
  another runtime context (``OTEL_PYTHON_CONTEXT``) or span class, OpenTelemetry's
  functions themselves.
- gRPC spans come from opentelemetry-instrumentation-grpc interceptors, wired in
  ``services.common.server`` (servers) and ``services.common.grpc_client`` (clients).
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar, Token
from typing import Any

from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.baggage import _BAGGAGE_KEY
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace import _Span as SdkLiveSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.trace.propagation import _SPAN_KEY
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

# OpenTelemetry's detach logs a failed reset here: so does ours, for the same filters
_context_log = logging.getLogger("opentelemetry.context")

_lock = threading.Lock()
_provider: TracerProvider | None = None
_memory: InMemorySpanExporter | None = None
_lean = False  # our parentbased_always_off provider is the global one (see lean())


def setup_tracing(service_name: str) -> TracerProvider:
    """Installs the global provider (OTLP exporter when configured). Idempotent."""
    global _provider, _lean
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
        # lean only if ours is the global provider (set_tracer_provider refuses a second)
        _lean = sampler is not None and trace.get_tracer_provider() is provider
        return provider


# W3C trace-context level 2's "random trace id" flag, which the SDK sets on the ids it
# generates (0 with an SDK that predates it)
_RANDOM_ID = int(getattr(trace.TraceFlags, "RANDOM_TRACE_ID", 0))


def _runtime_var() -> ContextVar[Context] | None:
    """The ContextVar OpenTelemetry's default runtime context keeps the current context
    in; None with another runtime context (then its API's functions are used)."""
    runtime = getattr(otel_context, "_RUNTIME_CONTEXT", None)
    if type(runtime) is not ContextVarsRuntimeContext:
        return None
    var = getattr(runtime, "_current_context", None)
    return var if isinstance(var, ContextVar) else None


_CURRENT = _runtime_var()
# spans whose get_span_context() only returns their context (OpenTelemetry's own classes)
_PLAIN_SPANS = frozenset({trace.NonRecordingSpan, SdkSpan, SdkLiveSpan})


def current_span_context(ctx: Context | None = None) -> trace.SpanContext:
    """``trace.get_current_span(ctx).get_span_context()`` (``ctx`` None: the current
    context), read directly where it can be (see the module docstring)."""
    if ctx is None:
        if _CURRENT is None:
            return trace.get_current_span().get_span_context()
        ctx = _CURRENT.get()
    span = ctx.get(_SPAN_KEY)
    if span is None:
        return trace.INVALID_SPAN_CONTEXT
    if type(span) in _PLAIN_SPANS:
        return span.get_span_context()  # type: ignore[attr-defined,no-any-return]
    return trace.get_current_span(ctx).get_span_context()


# ``opentelemetry.context.attach(ctx)``: with the default runtime context its ContextVar's
# own ``set`` (what that attach calls), no Python frame
attach: Callable[[Context], Token[Context]] = (
    otel_context.attach if _CURRENT is None else _CURRENT.set)


def detach(token: Token[Context]) -> None:
    """``opentelemetry.context.detach(token)``: a token that cannot be reset (another
    context's, or reset already) is logged, not raised."""
    if _CURRENT is None:
        otel_context.detach(token)
        return
    try:
        _CURRENT.reset(token)
    except Exception:
        _context_log.exception("Failed to detach context")


class Attached:
    """Makes ``ctx`` current for a block that does not yield (None = leave as is). A class,
    not a generator: a request's path enters one a dozen times."""

    __slots__ = ("_ctx", "_token")

    def __init__(self, ctx: Context | None) -> None:
        self._ctx = ctx
        self._token: Token[Context] | None = None

    def __enter__(self) -> None:
        if self._ctx is not None:
            self._token = attach(self._ctx)

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            detach(self._token)


def span_in_context(span: trace.Span) -> Context:
    """``trace.set_span_in_context(span)``: the current context with ``span`` in it."""
    if _CURRENT is None:
        return trace.set_span_in_context(span)
    return Context({**_CURRENT.get(), _SPAN_KEY: span})


def _no_baggage() -> bool:
    """``not baggage.get_all()``: the current context holds no baggage entry."""
    if _CURRENT is None:
        return not baggage.get_all()
    value = _CURRENT.get().get(_BAGGAGE_KEY)
    return not (isinstance(value, dict) and value)


def _unsampled_flags(parent: trace.SpanContext | None) -> trace.TraceFlags:
    """The flags the SDK gives an unsampled span: the random-id flag of its parent's
    trace, or at a root (``parent`` None) of the fresh random id."""
    return trace.TraceFlags(_RANDOM_ID & (parent.trace_flags if parent is not None
                                          else _RANDOM_ID))


def lean() -> bool:
    """True when the global provider is :func:`setup_tracing`'s ``parentbased_always_off``
    (see the module docstring): only a span under a sampled parent can record."""
    return _lean


# SpanContext is a tuple: (trace_id, span_id, is_remote, trace_flags, trace_state,
# is_valid), its properties index it; read as a tuple here ([3]: the flags; a test pins
# the layout)


def _sampled(ctx: Context | None) -> bool:
    return bool(current_span_context(ctx)[3] & trace.TraceFlags.SAMPLED)


def may_record(ctx: Context | None = None) -> bool:
    """False when a span started now (under ``ctx``, default the current context) is
    certain not to be recorded: lean mode and an unsampled parent (or none)."""
    return not _lean or bool(current_span_context(ctx)[3] & trace.TraceFlags.SAMPLED)


def records_nothing() -> bool:
    """True when a span started now (in the current context) is certain not to record:
    :func:`may_record` says so, or no SDK provider is installed (OpenTelemetry's proxy
    provider, whose spans never record)."""
    return not may_record() or type(trace.get_tracer_provider()) is trace.ProxyTracerProvider


_HEX = frozenset("0123456789abcdef")
# (global textmap seen last, whether it is OpenTelemetry's default: W3C trace context then
# W3C baggage, exactly those classes)
_textmap_seen: tuple[object, bool] = (None, False)


def _w3c_default() -> bool:
    """Whether the global propagator is OpenTelemetry's default one (``OTEL_PROPAGATORS``
    unset or ``tracecontext,baggage``, and no ``set_global_textmap`` since): then a
    carrier with no ``tracestate`` and no ``baggage`` is read and written as its
    ``traceparent`` alone (:func:`remote_context`, :func:`propagation_metadata`)."""
    global _textmap_seen
    textmap = propagate.get_global_textmap()
    if textmap is not _textmap_seen[0]:
        parts = getattr(textmap, "_propagators", None)
        _textmap_seen = (textmap, type(textmap) is CompositePropagator
                         and isinstance(parts, list | tuple)
                         and [type(p) for p in parts] == [TraceContextTextMapPropagator,
                                                          W3CBaggagePropagator])
    return _textmap_seen[1]


def _canonical_traceparent(value: str) -> trace.SpanContext | None:
    """The span context of a version-00 ``traceparent`` in its exact canonical form
    (55 characters, lowercase hex, no padding, nonzero ids), else None (the propagator
    decides: padded, other versions, zero ids, anything else)."""
    if (len(value) != 55 or value[:3] != "00-" or value[35] != "-" or value[52] != "-"
            or not _HEX.issuperset(value[3:35]) or not _HEX.issuperset(value[36:52])
            or not _HEX.issuperset(value[53:])):
        return None
    trace_id, span_id = int(value[3:35], 16), int(value[36:52], 16)
    if not trace_id or not span_id:
        return None
    return trace.SpanContext(trace_id, span_id, is_remote=True,
                             trace_flags=trace.TraceFlags(int(value[53:], 16)))


def remote_context(metadata: Iterable[tuple[str, Any]] | None) -> Context:
    """The trace context a caller propagated in gRPC ``metadata`` (text entries), as the
    global propagator reads it (an empty context when there is none). With the default
    propagator, a canonical ``traceparent`` and neither ``tracestate`` nor ``baggage``
    (what kvmesh's callers send) it is read here, to the same context, without the
    propagators' generic path."""
    carrier = {k: v for k, v in metadata or () if isinstance(v, str)}
    if "tracestate" not in carrier and "baggage" not in carrier and _w3c_default():
        value = carrier.get("traceparent")
        if value is None:
            return Context()
        found = _canonical_traceparent(value)
        if found is not None:
            return trace.set_span_in_context(trace.NonRecordingSpan(found), Context())
    return propagate.extract(carrier)


def is_sampled(ctx: Context | None) -> bool:
    """Whether the span of ``ctx`` (default: the current one) is sampled."""
    return _sampled(ctx)


def propagation_metadata() -> list[tuple[str, str]]:
    """The current trace context as gRPC metadata entries, as the client interceptor
    would send it; with no valid span, a fresh unsampled trace and span id (what its
    unrecorded root client span would have carried)."""
    current = current_span_context()
    if _w3c_default() and _no_baggage():  # written here, as the propagator would
        trace_id, span_id, _, flags, state, valid = current
        if not valid:
            return [("traceparent", f"00-{random.getrandbits(128) or 1:032x}-"
                                    f"{random.getrandbits(64) or 1:016x}-"
                                    f"{_unsampled_flags(None):02x}")]
        out = [("traceparent", f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}")]
        if state:
            out.append(("tracestate", state.to_header()))
        return out
    carrier: dict[str, str] = {}
    ctx: Context | None = None
    if not current.is_valid:
        ctx = trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(
            random.getrandbits(128) or 1, random.getrandbits(64) or 1, is_remote=False,
            trace_flags=_unsampled_flags(None))))
    propagate.inject(carrier, ctx)
    return list(carrier.items())


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


class _LeanTracer(trace.Tracer):
    """:func:`tracer`'s tracer: the global one, but for lean-mode spans that cannot record
    (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self._real = trace.get_tracer(name)  # a proxy until a provider is installed

    @staticmethod
    def _unrecorded(context: Context | None) -> trace.Span | None:
        """The span to start under ``context`` if it cannot record, else None."""
        if not _lean:
            return None
        parent = current_span_context(context)
        if parent[3] & trace.TraceFlags.SAMPLED:
            return None
        valid = parent.is_valid
        return trace.NonRecordingSpan(trace.SpanContext(
            parent.trace_id if valid else random.getrandbits(128) or 1,
            random.getrandbits(64) or 1, is_remote=False,
            trace_flags=_unsampled_flags(parent if valid else None),
            trace_state=parent.trace_state if valid else None))

    def start_span(self, name: str, context: Context | None = None,
                   kind: trace.SpanKind = trace.SpanKind.INTERNAL,
                   attributes: Any = None, links: Any = None, start_time: int | None = None,
                   record_exception: bool = True, set_status_on_exception: bool = True
                   ) -> trace.Span:
        span = self._unrecorded(context)
        if span is not None:
            return span
        return self._real.start_span(name, context, kind, attributes, links, start_time,
                                     record_exception, set_status_on_exception)

    @contextmanager
    def start_as_current_span(  # type: ignore[override]
            self, name: str, context: Context | None = None,
            kind: trace.SpanKind = trace.SpanKind.INTERNAL, attributes: Any = None,
            links: Any = None, start_time: int | None = None, record_exception: bool = True,
            set_status_on_exception: bool = True, end_on_exit: bool = True
    ) -> Iterator[trace.Span]:
        span = self._unrecorded(context)
        if span is None:
            with self._real.start_as_current_span(
                    name, context, kind, attributes, links, start_time, record_exception,
                    set_status_on_exception, end_on_exit) as real:
                yield real
            return
        token = attach(span_in_context(span))  # as use_span does
        try:
            yield span
        finally:
            detach(token)


class _NoSpan:
    """:func:`leaf_span`'s block where its span could not record: the invalid (no-op)
    span, not made current."""

    __slots__ = ()

    def __enter__(self) -> trace.Span:
        return trace.INVALID_SPAN

    def __exit__(self, *exc: object) -> None:
        return None


_NO_SPAN = _NoSpan()


def leaf_span(tr: trace.Tracer, name: str) -> AbstractContextManager[trace.Span]:
    """``tr.start_as_current_span(name)`` for a leaf block: one that starts no span and
    makes no traced call inside (nothing under it reads the current span). Where a span
    started now could not record (:func:`may_record` false), the block gets the no-op
    ``trace.INVALID_SPAN`` (attributes set on it go nowhere, as on any unrecorded span)
    and the current context is left as it is: no span ids drawn, no context switch.
    Exceptions pass through either way."""
    if not may_record():
        return _NO_SPAN
    return tr.start_as_current_span(name)


_tracers: dict[str, _LeanTracer] = {}


def tracer(component: str) -> trace.Tracer:
    """The tracer kvmesh component ``component`` records its spans with (see the module
    docstring for lean mode)."""
    found = _tracers.get(component)
    if found is None:
        found = _tracers[component] = _LeanTracer(f"kvmesh.{component}")
    return found


def shutdown_tracing() -> None:
    """Flushes and shuts down the provider (end of process)."""
    if _provider is not None:
        _provider.shutdown()
