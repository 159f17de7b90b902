"""mTLS and authorization by role on real in-process servers (real etcd and Redis): a mock
worker, a router, an indexer and a frontend, all with certificates of one mesh CA.

The worker is a mock fleet's (one process, one fleet certificate ``worker:fleet-mt``, its
workers the sub-ids ``fleet-mt.a0``, ...): its signed KV events reach the TLS indexer and
are indexed (none dropped as forged); the shared ``worker`` certificate, and a real
worker's (``worker:prefill-0``, no fleet certificate), are refused to a fleet.

A frontend-role client routes and generates; other roles get PERMISSION_DENIED naming the
method and the role; a client without a certificate, or with one of another CA, does not
get through the handshake; only an admin dumps the index; a worker registered in etcd
with a certificate of another CA never receives a request (every handshake with it fails)
while the frontend keeps answering; a store segment is unmounted only by the identity that
mounted it, and RemoveAll is admin only."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import (
    common_pb2,
    frontend_pb2,
    frontend_pb2_grpc,
    indexer_pb2,
    indexer_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    store_pb2,
    store_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.config import ConfigError, load_config
from services.common.grpc_client import ChannelPool, channel
from services.common.procs import Child
from services.common.tls import ROLES, MeshTls, write_mesh_certs
from services.frontend.main import FrontendApp, FrontendConfig, start_frontend
from services.frontend.request_plane import PlaneCall, PlaneUnreachable
from services.frontend.worker_stream import WorkerStreams
from services.indexer.main import IndexerApp, IndexerConfig, start_indexer
from services.router.main import RouterApp, RouterConfig, start_router
from services.store_master.main import StoreMasterConfig, start_store_master
from tests.integration.conftest import base_args, wait_routable
from tests.integration.test_router_validation import metrics
from tests.waiting import wait_for
from workers.fleet import Fleet, FleetConfig, start_fleet

NS = "mtls"
PROMPT = list(range(3, 67))


@dataclass
class Secured:
    certs: Path
    rogue: Path
    fleet: Fleet
    router: RouterApp
    indexer: IndexerApp
    frontend: FrontendApp

    def tls(self, role: str) -> MeshTls:
        return MeshTls.load(self.certs, role)


def fleet_args(etcd: str, certs: Path, name: str, tiny_model: str, *extra: str) -> list[str]:
    """A one-worker fleet on the instance certificate ``worker:<name>`` (id ``<name>.a0``)."""
    return [*base_args(etcd, NS), "--tls-dir", str(certs), "--tls-cert", f"worker-{name}",
            "--workers", "1", "--block-size", "16", "--num-blocks", "256",
            "--max-model-len", "512", "--timing", "poly", "--speedup-ratio", "20",
            "--model-path", tiny_model, "--model-name", "mock", *extra]


@pytest.fixture(scope="module")
async def secured(etcd: Child, redis_server: Child, tiny_model: str,
                  tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Secured]:
    certs, rogue = tmp_path_factory.mktemp("certs"), tmp_path_factory.mktemp("rogue")
    write_mesh_certs(certs, [*ROLES, "worker:fleet-mt"])
    write_mesh_certs(rogue, [*ROLES, "worker:fleet-fake"])  # a CA of its own
    args = [*base_args(etcd.address, NS), "--tls-dir", str(certs)]
    redis_url = f"redis://{redis_server.address}"
    fleet = await start_fleet(load_config(FleetConfig, fleet_args(
        etcd.address, certs, "fleet-mt", tiny_model, "--redis-url", redis_url), {}))
    router = await start_router(load_config(RouterConfig, [
        *args, "--load-poll-s", "0.2", "--policy", "round_robin", "--failure-hold-s", "600"],
        {}))
    indexer = await start_indexer(load_config(IndexerConfig, [
        *args, "--redis-url", redis_url, "--group", "mt"], {}))
    frontend = await start_frontend(load_config(FrontendConfig, [
        *args, "--http-port", "0", "--router-address", router.server.address], {}))
    try:
        await wait_routable(router, 1, "the mTLS worker")
        yield Secured(certs, rogue, fleet, router, indexer, frontend)
    finally:
        await frontend.server.stop()
        await indexer.server.stop()
        await router.server.stop()
        await fleet.stop()


async def refused(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value


def route_req(rid: str) -> router_pb2.RouteRequest:
    return router_pb2.RouteRequest(request_id=rid, model="mock", token_ids=PROMPT)


def gen_req(rid: str) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(request_id=rid, token_ids=PROMPT, model="mock",
                                      sampling=common_pb2.SamplingParams(max_tokens=4))


async def test_a_frontend_routes_and_generates(secured: Secured) -> None:
    tls = secured.tls("frontend")
    async with channel(secured.router.server.address, tls) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        route = await stub.Route(route_req("mt-ok"))
        assert route.worker.instance_id == "fleet-mt.a0"
        await stub.Release(router_pb2.ReleaseRequest(request_id="mt-ok"))
    async with channel(secured.fleet.workers[0].address, tls) as ch:
        chunks = [c async for c in worker_pb2_grpc.WorkerStub(ch).Generate(gen_req("mt-ok"))]
    assert sum(len(c.token_ids) for c in chunks) == 4


async def test_the_request_plane_is_mtls_and_serves_only_a_frontend(
        secured: Secured) -> None:
    """The worker publishes its TCP request plane, the router hands it out, and on it a
    frontend's certificate is served, a router's is refused naming its role, and a
    certificate of another CA gets no connection."""
    async with channel(secured.router.server.address, secured.tls("frontend")) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        route = await stub.Route(route_req("mt-plane"))
        await stub.Release(router_pb2.ReleaseRequest(request_id="mt-plane"))
    worker = route.worker
    assert worker.request_plane_address and worker.request_plane_address != worker.address
    pool = ChannelPool(secured.tls("frontend"), "worker")
    streams = WorkerStreams(pool, planes=True)
    try:
        chunks = [c async for c in streams.generate(worker.address, gen_req("mt-plane"), 30,
                                                    worker.request_plane_address)]
        assert sum(len(c.token_ids) for c in chunks) == 4
    finally:
        await streams.close()
        await pool.close()
    before = secured.fleet.workers[0].engine.counters()["finished_requests"]
    router = PlaneCall(worker.request_plane_address, secured.tls("router"))
    err = await refused(router.__anext__())
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "'router'" in (err.details() or "")
    router.cancel()
    rogue = PlaneCall(worker.request_plane_address, MeshTls.load(secured.rogue, "frontend"))
    with pytest.raises(PlaneUnreachable, match="CERTIFICATE_VERIFY_FAILED") as info:
        await rogue.__anext__()  # the worker's certificate is not the rogue CA's
    assert isinstance(info.value.__cause__, ssl.SSLError)
    rogue.cancel()
    assert secured.fleet.workers[0].engine.counters()["finished_requests"] == before


async def test_other_roles_get_permission_denied_naming_method_and_role(
        secured: Secured) -> None:
    async with channel(secured.router.server.address, secured.tls("worker")) as ch:
        err = await refused(router_pb2_grpc.RouterStub(ch).Route(route_req("mt-w")))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "/kvmesh.router.Router/Route" in (err.details() or "")
    assert "'worker'" in (err.details() or "")
    assert (await metrics(secured.router))["kvmesh_router_inflight_requests"] == 0
    worker = secured.fleet.workers[0]
    before = worker.engine.counters()["finished_requests"]
    async with channel(worker.address, secured.tls("router")) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        err = await refused(stub.Generate(gen_req("mt-r")).read())
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "'router'" in (err.details() or "")
        err = await refused(stub.Abort(worker_pb2.AbortRequest(request_id="mt-ok")))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert (await stub.GetLoad(worker_pb2.GetLoadRequest())).worker_id == "fleet-mt.a0"
    assert worker.engine.counters()["finished_requests"] == before
    assert secured.router.server.authz is not None
    assert secured.router.server.authz.refused[
        ("/kvmesh.router.Router/Route", "worker", "PERMISSION_DENIED")] >= 1


async def test_no_certificate_or_another_ca_fails_the_handshake(secured: Secured) -> None:
    address = secured.router.server.address
    mesh, rogue = secured.tls("frontend"), MeshTls.load(secured.rogue, "frontend")
    attempts = {
        "plaintext": grpc.aio.insecure_channel(address),
        "no client certificate": grpc.aio.secure_channel(
            address, grpc.ssl_channel_credentials(root_certificates=mesh.ca),
            options=[("grpc.ssl_target_name_override", "kvmesh.mesh")]),
        # trusts the mesh CA but presents a certificate of its own CA
        "self-made CA": channel(address, MeshTls(mesh.ca, rogue.cert, rogue.key,
                                                 rogue.identity)),
    }
    for what, ch in attempts.items():
        async with ch:
            err = await refused(router_pb2_grpc.RouterStub(ch).Route(route_req(what),
                                                                     timeout=5))
        assert err.code() in (grpc.StatusCode.UNAVAILABLE,
                              grpc.StatusCode.UNAUTHENTICATED), (what, err)


async def test_a_client_accepts_only_a_server_holding_the_role_it_dials(
        secured: Secured) -> None:
    """A mesh certificate of the wrong role cannot pose as the server a client expects: a
    frontend dialling the worker's address as its router fails the TLS handshake."""
    address = secured.fleet.workers[0].address
    async with channel(address, secured.tls("frontend"), "router") as ch:
        err = await refused(router_pb2_grpc.RouterStub(ch).Route(route_req("mt-pose"),
                                                                 timeout=10))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
    async with channel(address, secured.tls("router"), "worker") as ch:
        load = await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest())
        assert load.worker_id == "fleet-mt.a0"


