"""The frontend records the router's predicted cached tokens next to the engine's actual
ones (metrics and the final chunk that feeds the request span), after a non-streamed
answer is built. No network: the router stub and the worker plan are fakes."""

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from protos import common_pb2, discovery_pb2, router_pb2, worker_pb2
from services.frontend import pipeline as pipeline_mod
from services.frontend import shapes as shapes_mod
from services.frontend.http_api import create_app
from services.frontend.jobs import Job, predicted_cached_tokens
from services.frontend.metrics import FrontendMetrics
from services.frontend.models import ModelCatalog, ModelInfo
from services.frontend.openai_schema import ParsedRequest, SamplingSpec
from services.frontend.pipeline import Pipeline


def route(disagg: bool, d_blocks: int, p_blocks: int, bs: int = 32) -> router_pb2.RouteResponse:
    r = router_pb2.RouteResponse(
        worker=router_pb2.WorkerChoice(instance_id="d1", address="x"),
        disaggregated=disagg, predicted_overlap_blocks=d_blocks,
        predicted_prefill_overlap_blocks=p_blocks, block_size=bs, overlap_source="indexer")
    if disagg:
        r.prefill.CopyFrom(router_pb2.WorkerChoice(instance_id="p1", address="y"))
    return r


def test_predicted_tokens_follow_whose_hits_the_client_sees() -> None:
    assert predicted_cached_tokens(route(False, 3, 0), 16) == 96
    assert predicted_cached_tokens(route(True, 3, 2), 16) == 64  # P's overlap
    assert predicted_cached_tokens(route(False, 3, 0, bs=0), 16) == 48  # old router


def sample(reg: CollectorRegistry, name: str, **labels: str) -> float:
    value = reg.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_metrics_histograms_and_error() -> None:
    m = FrontendMetrics()
    m.observe_cache_prediction("agg", "indexer", 96, 64)
    m.observe_cache_prediction("agg", "indexer", 0, 32)
    r = m.registry
    assert sample(r, "kvmesh_frontend_predicted_cached_tokens_sum", path="agg",
                  source="indexer") == 96
    assert sample(r, "kvmesh_frontend_actual_cached_tokens_count", path="agg",
                  source="indexer") == 2
    assert sample(r, "kvmesh_frontend_cached_tokens_abs_error_sum", path="agg",
                  source="indexer") == 64
    assert sample(r, "kvmesh_frontend_cached_tokens_abs_error_bucket", path="agg",
                  source="indexer", le="32.0") == 2  # both off by 32
    assert sample(r, "kvmesh_frontend_cached_tokens_abs_error_bucket", path="agg",
                  source="indexer", le="16.0") == 0
    assert sample(r, "kvmesh_predicted_overlap_tokens_total") == 96
    assert b"kvmesh_frontend_predicted_cached_tokens_bucket" in m.render()


class FakeRouter:
    def __init__(self, resp: router_pb2.RouteResponse) -> None:
        self.resp = resp

    async def Route(self, req: Any, **kw: Any) -> router_pb2.RouteResponse:  # noqa: N802
        return self.resp

    async def Release(self, req: Any, **kw: Any) -> router_pb2.ReleaseResponse:  # noqa: N802
        return router_pb2.ReleaseResponse(found=True)

    async def PrefillDone(self, req: Any, **kw: Any) -> router_pb2.PrefillDoneResponse:  # noqa: N802
        return router_pb2.PrefillDoneResponse()


@pytest.mark.parametrize("disagg,expected", [(False, 96), (True, 32)])
async def test_pipeline_records_predicted_and_actual(monkeypatch: pytest.MonkeyPatch,
                                                     disagg: bool, expected: int) -> None:
    resp = route(disagg, 3, 1)
    monkeypatch.setattr(pipeline_mod.router_pb2_grpc, "RouterStub", lambda ch: FakeRouter(resp))

    async def fake_plan(pool: Any, req: Any, route: Any, metrics: Any,
                        streams: Any = None) -> AsyncIterator[Any]:
        yield worker_pb2.GenerateResponse(text="a", token_ids=[1])
        last = worker_pb2.GenerateResponse(text="b", token_ids=[2],
                                           finish_reason=common_pb2.FINISH_REASON_STOP)
        last.usage.prompt_tokens = 130
        last.usage.cached_tokens = 64
        yield last

    monkeypatch.setattr(pipeline_mod, "run_plan", fake_plan)
    p = Pipeline(ModelCatalog(), lambda: "router:1")
    info = ModelInfo("m", "/m", 4096, 16, 1, 0)
    job = Job("r1", ParsedRequest("completion", "m", SamplingSpec(max_tokens=2)), info,
              list(range(130)), 0)
    chunks = [c async for c in p.stream(job)]
    await p.close()
    last = chunks[-1]
    assert last.predicted_cached_tokens == expected and last.cached_tokens == 64
    path = "disagg" if disagg else "agg"
    r = p.metrics.registry
    assert sample(r, "kvmesh_frontend_predicted_cached_tokens_sum", path=path,
                  source="indexer") == expected
    assert sample(r, "kvmesh_frontend_actual_cached_tokens_sum", path=path,
                  source="indexer") == 64
    assert sample(r, "kvmesh_frontend_cached_tokens_abs_error_sum", path=path,
                  source="indexer") == abs(expected - 64)


