"""The router's gRPC API refuses what it cannot serve, with the right code and a message
naming the field, and never answers UNKNOWN; duplicate ids, failure reports, exclusion,
the in-flight TTL and the Prometheus metrics, on a real router and two mock workers
(real etcd)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos import discovery_pb2, router_pb2, router_pb2_grpc
from services.common.config import load_config
from services.common.discovery import InstanceWatcher
from services.common.procs import Child
from services.router.main import RouterApp, RouterConfig, start_router
from tests.integration.conftest import base_args, wait_routable
from tests.waiting import wait_for
from workers.fleet import Fleet, FleetConfig, start_fleet

NS = "routerval"
MAX_LEN = 512
PROMPT = list(range(64))


@pytest.fixture(scope="module")
async def fleet(etcd: Child) -> AsyncIterator[Fleet]:
    f = await start_fleet(load_config(FleetConfig, [
        *base_args(etcd.address, NS), "--workers", "2", "--block-size", "16",
        "--num-blocks", "256", "--max-model-len", str(MAX_LEN), "--timing", "poly",
        "--speedup-ratio", "20", "--worker-id", "rv-"], {}))
    try:
        yield f
    finally:
        await f.stop()


async def router_for(etcd: str, *extra: str) -> RouterApp:
    app = await start_router(load_config(RouterConfig, [
        *base_args(etcd, NS), "--load-poll-s", "0.2", "--policy", "round_robin",
        "--failure-hold-s", "60", *extra], {}))
    await wait_routable(app, 2, "both mock workers")
    return app


@pytest.fixture(scope="module")
async def router(etcd: Child, fleet: Fleet) -> AsyncIterator[RouterApp]:
    app = await router_for(etcd.address)
    try:
        yield app
    finally:
        await app.server.stop()


@pytest.fixture
async def stub(router: RouterApp) -> AsyncIterator[router_pb2_grpc.RouterStub]:
    async with grpc.aio.insecure_channel(router.server.address) as ch:
        yield router_pb2_grpc.RouterStub(ch)


async def metrics(app: RouterApp) -> dict[str, float]:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"http://{app.metrics_address}/metrics", timeout=5)).text
    return {s.name: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if not s.labels}


def route_req(rid: str, **kw: object) -> router_pb2.RouteRequest:
    fields: dict[str, object] = {"request_id": rid, "model": "mock", "token_ids": PROMPT}
    fields.update(kw)
    return router_pb2.RouteRequest(**fields)  # type: ignore[arg-type]


async def refused(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value


ROUTE_CASES = [
    ("no request_id", {"request_id": ""}, grpc.StatusCode.INVALID_ARGUMENT,
     "request_id is required"),
    ("long request_id", {"request_id": "r" * 257}, grpc.StatusCode.INVALID_ARGUMENT,
     "request_id has 257 characters, more than 256"),
    ("no model", {"model": ""}, grpc.StatusCode.INVALID_ARGUMENT, "model is required"),
    ("long model", {"model": "m" * 300}, grpc.StatusCode.INVALID_ARGUMENT,
     "model has 300 characters"),
    ("no tokens", {"token_ids": []}, grpc.StatusCode.INVALID_ARGUMENT,
     "token_ids must not be empty"),
    ("negative token", {"token_ids": [1, 2, -5, 3]}, grpc.StatusCode.INVALID_ARGUMENT,
     "token_ids must be >= 0, got token_ids[2] = -5"),
    ("negative max_tokens", {"max_tokens": -1}, grpc.StatusCode.INVALID_ARGUMENT,
     "max_tokens must be >= 0, got -1"),
    ("beyond context", {"token_ids": list(range(MAX_LEN + 1))},
     grpc.StatusCode.INVALID_ARGUMENT,
     f"token_ids has {MAX_LEN + 1} tokens, more than the model's context of {MAX_LEN}"),
    ("far beyond context", {"token_ids": [7] * 200_000}, grpc.StatusCode.INVALID_ARGUMENT,
     "token_ids has 200000 tokens"),
    ("prompt + max_tokens beyond context", {"token_ids": list(range(500)), "max_tokens": 20},
     grpc.StatusCode.INVALID_ARGUMENT,
     f"token_ids (500) + max_tokens (20) exceed the model's context of {MAX_LEN}"),
    ("too many exclusions", {"exclude_instance_ids": [f"w{i}" for i in range(1025)]},
     grpc.StatusCode.INVALID_ARGUMENT, "exclude_instance_ids has 1025 entries"),
    ("unknown model", {"model": "nope"}, grpc.StatusCode.NOT_FOUND, "not served here"),
    ("every worker excluded", {"exclude_instance_ids": ["rv-a0", "rv-a1"]},
     grpc.StatusCode.UNAVAILABLE, "after excluding ['rv-a0', 'rv-a1']"),
]


@pytest.mark.parametrize(("case", "fields", "code", "message"), ROUTE_CASES,
                         ids=[c[0] for c in ROUTE_CASES])
async def test_route_refuses_with_code_and_field(
        stub: router_pb2_grpc.RouterStub, router: RouterApp, case: str,
        fields: dict[str, object], code: grpc.StatusCode, message: str) -> None:
    err = await refused(stub.Route(route_req(f"bad-{len(case)}", **fields)))
    assert err.code() == code, (case, err.details())
    assert message in (err.details() or ""), (case, err.details())
    assert router.servicer.metrics.registry.get_sample_value(
        "kvmesh_router_errors_total", {"method": "Route"}) in (None, 0.0)
    # nothing was left in flight by the refusal
    assert (await metrics(router))["kvmesh_router_inflight_requests"] == 0


async def test_other_methods_refuse_empty_ids(stub: router_pb2_grpc.RouterStub) -> None:
    for call, field in (
        (stub.Release(router_pb2.ReleaseRequest()), "request_id"),
        (stub.PrefillDone(router_pb2.PrefillDoneRequest()), "request_id"),
        (stub.ReportFailure(router_pb2.ReportFailureRequest()), "instance_id"),
        (stub.Release(router_pb2.ReleaseRequest(request_id="x" * 300)), "request_id"),
    ):
        err = await refused(call)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in (err.details() or "")
    listed = await stub.ListWorkers(router_pb2.ListWorkersRequest())
    assert {w.instance_id for w in listed.workers} == {"rv-a0", "rv-a1"}
    assert not (await stub.ListWorkers(router_pb2.ListWorkersRequest(model="nope"))).workers


async def test_a_request_id_in_flight_is_already_exists(stub: router_pb2_grpc.RouterStub,
                                                         router: RouterApp) -> None:
    await stub.Route(route_req("dup"))
    assert (await metrics(router))["kvmesh_router_inflight_requests"] == 1
    err = await refused(stub.Route(route_req("dup")))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert err.details() == "request_id dup is already in flight"
    assert (await stub.Release(router_pb2.ReleaseRequest(request_id="dup"))).found
    assert not (await stub.Release(router_pb2.ReleaseRequest(request_id="dup"))).found
    assert (await metrics(router))["kvmesh_router_inflight_requests"] == 0
    await stub.Route(route_req("dup"))  # free again
    assert (await stub.Release(router_pb2.ReleaseRequest(request_id="dup"))).found


async def test_excluded_worker_is_never_picked(stub: router_pb2_grpc.RouterStub) -> None:
    for i in range(6):
        resp = await stub.Route(route_req(f"ex{i}", exclude_instance_ids=["rv-a0"]))
        assert resp.worker.instance_id == "rv-a1"
        await stub.Release(router_pb2.ReleaseRequest(request_id=f"ex{i}"))


async def picked(stub: router_pb2_grpc.RouterStub, prefix: str, n: int = 6) -> set[str]:
    out = set()
    for i in range(n):
        resp = await stub.Route(route_req(f"{prefix}{i}"))
        out.add(resp.worker.instance_id)
        await stub.Release(router_pb2.ReleaseRequest(request_id=f"{prefix}{i}"))
    return out


async def test_report_failure_marks_until_re_registration(
        stub: router_pb2_grpc.RouterStub, router: RouterApp, fleet: Fleet) -> None:
    before = (await metrics(router))["kvmesh_router_failure_reports_total"]
    resp = await stub.ReportFailure(router_pb2.ReportFailureRequest(
        instance_id="rv-a0", reason="UNAVAILABLE: connection refused", request_id="f0"))
    assert resp.found
    assert not (await stub.ReportFailure(router_pb2.ReportFailureRequest(
        instance_id="nobody", reason="x"))).found
    m = await metrics(router)
    assert m["kvmesh_router_unroutable_workers"] == 1
    assert m["kvmesh_router_failure_reports_total"] == before + 1
    assert await picked(stub, "mk") == {"rv-a1"}
    # a restarted worker registers a new record (another pid): routable again at once
    worker = next(w for w in fleet.workers if w.worker_id == "rv-a0")
    reg = worker.server.registration
    assert reg is not None
    rec = next(r for r in router.watcher.instances().values() if r.instance_id == "rv-a0")
    restarted = discovery_pb2.InstanceRecord()
    restarted.CopyFrom(rec)
    restarted.pid = os.getpid() + 1
    await reg.update(restarted)

    async def unmarked() -> bool:
        return (await metrics(router))["kvmesh_router_unroutable_workers"] == 0

    await wait_for(unmarked, 10, "the re-registration to end the mark")
    assert await picked(stub, "um") == {"rv-a0", "rv-a1"}


async def test_unreleased_requests_expire_after_the_ttl(etcd: Child, fleet: Fleet) -> None:
    app = await router_for(etcd.address, "--inflight-ttl-s", "0.4")
    try:
        async with grpc.aio.insecure_channel(app.server.address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            await stub.Route(route_req("leak"))

            async def expired() -> dict[str, float] | None:
                m = await metrics(app)
                return m if m["kvmesh_router_inflight_expired_total"] >= 1 else None

            m = await wait_for(expired, 10, "the TTL to drop the unreleased request")
            assert m is not None
            assert m["kvmesh_router_inflight_requests"] == 0
            assert m["kvmesh_router_inflight_expired_total"] == 1
            assert not (await stub.Release(router_pb2.ReleaseRequest(request_id="leak"))).found
    finally:
        await app.server.stop()


async def test_metrics_address_is_published(etcd: Child, router: RouterApp) -> None:
    watcher = InstanceWatcher(etcd.address, NS, "router")
    await watcher.start()
    try:
        recs = await wait_for(lambda: watcher.instances(), 10, "the router's record")
        assert {r.metrics_address for r in recs.values()} >= {router.metrics_address}
        assert router.metrics_address.rsplit(":", 1)[1] != "0"
    finally:
        await watcher.close()