async def test_users_reach_the_frontend_api_without_a_mesh_certificate(
        secured: Secured) -> None:
    """The Frontend gRPC port is TLS (the mesh CA) without client certificates: users
    prove themselves with API keys; health is public there too."""
    mesh = secured.tls("frontend")
    user = grpc.ssl_channel_credentials(root_certificates=mesh.ca)
    address = secured.frontend.server.address
    async with grpc.aio.secure_channel(
            address, user, options=[("grpc.ssl_target_name_override", "kvmesh.mesh")]) as ch:
        models = await frontend_pb2_grpc.FrontendStub(ch).ListModels(
            frontend_pb2.ListModelsRequest(), timeout=10)
        assert [m.id for m in models.models] == ["mock"]
        health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                            timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    async with grpc.aio.insecure_channel(address) as ch:  # TLS all the same
        err = await refused(frontend_pb2_grpc.FrontendStub(ch).ListModels(
            frontend_pb2.ListModelsRequest(), timeout=10))
        assert err.code() == grpc.StatusCode.UNAVAILABLE


async def test_only_an_admin_dumps_the_index(secured: Secured) -> None:
    address = secured.indexer.server.address
    async with channel(address, secured.tls("admin")) as ch:
        await indexer_pb2_grpc.IndexerStub(ch).Dump(indexer_pb2.DumpRequest())
    async with channel(address, secured.tls("router")) as ch:
        stub = indexer_pb2_grpc.IndexerStub(ch)
        err = await refused(stub.Dump(indexer_pb2.DumpRequest()))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "/kvmesh.indexer.Indexer/Dump" in (err.details() or "")
        await stub.FindMatches(indexer_pb2.FindMatchesRequest(token_ids=PROMPT,
                                                              block_size=16))


