"""The gRPC side: Frontend.Generate, status codes, reflection, health, traces."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from protos import common_pb2, frontend_pb2, frontend_pb2_grpc
from tests.integration.conftest import Mesh
from tests.waiting import wait_for

pytestmark = pytest.mark.vllm


def greedy(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def test_grpc_generate_streams_tokens_and_usage(mesh: Mesh) -> None:
    async with grpc.aio.insecure_channel(mesh.frontend.server.address) as ch:
        stub = frontend_pb2_grpc.FrontendStub(ch)
        chunks = [c async for c in stub.Generate(frontend_pb2.CompletionRequest(
            model="tiny", prompt="hello grpc", sampling=greedy(6)))]
        chat = [c async for c in stub.Generate(frontend_pb2.CompletionRequest(
            model="tiny", messages=frontend_pb2.Messages(messages=[
                common_pb2.ChatMessage(role="user", content="hi")]), sampling=greedy(3)))]
        models = await stub.ListModels(frontend_pb2.ListModelsRequest())
    ids = [t for c in chunks for t in c.token_ids]
    assert len(ids) == 6
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens > 0
    assert chat[-1].usage.completion_tokens == 3
    assert [m.id for m in models.models] == ["tiny"]


@pytest.mark.parametrize("req,code", [
    (frontend_pb2.CompletionRequest(model="nope", prompt="x", sampling=greedy(2)),
     grpc.StatusCode.NOT_FOUND),
    (frontend_pb2.CompletionRequest(model="tiny", sampling=greedy(2)),
     grpc.StatusCode.INVALID_ARGUMENT),
    (frontend_pb2.CompletionRequest(model="", prompt="x", sampling=greedy(2)),
     grpc.StatusCode.INVALID_ARGUMENT),
    (frontend_pb2.CompletionRequest(model="tiny", prompt="x",
                                    sampling=common_pb2.SamplingParams(max_tokens=-1)),
     grpc.StatusCode.INVALID_ARGUMENT),
    (frontend_pb2.CompletionRequest(model="tiny", prompt="w " * 700, sampling=greedy(2)),
     grpc.StatusCode.INVALID_ARGUMENT),
])
async def test_grpc_errors(mesh: Mesh, req: frontend_pb2.CompletionRequest,
                           code: grpc.StatusCode) -> None:
    async with grpc.aio.insecure_channel(mesh.frontend.server.address) as ch:
        stub = frontend_pb2_grpc.FrontendStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(req):
                pass
        assert err.value.code() == code and err.value.details()


async def test_broken_protobuf_gets_a_status_and_server_survives(mesh: Mesh) -> None:
    async with grpc.aio.insecure_channel(mesh.frontend.server.address) as ch:
        raw = ch.unary_stream("/kvmesh.frontend.Frontend/Generate",
                              request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in raw(b"\xff\xff\xff\x0f garbage"):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed request" in err.value.details()
        stub = frontend_pb2_grpc.FrontendStub(ch)
        assert (await stub.ListModels(frontend_pb2.ListModelsRequest())).models


async def test_reflection_lists_services_and_health_is_serving(mesh: Mesh) -> None:
    expected = {
        mesh.frontend.server.address: "kvmesh.frontend.Frontend",
        mesh.router.server.address: "kvmesh.router.Router",
        mesh.worker_address: "kvmesh.worker.Worker",
    }
    for address, service in expected.items():
        async with grpc.aio.insecure_channel(address) as ch:
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            replies = [r async for r in refl.ServerReflectionInfo(iter([
                reflection_pb2.ServerReflectionRequest(list_services="")]))]
            names = {s.name for s in replies[0].list_services_response.service}
            assert service in names and "grpc.health.v1.Health" in names
            health = health_pb2_grpc.HealthStub(ch)
            for name in ("", service):
                resp = await health.Check(health_pb2.HealthCheckRequest(service=name))
                assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_one_trace_per_request_with_stage_spans(mesh: Mesh,
                                                      spans: InMemorySpanExporter) -> None:
    import httpx

    spans.clear()
    async with httpx.AsyncClient(base_url=mesh.url, timeout=60) as client:
        resp = await client.post("/v1/completions", json={
            "model": "tiny", "prompt": "trace me", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True})
    assert resp.status_code == 200
    needed = {"frontend.request", "frontend.tokenize", "router.route", "worker.queue",
              "prefill", "decode", "/kvmesh.router.Router/Route",
              "/kvmesh.worker.Worker/Generate"}

    def closed() -> list | None:  # type: ignore[type-arg]
        """The finished spans once ``needed`` ended and every span's parent did: the
        worker records its spans after its last message, and the Release follows the
        response, so both may end after the client has its answer."""
        snap = list(spans.get_finished_spans())
        traces = {s.context.trace_id for s in snap if s.name == "frontend.request"}
        mine = [s for s in snap if s.context.trace_id in traces]
        ids = {s.context.span_id for s in mine}
        if needed <= {s.name for s in mine} and all(
                s.parent is None or s.parent.span_id in ids for s in mine):
            return snap
        return None
    finished = await wait_for(closed, 20, lambda: f"spans {needed} and their parents "
                              f"ended, have {sorted(s.name for s in spans.get_finished_spans())}")
    roots = [s for s in finished if s.name == "frontend.request"]
    assert len(roots) == 1
    root = roots[0]
    assert root.parent is None
    trace_spans = [s for s in finished if s.context.trace_id == root.context.trace_id]
    by_id = {s.context.span_id: s for s in trace_spans}

    def ancestors(span):  # type: ignore[no-untyped-def]
        out = []
        while span.parent is not None and span.parent.span_id in by_id:
            span = by_id[span.parent.span_id]
            out.append(span.name)
        return out

    names = {s.name for s in trace_spans}
    for needed in ("frontend.tokenize", "router.route", "worker.queue", "prefill", "decode",
                   "/kvmesh.router.Router/Route", "/kvmesh.worker.Worker/Generate"):
        assert needed in names, (needed, names)
    for s in trace_spans:
        if s is not root:
            assert ancestors(s)[-1] == "frontend.request", (s.name, ancestors(s))
    route = next(s for s in trace_spans if s.name == "router.route")
    assert route.attributes["kvmesh.worker_id"] == mesh.worker_id
    prefill = next(s for s in trace_spans if s.name == "prefill")
    assert "/kvmesh.worker.Worker/Generate" in ancestors(prefill)
    assert prefill.attributes["kvmesh.worker_id"] == mesh.worker_id
    assert prefill.attributes["kvmesh.prompt_tokens"] == root.attributes["kvmesh.prompt_tokens"]
    assert "kvmesh.cached_tokens" in prefill.attributes
    decode = next(s for s in trace_spans if s.name == "decode")
    assert decode.start_time >= prefill.end_time - 1
