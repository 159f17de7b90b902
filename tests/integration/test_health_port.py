"""``--health-port``: a plaintext port serving only grpc.health.v1 (the kubelet's native
``grpc`` probe), beside a router's mTLS port, on real etcd."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import router_pb2, router_pb2_grpc
from services.common.config import ConfigError, load_config
from services.common.procs import Child
from services.common.tls import ROLES, write_mesh_certs
from services.router.main import RouterConfig, start_router
from tests.integration.conftest import base_args


async def health(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(resp.status)


async def test_the_health_port_answers_the_probe_and_nothing_else(
        etcd: Child, tmp_path_factory: pytest.TempPathFactory) -> None:
    certs = tmp_path_factory.mktemp("certs")
    write_mesh_certs(certs, list(ROLES))
    router = await start_router(load_config(RouterConfig, [
        *base_args(etcd.address, "health-port"), "--tls-dir", str(certs), "--health-port",
        "0"], {}))
    server = router.server
    probe = f"127.0.0.1:{server.health_port}"
    try:
        assert server.health_port not in (0, server.port)
        assert await health(probe) == health_pb2.HealthCheckResponse.SERVING
        assert await health(probe, "kvmesh.router.Router") == \
            health_pb2.HealthCheckResponse.SERVING
        async with grpc.aio.insecure_channel(probe) as ch:  # the router is not there
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await router_pb2_grpc.RouterStub(ch).ListWorkers(
                    router_pb2.ListWorkersRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.aio.AioRpcError):  # the mesh port stays mTLS only
            await health(f"127.0.0.1:{server.port}")
    finally:
        await server.stop()
    with pytest.raises(grpc.aio.AioRpcError) as err:  # stopped with the server
        await health(probe)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_bad_health_ports_are_refused() -> None:
    for bad in ("-2", "70000"):
        with pytest.raises(ConfigError, match="health_port"):
            load_config(RouterConfig, ["--health-port", bad], {}).validate()
    with pytest.raises(ConfigError, match="differ"):
        load_config(RouterConfig, ["--port", "5000", "--health-port", "5000"], {}).validate()
    assert load_config(RouterConfig, [], {"KVMESH_HEALTH_PORT": "8081"}).health_port == 8081
