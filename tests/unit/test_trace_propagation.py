"""services.common.telemetry's W3C shortcut: ``remote_context`` and
``propagation_metadata`` give exactly what OpenTelemetry's default propagator gives
(the same context read, the same entries written), for canonical and odd
``traceparent`` values, with ``tracestate`` and ``baggage``; another global propagator
turns the shortcut off (and back on when the default returns)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from services.common import telemetry

RNG = random.Random(7)
TID, SID = f"{RNG.getrandbits(128):032x}", f"{RNG.getrandbits(64):016x}"
TRACEPARENTS = [
    f"00-{TID}-{SID}-01", f"00-{TID}-{SID}-00", f"00-{TID}-{SID}-02", f"00-{TID}-{SID}-ff",
    *(f"00-{RNG.getrandbits(128):032x}-{RNG.getrandbits(64):016x}-{f:02x}"
      for f in (0, 1, 3)),
    f"00-{'0' * 32}-{SID}-01", f"00-{TID}-{'0' * 16}-01",  # zero ids: nothing
    f"00-{TID.upper()}-{SID}-01", f" 00-{TID}-{SID}-01", f"00-{TID}-{SID}-01 ",
    f"01-{TID}-{SID}-01-extra", f"00-{TID}-{SID}-01-extra", f"ff-{TID}-{SID}-01",
    f"00-{TID}-{SID}-1", f"00-{TID}-{SID}-0g", "", "garbage", "00-" + "a" * 52,
    f"00_{TID}-{SID}-01", f"00-{TID}_{SID}-01",
]


@pytest.fixture(autouse=True)
def default_propagator() -> Iterator[None]:
    before = propagate.get_global_textmap()
    yield
    propagate.set_global_textmap(before)


def _same(a: Context, b: Context) -> bool:
    sa, sb = (trace.get_current_span(c).get_span_context() for c in (a, b))
    return (sa == sb and sa.is_remote == sb.is_remote and sa.trace_state == sb.trace_state
            and baggage.get_all(a) == baggage.get_all(b)
            and type(trace.get_current_span(a)) is type(trace.get_current_span(b)))


def test_the_default_propagator_is_recognised() -> None:
    assert telemetry._w3c_default()


@pytest.mark.parametrize("value", TRACEPARENTS)
@pytest.mark.parametrize("extra", [(), (("tracestate", "k=v,x=y"),),
                                   (("baggage", "a=1"),), (("other", "o"),)])
def test_reading_is_the_propagators(value: str, extra: tuple[tuple[str, str], ...]) -> None:
    metadata = (("traceparent", value), *extra, ("binary-bin", b"x"))
    carrier = {k: v for k, v in metadata if isinstance(v, str)}
    assert _same(telemetry.remote_context(metadata), propagate.extract(carrier))


def test_reading_nothing_is_an_empty_context() -> None:
    for metadata in (None, (), (("other", "o"),)):
        got = telemetry.remote_context(metadata)
        assert _same(got, propagate.extract({})) and not trace.get_current_span(
            got).get_span_context().is_valid


def _slow_metadata() -> list[tuple[str, str]]:
    """propagation_metadata as it was before the shortcut: the propagator writes it."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items())


@pytest.mark.parametrize("state", [None, "k=v,x=y"])
@pytest.mark.parametrize("flags", [0, 1, 2])
@pytest.mark.parametrize("with_baggage", [False, True])
def test_writing_is_the_propagators(state: str | None, flags: int, with_baggage: bool) -> None:
    sc = trace.SpanContext(RNG.getrandbits(128), RNG.getrandbits(64), is_remote=False,
                           trace_flags=trace.TraceFlags(flags),
                           trace_state=trace.TraceState.from_header([state]) if state
                           else None)
    ctx = trace.set_span_in_context(trace.NonRecordingSpan(sc))
    if with_baggage:
        ctx = baggage.set_baggage("tenant", "t 1", ctx)
    token = otel_context.attach(ctx)
    try:
        assert telemetry.propagation_metadata() == _slow_metadata()
    finally:
        otel_context.detach(token)


def test_with_no_span_a_fresh_unsampled_trace_is_written() -> None:
    got = telemetry.propagation_metadata()
    assert [k for k, _ in got] == ["traceparent"]
    ctx = propagate.extract(dict(got))
    sc = trace.get_current_span(ctx).get_span_context()
    assert sc.is_valid and not sc.trace_flags.sampled
    assert telemetry.propagation_metadata() != got  # fresh ids each time


def test_another_global_propagator_turns_the_shortcut_off() -> None:
    class Marking(TraceContextTextMapPropagator):
        def inject(self, carrier, context=None, setter=None) -> None:  # type: ignore[no-untyped-def, override]
            carrier["marked"] = "1"

        def extract(self, carrier, context=None, getter=None) -> Context:  # type: ignore[no-untyped-def, override]
            return baggage.set_baggage("marked", carrier.get("traceparent", ""), Context())

    default = propagate.get_global_textmap()
    propagate.set_global_textmap(CompositePropagator([Marking()]))
    assert not telemetry._w3c_default()
    assert telemetry.propagation_metadata() == [("marked", "1")]
    value = f"00-{TID}-{SID}-01"
    assert baggage.get_all(telemetry.remote_context((("traceparent", value),))) == {
        "marked": value}
    propagate.set_global_textmap(default)
    assert telemetry._w3c_default()
