"""Readiness probe of a kvmesh gRPC server under mTLS: exit 0 iff its grpc.health.v1
Check answers SERVING.

The kubelet's native ``grpc`` probe speaks plaintext only, and a kvmesh server with
``KVMESH_TLS_DIR`` requires a client certificate of the mesh CA (health is open to every
authenticated role, services/common/authz.py). So under mTLS the pod runs this with its
own identity: ``python /opt/kvmesh-probe/kvmesh_probe.py ROLE``, where ROLE is the server
role the certificate must name (``<role>.kvmesh.mesh``: worker, router, indexer,
store_master, frontend, planner, encoder). It dials ``KVMESH_HOST:KVMESH_PORT`` (the pod
IP the server binds), presenting ``KVMESH_TLS_DIR/KVMESH_TLS_CERT`` (default: ROLE).
Exit codes: 0 SERVING, 1 any other status or an RPC error, 2 bad usage or missing files.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: kvmesh_probe.py ROLE", file=sys.stderr)
        return 2
    role = argv[0]
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common.tls import CertError, MeshTls, channel_options

    env = os.environ
    target = f"{env.get('KVMESH_HOST', '127.0.0.1')}:{env.get('KVMESH_PORT', '50051')}"
    try:
        tls = MeshTls.load(env.get("KVMESH_TLS_DIR", "/certs"), env.get("KVMESH_TLS_CERT") or role)
    except CertError as exc:
        print(f"kvmesh_probe: {exc}", file=sys.stderr)
        return 2
    with grpc.secure_channel(target, tls.channel_credentials(),
                             options=channel_options(role)) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=3.0)
        except grpc.RpcError as exc:
            print(f"kvmesh_probe: {target}: {exc.code().name} {exc.details()}", file=sys.stderr)
            return 1
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        print(f"kvmesh_probe: {target}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
