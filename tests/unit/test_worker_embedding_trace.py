"""EPD metrics and trace on the worker: the EC consumer's transfer reports (as vLLM hands
them back on the final output) become an ``embedding_transfer`` span and the
``kvmesh_worker_embedding_*`` metrics; the LM queue time becomes
``kvmesh_worker_queue_seconds``. A mock engine plays EngineCore's part (in-process gRPC
on port 0); the reports themselves come from the real connector in
:mod:`tests.integration.test_ec_nixl`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from protos import worker_pb2, worker_pb2_grpc
from services.common.telemetry import setup_in_memory_tracing
from services.encoder.images import ImageLimits
from tests.unit.test_frontend_release import serve
from tests.unit.test_worker_images import ImageEngine, _descriptor, _png, _req, _run
from workers.ec.core import TRANSFERS_KEY, TransferReport, transfer_reports
from workers.engines.base import EngineOutput, EngineRequest
from workers.engines.mock import MockEngineConfig
from workers.metrics import WorkerMetrics
from workers.service import WorkerServicer, transfer_span_attributes

T0 = 1_700_000_000_000_000_000  # a wall-clock ns origin


class ReportingEngine(ImageEngine):
    """The mock engine; its final output carries ``reports`` (as the EC consumer's
    ``request_finished`` makes vLLM do)."""

    reports: list[dict[str, Any]] | Any = None

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        async for out in super().generate(request):
            if out.finished and self.reports is not None:
                out.ec_transfer_params = {TRANSFERS_KEY: self.reports}
            yield out


def _report(mm_hash: str, outcome: str, **kw: Any) -> dict[str, Any]:
    return TransferReport(mm_hash, outcome, **kw).to_dict()


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    return setup_in_memory_tracing()


def test_report_round_trip_and_bad_fields() -> None:
    rep = TransferReport("h", "read", "", 2048, T0, T0 + 5_000, 5e-6, "kvmesh-ec-producer-e")
    assert transfer_reports({TRANSFERS_KEY: [rep.to_dict()]}) == [rep]
    assert transfer_reports(None) == [] and transfer_reports({"h": {}}) == []
    for bad, needle in (
        ({**rep.to_dict(), "outcome": "maybe"}, "'outcome' must be one of"),
        ({**rep.to_dict(), "nbytes": "2048"}, "'nbytes' must be int"),
        ({**rep.to_dict(), "end_ns": T0 - 1}, "negative bytes or time"),
        ({**rep.to_dict(), "seconds": True}, "'seconds' must be int"),
    ):
        with pytest.raises(ValueError, match=needle):
            transfer_reports({TRANSFERS_KEY: [bad]})
    with pytest.raises(ValueError, match="must be a list"):
        transfer_reports({TRANSFERS_KEY: {"h": 1}})


def test_span_attributes_summarise_the_outcomes() -> None:
    read = TransferReport("a", "read", nbytes=100, agent="e1")
    shared = TransferReport("b", "shared", nbytes=50, agent="e1")
    fell = TransferReport("c", "fallback", "bad_slot", agent="e2")
    assert transfer_span_attributes([read, shared]) == {
        "kvmesh.images": 2, "kvmesh.embedding_bytes": 150, "kvmesh.outcome": "read",
        "kvmesh.fallback_reasons": "", "kvmesh.encoder_agents": "e1"}
    mixed = transfer_span_attributes([read, fell])
    assert mixed["kvmesh.outcome"] == "partial" and mixed["kvmesh.fallback_reasons"] == \
        "bad_slot" and mixed["kvmesh.encoder_agents"] == "e1,e2"
    assert transfer_span_attributes([fell])["kvmesh.outcome"] == "fallback"


async def test_reports_become_span_and_metrics(spans: InMemorySpanExporter) -> None:
    engine = ReportingEngine(MockEngineConfig(model_name="mock"))
    engine.got = []
    metrics = WorkerMetrics("w-trace")
    await engine.start()
    server, address = await serve(
        worker_pb2_grpc.add_WorkerServicer_to_server,
        WorkerServicer(engine, "w-trace", None, ImageLimits(max_images=2), metrics))
    stub = worker_pb2_grpc.WorkerStub(grpc.aio.insecure_channel(address))
    png = _png()
    images = [worker_pb2.ImageItem(data=png, mm_hash="a"),
              worker_pb2.ImageItem(data=png, mm_hash="b")]
    try:
        spans.clear()
        engine.reports = [
            _report("a", "read", nbytes=2048, start_ns=T0, end_ns=T0 + 3_000_000,
                    seconds=0.003, agent="kvmesh-ec-producer-e"),
            _report("b", "fallback", reason="bad_slot", start_ns=T0 + 1_000_000,
                    end_ns=T0 + 4_000_000, seconds=0.003, agent="kvmesh-ec-producer-e")]
        await _run(stub, _req("r1", images, [_descriptor("a"), _descriptor("b")]))
        (span,) = [s for s in spans.get_finished_spans() if s.name == "embedding_transfer"]
        assert (span.start_time, span.end_time) == (T0, T0 + 4_000_000)
        a = span.attributes
        assert a is not None
        assert (a["kvmesh.images"], a["kvmesh.embedding_bytes"], a["kvmesh.outcome"]) == (
            2, 2048, "partial")
        assert a["kvmesh.fallback_reasons"] == "bad_slot"
        assert a["kvmesh.encoder_agents"] == "kvmesh-ec-producer-e"
        assert a["kvmesh.request_id"] == "r1" and a["kvmesh.worker_id"] == "w-trace"
        assert a["kvmesh.unreported"] == 0
        assert metrics.sample("kvmesh_worker_embedding_transfer_seconds_count") == 1
        assert metrics.sample("kvmesh_worker_embedding_transfer_seconds_sum") == \
            pytest.approx(0.003)
        assert metrics.sample("kvmesh_worker_embedding_transfer_bytes_total") == 2048
        assert metrics.sample("kvmesh_worker_embedding_transfers_total", outcome="read") == 1
        assert metrics.sample("kvmesh_worker_embedding_transfers_total",
                              outcome="fallback") == 1
        assert metrics.sample("kvmesh_worker_embedding_fallbacks_total",
                              reason="bad_slot") == 1
        assert metrics.sample("kvmesh_worker_queue_seconds_count") == 1  # the LM queue

        # No report (e.g. the prefix cache held the image): counted, no span.
        spans.clear()
        engine.reports = None
        await _run(stub, _req("r2", images[:1], [_descriptor("a")]))
        assert not [s for s in spans.get_finished_spans() if s.name == "embedding_transfer"]
        assert metrics.sample("kvmesh_worker_embedding_transfers_total",
                              outcome="unreported") == 1
        # A malformed report is not a failed request: logged, counted unreported.
        engine.reports = [{"mm_hash": "a", "outcome": "teleported"}]
        assert await _run(stub, _req("r3", images[:1], [_descriptor("a")])) >= 1
        assert metrics.sample("kvmesh_worker_embedding_transfers_total",
                              outcome="unreported") == 2
        # A text request records no transfer at all.
        await _run(stub, _req("r4", []))
        assert metrics.sample("kvmesh_worker_embedding_transfers_total",
                              outcome="unreported") == 2
        assert metrics.sample("kvmesh_worker_queue_seconds_count") == 4
        # One image twice in a prompt: one report (per distinct image), none unreported.
        spans.clear()
        engine.reports = [_report("a", "read", nbytes=2048, start_ns=T0,
                                  end_ns=T0 + 1_000_000, seconds=0.001)]
        twice = [images[0], images[0]]
        await _run(stub, _req("r5", twice, [_descriptor("a"), _descriptor("a")]))
        (span,) = [s for s in spans.get_finished_spans() if s.name == "embedding_transfer"]
        assert span.attributes is not None and span.attributes["kvmesh.unreported"] == 0
        assert metrics.sample("kvmesh_worker_embedding_transfers_total",
                              outcome="unreported") == 2
    finally:
        await server.stop(None)