async def test_the_fleets_signed_events_are_indexed(secured: Secured) -> None:
    """A request through the frontend leaves the fleet worker's blocks in the TLS indexer:
    its events, signed by the certificate ``fleet-mt`` for the worker
    ``fleet-mt.a0``, are accepted."""
    async with httpx.AsyncClient(timeout=30) as client:
        resp = await client.post(f"{secured.frontend.base_url}/v1/completions",
                                 json={"model": "mock", "prompt": PROMPT, "max_tokens": 2})
        assert resp.status_code == 200, resp.text
    address = secured.indexer.server.address
    async with channel(address, secured.tls("admin")) as ch:
        stub = indexer_pb2_grpc.IndexerStub(ch)

        async def dumped() -> list[int]:
            dump = await stub.Dump(indexer_pb2.DumpRequest(worker_id="fleet-mt.a0"))
            return [h for w in dump.workers for t in w.tiers for h in t.block_hashes]
        blocks = await wait_for(dumped, 15, lambda: f"fleet-mt.a0's blocks in the index "
                                                    f"({secured.indexer.feed.stats})")
    assert len(blocks) >= len(PROMPT) // 16
    async with channel(address, secured.tls("router")) as ch:
        found = await indexer_pb2_grpc.IndexerStub(ch).FindMatches(
            indexer_pb2.FindMatchesRequest(token_ids=PROMPT, block_size=16))
    assert [(o.worker_id, o.blocks) for o in found.overlaps] == [("fleet-mt.a0", 4)]
    stats = secured.indexer.feed.stats
    assert (stats.forged_entries, stats.unsigned_entries) == (0, 0)
    assert stats.events_applied >= 1


