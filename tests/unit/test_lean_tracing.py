"""Lean tracing (services/common/telemetry.py ``lean``): the gRPC client channel
(:class:`services.common.grpc_client.LeanChannel`) and server interceptor
(:class:`services.common.server.TracingInterceptor`) skip OpenTelemetry's interceptors
for unsampled calls, yet the handler still runs in the caller's trace (id and sampled
flag), and a sampled call is recorded in full on both sides; ``leaf_span`` is a no-op
span, not made current, only where a span could not record. Each case runs in a fresh
process (the tracer provider is process-global), on asyncio's loop and on uvloop."""

from __future__ import annotations

import pytest

from tests.fresh_process import run_probe

PROBE = r"""
import asyncio, json, sys
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from services.common import telemetry
from services.common.grpc_client import channel
from services.common.server import (MalformedRequestInterceptor, TracingInterceptor,
                                    event_loop_factory)

provider = telemetry.setup_tracing("probe")
exporter = InMemorySpanExporter()
provider.add_span_processor(SimpleSpanProcessor(exporter))
seen = []

def note():
    sc = trace.get_current_span().get_span_context()
    seen.append([format(sc.trace_id, "032x"), bool(sc.trace_flags.sampled)])

class Health(health_pb2_grpc.HealthServicer):
    async def Check(self, request, context):
        note()
        return health_pb2.HealthCheckResponse(status=1)

    async def Watch(self, request, context):
        note()
        yield health_pb2.HealthCheckResponse(status=1)

async def main():
    server = grpc.aio.server(interceptors=[TracingInterceptor(), MalformedRequestInterceptor()])
    health_pb2_grpc.add_HealthServicer_to_server(Health(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    out = {"lean": telemetry.lean(), "loop": type(asyncio.get_running_loop()).__module__}
    ch = channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(ch)
    t = telemetry.tracer("probe")
    req = health_pb2.HealthCheckRequest()
    await stub.Check(req)  # outside any span
    out["none"] = seen[-1]
    with t.start_as_current_span("root") as root:
        await stub.Check(req)
        async for _ in stub.Watch(req):
            break
        out["root"] = [format(root.get_span_context().trace_id, "032x"), *seen[-2:]]
    unsampled = {"traceparent": "00-" + "ef" * 16 + "-" + "12" * 8 + "-00", "tracestate": "k=v"}
    span = t.start_span("u", context=TraceContextTextMapPropagator().extract(unsampled))
    sc = span.get_span_context()
    out["under_unsampled"] = [format(sc.trace_id, "032x"), span.is_recording(),
                              bool(sc.trace_flags.sampled), sc.trace_state.to_header(),
                              format(sc.span_id, "016x") != "12" * 8, sc.is_valid]
    span.end()
    with trace.use_span(trace.NonRecordingSpan(sc)):  # a leaf under an unsampled parent
        before = trace.get_current_span()
        with telemetry.leaf_span(t, "leaf") as leaf:
            leaf.set_attribute("k", 1)
            out["leaf_unsampled"] = [leaf is trace.INVALID_SPAN,
                                     trace.get_current_span() is before]
    out["same_tracer"] = telemetry.tracer("probe") is t
    sdk = provider.get_tracer("sdk")  # the SDK's own spans, to compare the flags with
    ctx = TraceContextTextMapPropagator().extract(unsampled)
    out["flags"] = [[int(x.start_span("f", context=c).get_span_context().trace_flags)
                     for x in (t, sdk)] for c in (None, ctx)]
    out["unsampled_spans"] = len(exporter.get_finished_spans())
    exporter.clear()
    parent = {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}
    with t.start_as_current_span("child", context=TraceContextTextMapPropagator().extract(parent)):
        await stub.Check(req)
        with telemetry.leaf_span(t, "leaf") as leaf:
            out["leaf_sampled"] = [leaf.is_recording(),
                                   trace.get_current_span() is leaf]
    out["sampled"] = seen[-1]
    out["sampled_spans"] = sorted(f"{s.kind.name}:{s.name}:{format(s.context.trace_id, '032x')}"
                                  for s in exporter.get_finished_spans())
    await ch.close()
    await server.stop(0)
    print(json.dumps(out))

with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
    runner.run(main())
"""
TRACE = "ab" * 16
SAMPLED = sorted([f"CLIENT:/grpc.health.v1.Health/Check:{TRACE}",
                  f"SERVER:/grpc.health.v1.Health/Check:{TRACE}", f"INTERNAL:child:{TRACE}",
                  f"INTERNAL:leaf:{TRACE}"])


@pytest.mark.parametrize("uvloop", ["1", "0"])
def test_unsampled_calls_propagate_without_spans_and_sampled_ones_record(uvloop: str) -> None:
    got = run_probe(PROBE, KVMESH_UVLOOP=uvloop)
    assert got["lean"] is True
    assert got["loop"] == ("uvloop" if uvloop == "1" else "asyncio.unix_events")
    trace_id, sampled = got["none"]
    assert trace_id != "0" * 32 and sampled is False  # a fresh unsampled trace, as before
    root, check, watch = got["root"]
    assert check == [root, False] and watch == [root, False]  # the caller's trace
    assert got["unsampled_spans"] == 0
    # a span under an unsampled parent: the SDK's parentbased_always_off span, unrecorded
    assert got["under_unsampled"] == ["ef" * 16, False, False, "k=v", True, True]
    assert got["same_tracer"] is True
    assert [ours == sdk for ours, sdk in got["flags"]] == [True, True], got["flags"]
    assert got["sampled"] == [TRACE, True]
    assert got["sampled_spans"] == SAMPLED  # client and server spans, as OpenTelemetry's
    # leaf_span: nothing made current where it cannot record; a real span where it can
    assert got["leaf_unsampled"] == [True, True]
    assert got["leaf_sampled"] == [True, True]


def test_without_lean_mode_every_call_goes_through_the_interceptors() -> None:
    got = run_probe(PROBE, OTEL_TRACES_SAMPLER="always_on")
    assert got["lean"] is False
    # root, and the client and server spans of both Checks (Watch's may still be open)
    assert got["unsampled_spans"] >= 5
    assert got["under_unsampled"][:2] == ["ef" * 16, True]  # always_on: the SDK records it
    assert got["leaf_unsampled"] == [False, False]  # not lean: the tracer's span, current
    assert got["sampled_spans"] == SAMPLED