def _one_worker_pipeline() -> Pipeline:
    catalog = ModelCatalog()
    catalog.update([discovery_pb2.InstanceRecord(
        instance_id="w0", component="worker", address="127.0.0.1:1", model="m",
        model_path="/nowhere", block_size=16, max_model_len=256)])
    return Pipeline(catalog, lambda: "router:1")


async def _two_tokens(pool: Any, req: Any, route: Any, metrics: Any,
                      streams: Any = None) -> AsyncIterator[Any]:
    yield worker_pb2.GenerateResponse(text="a", token_ids=[7])
    last = worker_pb2.GenerateResponse(text="b", token_ids=[8],
                                       finish_reason=common_pb2.FINISH_REASON_LENGTH)
    last.usage.prompt_tokens, last.usage.completion_tokens = 40, 2
    last.usage.cached_tokens = 16
    yield last


class SlowReleaseRouter(FakeRouter):
    """Its Release answers a few loop turns later, and is recorded then."""

    def __init__(self, resp: router_pb2.RouteResponse) -> None:
        super().__init__(resp)
        self.released: list[str] = []

    async def Release(self, req: Any, **kw: Any) -> router_pb2.ReleaseResponse:  # noqa: N802
        for _ in range(3):
            await asyncio.sleep(0)
        self.released.append(req.request_id)
        return router_pb2.ReleaseResponse(found=True)


async def test_close_waits_for_the_release_of_an_answered_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The teardown after the answer starts the Release in a task of its own; ``close``
    waits for that one too (no router entry left behind at shutdown), and the recorded
    ``frontend.request`` span holds no exception: closing after the finish is no
    failure."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()  # this test's own: the process's global one is untouched
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    router = SlowReleaseRouter(route(False, 1, 0, bs=16))
    monkeypatch.setattr(pipeline_mod.router_pb2_grpc, "RouterStub", lambda ch: router)
    monkeypatch.setattr(pipeline_mod, "run_plan", _two_tokens)
    p = _one_worker_pipeline()
    monkeypatch.setattr(p, "_tracer", provider.get_tracer("frontend"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(p)),
                                 base_url="http://frontend") as client:
        resp = await client.post("/v1/completions", json={
            "model": "m", "prompt": list(range(40)), "max_tokens": 2,
            "request_id": "answered-then-closed"})
    assert resp.status_code == 200, resp.text
    await p.close()
    assert len(router.released) == 1
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "frontend.request"
               and (s.attributes or {}).get("kvmesh.request_id") == "answered-then-closed"]
    assert [e.name for e in span.events] == []
    assert (span.attributes or {}).get("kvmesh.finish_reason") == "length"


async def test_a_non_streamed_answer_is_built_before_the_request_is_torn_down(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The finishing chunk's metrics (usage, cache prediction) and the request's outcome
    are recorded once the answer is built: after it, still exactly once."""
    events: list[str] = []
    monkeypatch.setattr(pipeline_mod.router_pb2_grpc, "RouterStub",
                        lambda ch: FakeRouter(route(False, 1, 0, bs=16)))
    monkeypatch.setattr(pipeline_mod, "run_plan", _two_tokens)
    p = _one_worker_pipeline()
    observe = p.metrics.observe_usage
    full = shapes_mod.Shapes.full

    def observe_usage(*args: Any) -> None:
        events.append("usage")
        observe(*args)

    def answer(self: shapes_mod.Shapes, *args: Any) -> dict[str, Any]:
        events.append("answer")
        return full(self, *args)

    monkeypatch.setattr(p.metrics, "observe_usage", observe_usage)
    monkeypatch.setattr(shapes_mod.Shapes, "full", answer)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(p)),
                                 base_url="http://frontend") as client:
        resp = await client.post("/v1/completions", json={
            "model": "m", "prompt": list(range(40)), "max_tokens": 2})
    await p.close()  # its background tasks, the request's teardown among them
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "ab"
    assert resp.json()["usage"]["completion_tokens"] == 2
    assert events == ["answer", "usage"]
    r = p.metrics.registry
    assert sample(r, "kvmesh_frontend_actual_cached_tokens_sum", path="agg",
                  source="indexer") == 16
    assert sample(r, "kvmesh_requests_total", path="agg", outcome="length") == 1
