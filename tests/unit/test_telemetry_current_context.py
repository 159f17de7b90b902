"""The current trace context read directly (services.common.telemetry): the same values as
OpenTelemetry's API, with its default runtime context and without it."""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterator

import pytest
from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.baggage import _BAGGAGE_KEY
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace.propagation import _SPAN_KEY

from services.common import telemetry


class _OddSpan(trace.NonRecordingSpan):
    """A span class of someone else's: its context is not read directly."""

    def get_span_context(self) -> trace.SpanContext:
        return trace.SpanContext(7, 8, False, trace.TraceFlags(1))


class _SdkSubSpan(SdkSpan):
    """A subclass of the SDK's span: its context is not read directly either."""


def _contexts() -> Iterator[tuple[str, Context]]:
    sdk = TracerProvider().get_tracer("t").start_span("s")  # not the global provider
    unsampled = trace.NonRecordingSpan(trace.SpanContext(
        0xABC, 0xDEF, True, trace.TraceFlags(0)))
    sampled = trace.NonRecordingSpan(trace.SpanContext(
        0x123, 0x456, True, trace.TraceFlags(1),
        trace.TraceState([("k", "v")])))
    yield "empty", Context()
    yield "unsampled", trace.set_span_in_context(unsampled, Context())
    yield "sampled", trace.set_span_in_context(sampled, Context())
    yield "sdk", trace.set_span_in_context(sdk, Context())
    yield "invalid", trace.set_span_in_context(trace.INVALID_SPAN, Context())
    yield "odd class", trace.set_span_in_context(_OddSpan(trace.INVALID_SPAN_CONTEXT),
                                                 Context())
    yield "not a span", Context({_SPAN_KEY: "oops"})
    yield "baggage", baggage.set_baggage("tenant", "a", trace.set_span_in_context(
        unsampled, Context()))
    yield "empty baggage", baggage.clear(Context())
    yield "baggage not a dict", Context({_BAGGAGE_KEY: "oops"})
    yield "sdk subclass", trace.set_span_in_context(_SdkSubSpan("sub", sdk.get_span_context()),
                                                    Context())


@pytest.fixture(params=["runtime var", "api"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways: the default runtime context read directly, and the API's functions
    (what another runtime context gets)."""
    if request.param == "api":
        monkeypatch.setattr(telemetry, "_CURRENT", None)
        monkeypatch.setattr(telemetry, "attach", otel_context.attach)
    else:
        assert telemetry._CURRENT is not None  # the default runtime context is found
    return str(request.param)


@pytest.mark.parametrize("name,ctx", list(_contexts()))
def test_reads_what_the_api_reads(mode: str, name: str, ctx: Context) -> None:
    want = trace.get_current_span(ctx).get_span_context()
    assert telemetry.current_span_context(ctx) == want
    assert telemetry.is_sampled(ctx) is bool(want.trace_flags.sampled)
    token = telemetry.attach(ctx)
    try:
        assert otel_context.get_current() is ctx
        assert telemetry.current_span_context() == trace.get_current_span().get_span_context()
        assert telemetry.is_sampled(None) is bool(want.trace_flags.sampled)
        assert telemetry._no_baggage() is (not baggage.get_all())
    finally:
        telemetry.detach(token)
    assert otel_context.get_current() is not ctx


def test_propagation_metadata_is_the_propagators(mode: str) -> None:
    """With a valid current span, the metadata is what the W3C propagator injects."""
    from opentelemetry import propagate

    for name, ctx in _contexts():
        if not trace.get_current_span(ctx).get_span_context().is_valid:
            continue
        token = telemetry.attach(ctx)
        try:
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            assert dict(telemetry.propagation_metadata()) == carrier, name
        finally:
            telemetry.detach(token)


def test_detach_twice_is_logged_not_raised(mode: str, caplog: pytest.LogCaptureFixture
                                           ) -> None:
    before = otel_context.get_current()
    token = telemetry.attach(Context())
    telemetry.detach(token)
    assert otel_context.get_current() is before
    with caplog.at_level(logging.ERROR):
        telemetry.detach(token)  # a token used already: OpenTelemetry logs it too
    assert [r.name for r in caplog.records] == ["opentelemetry.context"]  # its logger
    assert "Failed to detach context" in caplog.text
    assert otel_context.get_current() is before
    caplog.clear()
    elsewhere = contextvars.copy_context().run(telemetry.attach, Context())
    with caplog.at_level(logging.ERROR):
        telemetry.detach(elsewhere)  # another context's token: logged, not raised
    assert "Failed to detach context" in caplog.text
    assert otel_context.get_current() is before


def test_attach_is_the_runtime_var_itself() -> None:
    """With the default runtime context, attaching costs no Python frame: it is the
    ContextVar's own set (what OpenTelemetry's attach calls)."""
    var = telemetry._runtime_var()
    assert var is not None and telemetry.attach == var.set


def test_span_context_layout_is_pinned() -> None:
    """The sampled checks and the metadata read a SpanContext as its tuple."""
    state = trace.TraceState([("k", "v")])
    sc = trace.SpanContext(0x1234, 0x56, True, trace.TraceFlags(1), state)
    assert tuple(sc) == (sc.trace_id, sc.span_id, sc.is_remote, sc.trace_flags,
                         sc.trace_state, sc.is_valid)
    assert sc[3] is sc.trace_flags and sc[5] is True


@pytest.mark.parametrize("name,ctx", list(_contexts()))
def test_span_in_context_is_set_span_in_context(mode: str, name: str, ctx: Context) -> None:
    span = trace.NonRecordingSpan(trace.SpanContext(0x9, 0x8, False, trace.TraceFlags(0)))
    token = telemetry.attach(ctx)
    try:
        got = telemetry.span_in_context(span)
        want = trace.set_span_in_context(span)
    finally:
        telemetry.detach(token)
    assert type(got) is Context and got == want
    assert otel_context.get_current() is not got
