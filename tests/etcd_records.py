"""Reading instance records straight from etcd in tests (what the watchers see)."""

from __future__ import annotations

from protos import discovery_pb2
from services.common.discovery import etcd_client, instances_prefix
from services.common.tls import MeshTls


async def instance_records(endpoint: str, namespace: str, component: str,
                           tls: MeshTls | None = None) -> list[discovery_pb2.InstanceRecord]:
    """Every ``component`` record under ``namespace`` now, in key order."""
    client = etcd_client(endpoint, tls)
    await client.connect()
    try:
        kvs = await client.get_prefix(instances_prefix(namespace, component).encode())
    finally:
        await client.close()
    out = []
    for kv in kvs:
        rec = discovery_pb2.InstanceRecord()
        rec.ParseFromString(kv.value)
        out.append(rec)
    return out
