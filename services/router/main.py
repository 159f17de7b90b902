"""Router process wiring: etcd watch of workers → RouterCore → Router gRPC API."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import Sequence

from protos import discovery_pb2, router_pb2, router_pb2_grpc
from services.common.config import BaseConfig, ConfigError, load_config
from services.common.discovery import InstanceWatcher
from services.common.server import MeshServer, ServiceSpec, run, setup_logging
from services.common.telemetry import setup_tracing
from services.router.core import RouterCore
from services.router.policies.registry import default_registry
from services.router.service import LoadPoller, RouterServicer


@dataclasses.dataclass
class RouterConfig(BaseConfig):
    """kvmesh router: picks workers for requests."""

    policy: str = dataclasses.field(
        default="least_loaded", metadata={"help": "routing policy name"}
    )
    load_poll_s: float = dataclasses.field(
        default=0.5, metadata={"help": "seconds between worker load polls"}
    )

    def problems(self) -> list[str]:
        out = super().problems()
        if self.policy not in default_registry().names():
            out.append(f"unknown policy {self.policy!r}; known: {default_registry().names()}")
        if self.load_poll_s <= 0:
            out.append("load_poll_s must be > 0")
        return out


@dataclasses.dataclass
class RouterApp:
    """A started router: server, watcher and poller (stopped together by the server)."""

    server: MeshServer
    servicer: RouterServicer
    watcher: InstanceWatcher


async def start_router(cfg: RouterConfig) -> RouterApp:
    """Builds and starts a router; stop it with ``app.server.stop()``."""
    core = RouterCore(policy=default_registry().create(cfg.policy))
    servicer = RouterServicer(core, {})
    watcher = InstanceWatcher(cfg.etcd_endpoint, cfg.namespace, "worker")
    watcher.on_change(servicer.set_records)
    await watcher.start()
    poller = LoadPoller(core, cfg.load_poll_s)
    poller.start()
    spec = ServiceSpec(router_pb2_grpc.add_RouterServicer_to_server, servicer,
                       router_pb2.DESCRIPTOR.services_by_name["Router"].full_name)

    def record(address: str) -> discovery_pb2.InstanceRecord:
        return discovery_pb2.InstanceRecord(
            instance_id=f"router-{address}", component="router", address=address,
            labels={"policy": cfg.policy},
        )

    server = MeshServer(cfg, "router", [spec], record_factory=record,
                        on_stop=[poller.close, watcher.close])
    await server.start()
    return RouterApp(server, servicer, watcher)


async def amain(cfg: RouterConfig) -> None:
    app = await start_router(cfg)
    await run(app.server)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = load_config(RouterConfig, argv)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    setup_logging(cfg.log_level)
    setup_tracing("kvmesh-router")
    asyncio.run(amain(cfg))
    return 0


