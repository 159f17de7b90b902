"""setup_tracing's sampler (services/common/telemetry.py), each case in a fresh process
(the provider is process-global)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from services.common.telemetry import setup_tracing, tracer
setup_tracing("probe")
t = tracer("probe")
with t.start_as_current_span("root") as root:
    carrier = {}
    TraceContextTextMapPropagator().inject(carrier)
    sampled = int(carrier["traceparent"][-2:], 16) & 1  # the flags' sampled bit
    print(root.is_recording(), root.get_span_context().is_valid, sampled)
parent = {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}
ctx = TraceContextTextMapPropagator().extract(parent)
with t.start_as_current_span("child", context=ctx) as child:
    print(child.is_recording())
"""


def run(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env},
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.split("\n")[:2]


@pytest.mark.parametrize(("env", "root", "child"), [
    # exporting nowhere: no span of our own recorded, ids and the flag still propagate,
    # a caller's sampled trace is still recorded
    ({}, "False True 0", "True"),
    ({"OTEL_TRACES_SAMPLER": "always_on"}, "True True 1", "True"),
    ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"},
     "False True 0", "True"),
    # an exporter: full tracing (its endpoint is never reached within the probe)
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}, "True True 1", "True"),
])
def test_the_sampler(env: dict[str, str], root: str, child: str) -> None:
    assert run(**env) == [root, child]
