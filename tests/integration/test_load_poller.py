"""The router's load poller never fails silently: a worker whose GetLoad fails (nothing
listens at its address) is counted in ``kvmesh_router_load_poll_failures_total`` on
every failed poll and logged once as a warning naming it and the status; once a worker
answers at that address, its load reaches the core and one info line says so; failing
again within the minute is counted, not logged, and the next warning (a minute after
the first, by the poller's clock) says how many failed polls it held back."""

from __future__ import annotations

import logging
import random
import time

import grpc
import pytest

from protos import worker_pb2_grpc
from services.common.procs import free_port
from services.router.core import RouterCore
from services.router.metrics import RouterMetrics
from services.router.plan import WorkerRecord
from services.router.policy_setup import default_registry
from services.router.service import LoadPoller
from tests.waiting import wait_for
from workers.engines.mock.engine import MockEngine, MockEngineConfig
from workers.service import WorkerServicer

FAILURES = "kvmesh_router_load_poll_failures_total"


def _failures(metrics: RouterMetrics) -> float:
    return metrics.registry.get_sample_value(FAILURES) or 0


def _said(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == "services.router.service" and text in r.getMessage()]


async def test_a_failing_poll_is_counted_logged_once_and_its_recovery_noted(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="services.router.service")
    core = RouterCore(policy=default_registry().create("round_robin", random.Random(0)),
                      clock=time.monotonic)
    address = f"127.0.0.1:{free_port()}"  # nothing listens there yet
    core.set_workers([WorkerRecord("w-poll", address, "mock", "agg", 32, 1024)])
    metrics = RouterMetrics(core)
    now = [0.0]  # the poller's clock for its warnings: moved by hand
    poller = LoadPoller(core, 0.2, None, metrics, clock=lambda: now[0])
    engine = MockEngine(MockEngineConfig(max_model_len=1024, timing="zero"))
    server = grpc.aio.server()
    poller.start()
    try:
        await wait_for(lambda: _failures(metrics) >= 3, 60, "three failed GetLoad polls")
        warned = _said(caplog, "GetLoad on worker w-poll")
        assert len(warned) == 1, [r.getMessage() for r in warned]
        assert warned[0].levelno == logging.WARNING
        assert address in warned[0].getMessage()
        assert any(code in warned[0].getMessage()
                   for code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"))
        assert core.kv_usage_of("w-poll") is None

        await engine.start()
        worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(engine, "w-poll"), server)
        server.add_insecure_port(address)
        await server.start()
        await wait_for(lambda: core.kv_usage_of("w-poll") is not None, 120,
                       "w-poll's load report once it listens")
        assert len(_said(caplog, "worker w-poll answers GetLoad again")) == 1

        # it fails again within the minute: counted, not logged again (a flapping
        # worker writes at most two lines a minute) ...
        await server.stop(0)
        failed = _failures(metrics)
        await wait_for(lambda: _failures(metrics) >= failed + 3, 60,
                       "three more failed polls")
        assert len(_said(caplog, "GetLoad on worker w-poll")) == 1
        # ... and a minute after the first warning, one more says how many it held back
        now[0] += 61.0
        again = await wait_for(lambda: _said(caplog, "more failed polls since the last "
                                             "warning"), 60, "the next warning")
        assert len(again) == 1 and again[0].levelno == logging.WARNING
        assert len(_said(caplog, "worker w-poll answers GetLoad again")) == 1
    finally:
        await poller.close()
        await server.stop(0)
        await engine.shutdown()
