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
from services.router.disagg import DisaggConfig
from services.router.policies.registry import default_registry
from services.router.service import LoadPoller, RouterServicer


@dataclasses.dataclass
class RouterConfig(BaseConfig):
    """kvmesh router: picks workers for requests."""

    policy: str = dataclasses.field(
        default="least_loaded", metadata={"help": "routing policy name"}
    )
    prefill_policy: str = dataclasses.field(
        default="least_loaded", metadata={"help": "policy for prefill workers"}
    )
    load_poll_s: float = dataclasses.field(
        default=0.5, metadata={"help": "seconds between worker load polls"}
    )
    disagg_order: str = dataclasses.field(
        default="prefill_first", metadata={"help": "prefill_first (Dynamo) | decode_first (llm-d)"}
    )
    conditional_disagg: bool = dataclasses.field(
        default=True, metadata={"help": "serve short uncached inputs on D alone"}
    )
    isl_max: int = dataclasses.field(
        default=2048, metadata={"help": "bypass P when uncached tokens < this ..."}
    )
    isl_ratio: float = dataclasses.field(
        default=0.7, metadata={"help": "... and uncached/prompt < this"}
    )
    prefill_max_queue: int = dataclasses.field(
        default=8, metadata={"help": "a prefill worker with this many queued is overloaded"}
    )
    decode_first_threshold: int = dataclasses.field(
        default=16, metadata={"help": "decode-first: remote P only for >= this many uncached"}
    )

    def disagg_config(self) -> DisaggConfig:
        """The P/D knobs as the core's DisaggConfig."""
        return DisaggConfig(order=self.disagg_order, conditional=self.conditional_disagg,
                            isl_max=self.isl_max, isl_ratio=self.isl_ratio,
                            prefill_max_queue=self.prefill_max_queue,
                            decode_first_threshold=self.decode_first_threshold)

    def problems(self) -> list[str]:
        out = super().problems()
        for name in (self.policy, self.prefill_policy):
            if name not in default_registry().names():
                out.append(f"unknown policy {name!r}; known: {default_registry().names()}")
        out.extend(self.disagg_config().problems())
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
    registry = default_registry()
    core = RouterCore(policy=registry.create(cfg.policy),
                      prefill_policy=registry.create(cfg.prefill_policy),
                      disagg=cfg.disagg_config())
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


