"""Indexer process wiring: Redis Stream (+ etcd) → IndexFeed → KvIndex → Indexer gRPC API."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from protos import discovery_pb2, indexer_pb2, indexer_pb2_grpc
from services.common.config import BaseConfig
from services.common.server import MeshServer, ServiceSpec, serve_main
from services.common.tls import tls_for
from services.indexer.core import KvIndex
from services.indexer.feed import IndexFeed
from services.indexer.service import IndexerServicer


@dataclasses.dataclass
class IndexerConfig(BaseConfig):
    """kvmesh indexer: where each worker's KV blocks live, from the KV event stream."""

    group: str = dataclasses.field(
        default="indexer", metadata={"help": "Redis consumer group (one per indexer replica)"}
    )
    read_batch: int = dataclasses.field(
        default=512, metadata={"help": "stream entries per XREADGROUP"}
    )

    def problems(self) -> list[str]:
        out = super().problems()
        if not self.redis_url:
            out.append("the indexer needs --redis-url (the KV event stream)")
        if not self.group:
            out.append("group must not be empty")
        if self.read_batch < 1:
            out.append("read_batch must be >= 1")
        return out


@dataclasses.dataclass
class IndexerApp:
    """A started indexer: server (stops the feed too), feed and index."""

    server: MeshServer
    feed: IndexFeed
    index: KvIndex


async def start_indexer(cfg: IndexerConfig) -> IndexerApp:
    """Rebuilds the index from the stream, then serves it; stop with ``app.server.stop()``."""
    index = KvIndex()
    feed = IndexFeed(index, cfg.redis_url, cfg.etcd_endpoint, cfg.namespace, cfg.group,
                     clock=time.monotonic, batch=cfg.read_batch, tls=tls_for(cfg, "indexer"))
    await feed.start()
    servicer = IndexerServicer(index, feed.stats)
    spec = ServiceSpec(indexer_pb2_grpc.add_IndexerServicer_to_server, servicer,
                       indexer_pb2.DESCRIPTOR.services_by_name["Indexer"].full_name)

    def record(address: str) -> discovery_pb2.InstanceRecord:
        return discovery_pb2.InstanceRecord(instance_id=f"indexer-{address}",
                                            component="indexer", address=address,
                                            labels={"group": cfg.group})

    server = MeshServer(cfg, "indexer", [spec], record_factory=record, on_stop=[feed.close])
    try:
        await server.start()
    except BaseException:
        await feed.close()
        raise
    return IndexerApp(server, feed, index)


async def _serve(cfg: IndexerConfig) -> MeshServer:
    return (await start_indexer(cfg)).server


def main(argv: Sequence[str] | None = None) -> int:
    return serve_main(IndexerConfig, argv, "indexer", _serve)
