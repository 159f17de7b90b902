"""Pinning a worker's decode cost with ``Router.Route`` calls that are never released, and
marking workers unroutable with ``Router.ReportFailure``: both are refused for every caller
but a frontend; the router's in-flight count, its workers and its unroutable set are
unchanged (ListWorkers as admin, the router's /metrics)."""

from __future__ import annotations

from protos import router_pb2, router_pb2_grpc
from tests.security.conftest import MODEL, TIMEOUT_S, SecureMesh, attack, roles_except


async def test_route_never_released_is_refused(secure: SecureMesh, who: str) -> None:
    before = await secure.settled()
    request = router_pb2.RouteRequest(request_id="pin-decode", model=MODEL,
                                      token_ids=list(range(8000, 8512)), max_tokens=2000)
    await attack(secure, who, secure.address("router"), "/kvmesh.router.Router/Route",
                 lambda ch: router_pb2_grpc.RouterStub(ch).Route(request, timeout=TIMEOUT_S),
                 allowed="frontend", wrong_roles=roles_except("frontend"))
    after = await secure.snapshot()
    assert after.routing["kvmesh_router_inflight_requests"] == 0
    assert after == before


async def test_report_failure_of_a_healthy_worker_is_refused(secure: SecureMesh,
                                                              who: str) -> None:
    before = await secure.settled()
    request = router_pb2.ReportFailureRequest(instance_id=secure.decode.instance_id,
                                              reason="UNAVAILABLE: forged")
    await attack(secure, who, secure.address("router"), "/kvmesh.router.Router/ReportFailure",
                 lambda ch: router_pb2_grpc.RouterStub(ch).ReportFailure(request,
                                                                         timeout=TIMEOUT_S),
                 allowed="frontend", wrong_roles=roles_except("frontend"))
    after = await secure.snapshot()
    assert after.routing["kvmesh_router_unroutable_workers"] == 0
    assert after == before
