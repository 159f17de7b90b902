"""The frontend's side of admission control and the metrics the planner reads.

A router rejection (RESOURCE_EXHAUSTED + retry-after metadata) becomes HTTP 503 with
Retry-After and an ``overloaded_error`` body, or gRPC RESOURCE_EXHAUSTED with the
metadata; the token counters and the ITL histogram have the names
``services.planner.observe.traffic_from_metrics`` reads.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient

from protos import frontend_pb2
from services.frontend.failures import rejection_error
from services.frontend.http_api import create_app
from services.frontend.jobs import Job
from services.frontend.metrics import FrontendMetrics
from services.frontend.openai_schema import ApiError, ParsedRequest
from services.frontend.service import FrontendServicer
from services.planner.observe import traffic_from_metrics


def rpc_error(code: grpc.StatusCode, details: str, trailers: tuple[tuple[str, str], ...] = ()
              ) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers),
                                details)


def test_rejection_error_reads_reason_and_retry_after() -> None:
    err = rejection_error(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded (x)", (
        ("retry-after", "2.500"), ("kvmesh-admission-reason", "predicted_itl"))))
    assert err.status == 503 and err.type == "overloaded_error"
    assert err.code == "predicted_itl" and err.retry_after_s == 2.5
    assert err.message == "overloaded (x)"
    bare = rejection_error(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, ""))
    assert bare.code == "overloaded" and bare.retry_after_s == 1.0


def test_metrics_have_the_planner_names() -> None:
    m = FrontendMetrics()
    m.requests.labels("agg", "length").inc()
    m.observe_usage(100, 20)
    m.observe_usage(50, 10)
    m.observe_chunk_gap(0.03, 3)  # 3 tokens, 10 ms each
    m.observe_chunk_gap(0.02, 1)
    m.observe_chunk_gap(0.5, 0)  # no tokens: nothing
    m.observe_rejection("predicted_itl")
    m.observe_rejection("predicted_itl")
    m.observe_rejection("")
    text = m.render().decode()
    t = traffic_from_metrics(text)
    assert t.requests == 4  # 1 finished + 3 rejected
    assert t.input_tokens == 150 and t.output_tokens == 30
    assert t.itl_count == 4 and t.itl_sum_s == pytest.approx(0.05)
    assert 'kvmesh_requests_total{outcome="rejected",path="none"} 3.0' in text
    assert 'kvmesh_admission_rejections_total{reason="predicted_itl"} 2.0' in text
    assert 'kvmesh_admission_rejections_total{reason="unknown"} 1.0' in text


class _RejectingPipeline:
    """Stands in for Pipeline: every request is rejected by the router."""

    def __init__(self, err: ApiError) -> None:
        self.err = err
        self.metrics = FrontendMetrics()
        self.catalog: Any = None

    async def run(self, req: ParsedRequest) -> Any:
        raise self.err


OVERLOADED = ApiError(503, "overloaded (predicted_itl): predicted ITL 60 ms",
                      type="overloaded_error", code="predicted_itl", retry_after_s=1.2)


@pytest.mark.parametrize("stream", [False, True])
def test_http_rejection_is_503_with_retry_after(stream: bool) -> None:
    app = create_app(_RejectingPipeline(OVERLOADED))  # type: ignore[arg-type]
    with TestClient(app) as client:
        resp = client.post("/v1/completions", json={"model": "m", "prompt": "hi",
                                                    "max_tokens": 4, "stream": stream})
    assert resp.status_code == 503
    assert resp.headers["retry-after"] == "2"  # ceil(1.2)
    err = resp.json()["error"]
    assert err["type"] == "overloaded_error" and err["code"] == "predicted_itl"
    assert "predicted ITL" in err["message"]


def test_http_other_errors_have_no_retry_after() -> None:
    app = create_app(_RejectingPipeline(ApiError(503, "no router", type="service_unavailable")))  # type: ignore[arg-type]
    with TestClient(app) as client:
        resp = client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert resp.status_code == 503 and "retry-after" not in resp.headers


class _EmptyStreamPipeline(_RejectingPipeline):
    """A pipeline whose stream ends with no chunk at all (the real one never does)."""

    async def run(self, req: ParsedRequest) -> Any:
        async def nothing() -> AsyncIterator[Any]:
            return
            yield

        return Job(request_id="r1", req=req, model=None, token_ids=[], created=0), nothing()  # type: ignore[arg-type]


@pytest.mark.parametrize("stream", [False, True])
def test_http_stream_without_a_finish_is_502_not_an_empty_200(stream: bool) -> None:
    app = create_app(_EmptyStreamPipeline(ApiError(500, "unused")))  # type: ignore[arg-type]
    with TestClient(app) as client:
        resp = client.post("/v1/completions", json={"model": "m", "prompt": "hi",
                                                    "stream": stream})
    assert resp.status_code == 502 and resp.json()["error"]["type"] == "upstream_error"


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self) -> None:
        self.aborted: tuple[Any, ...] = ()

    async def abort(self, code: grpc.StatusCode, details: str,
                    trailing_metadata: Any = ()) -> None:
        self.aborted = (code, details, tuple(trailing_metadata))
        raise _Aborted


async def _drain(it: AsyncIterator[Any]) -> None:
    async for _ in it:
        pass


async def test_grpc_rejection_is_resource_exhausted_with_metadata() -> None:
    servicer = FrontendServicer(_RejectingPipeline(OVERLOADED))  # type: ignore[arg-type]
    ctx = _Context()
    req = frontend_pb2.CompletionRequest(model="m", prompt="hi")
    req.sampling.max_tokens = 4
    with pytest.raises(_Aborted):
        await _drain(servicer.Generate(req, ctx))  # type: ignore[arg-type]
    code, details, md = ctx.aborted
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "predicted ITL" in details
    assert dict(md) == {"retry-after": "1.200", "kvmesh-admission-reason": "predicted_itl"}