async def test_the_shared_or_a_real_workers_certificate_is_refused_to_a_fleet(
        secured: Secured, etcd: Child, tiny_model: str) -> None:
    args = fleet_args(etcd.address, secured.certs, "fleet-mt", tiny_model)
    shared = [a for a in args if a not in ("--tls-cert", "worker-fleet-mt")]
    with pytest.raises(ConfigError, match=r"tls_cert 'worker' is worker/worker: a fleet "
                                          r"under TLS needs a worker instance certificate"):
        load_config(FleetConfig, shared, {})
    write_mesh_certs(secured.certs, ["worker:prefill-0"])
    real = fleet_args(etcd.address, secured.certs, "prefill-0", tiny_model)
    with pytest.raises(ConfigError, match=r"tls_cert 'worker-prefill-0' is worker/prefill-0, "
                                          r"no fleet certificate.*worker:fleet-<x>"):
        load_config(FleetConfig, real, {})
    with pytest.raises(ConfigError, match=r"worker_id 'x\.y'"):
        load_config(FleetConfig, [*args, "--worker-id", "x.y"], {})


async def test_a_fake_worker_with_a_foreign_certificate_never_gets_a_request(
        secured: Secured, etcd: Child, tiny_model: str) -> None:
    fake = await start_fleet(load_config(FleetConfig, fleet_args(
        etcd.address, secured.rogue, "fleet-fake", tiny_model), {}))
    try:
        await wait_routable(secured.router, 2, "the real and the fake worker")
        reports = (await metrics(secured.router))["kvmesh_router_failure_reports_total"]
        async with httpx.AsyncClient(timeout=30) as client:
            for i in range(6):  # round robin: the fake is picked about every other time
                resp = await client.post(f"{secured.frontend.base_url}/v1/completions",
                                         json={"model": "mock", "prompt": PROMPT,
                                               "max_tokens": 3})
                assert resp.status_code == 200, (i, resp.text)
        counters = fake.workers[0].engine.counters()
        assert counters.get("finished_requests", 0) == 0
        assert counters.get("prefill_tokens", 0) == 0
        # the frontend's failed handshake was reported: the router holds the fake back
        after = await metrics(secured.router)
        assert after["kvmesh_router_failure_reports_total"] > reports
        assert after["kvmesh_router_unroutable_workers"] == 1
    finally:
        await fake.stop()


async def test_the_store_master_keeps_segments_to_their_owner(
        secured: Secured, etcd: Child) -> None:
    write_mesh_certs(secured.certs, ["worker:a", "worker:b"])
    app = await start_store_master(load_config(StoreMasterConfig, [
        *base_args(etcd.address, "mtls-store"), "--tls-dir", str(secured.certs)], {}))
    address = app.server.address
    mount = store_pb2.MountSegmentRequest(client_id="c-a", segment_id="seg-a", base=4096,
                                          size=1 << 20, endpoint="nixl:x")
    unmount = store_pb2.UnmountSegmentRequest(client_id="c-a", segment_id="seg-a")
    try:
        async with channel(address, MeshTls.load(secured.certs, "worker-a")) as a, \
                channel(address, MeshTls.load(secured.certs, "worker-b")) as b, \
                channel(address, secured.tls("frontend")) as f, \
                channel(address, secured.tls("admin")) as adm:
            owner, other = store_pb2_grpc.StoreMasterStub(a), store_pb2_grpc.StoreMasterStub(b)
            assert (await owner.MountSegment(mount)).mounted
            err = await refused(other.UnmountSegment(unmount))  # the victim's ids, not cert
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "segment_id: 'seg-a' belongs to worker/a, not worker/b" in (
                err.details() or "")
            err = await refused(other.MountSegment(mount))  # nor take it over
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED
            err = await refused(store_pb2_grpc.StoreMasterStub(f).MountSegment(mount))
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED
            err = await refused(owner.RemoveAll(store_pb2.RemoveAllRequest()))
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED
            await store_pb2_grpc.StoreMasterStub(adm).RemoveAll(store_pb2.RemoveAllRequest())
            health = await health_pb2_grpc.HealthStub(f).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            await owner.UnmountSegment(unmount)  # still mounted: its owner unmounts it
    finally:
        await app.server.stop()
