"""Router process wiring: etcd watch of workers → RouterCore → Router gRPC API.

Contract:

- :class:`RouterConfig` holds every flag (each with a ``KVMESH_*`` env var). ``--policy``
  and ``--prefill-policy`` take a built-in policy or a profile name (packaged
  ``profiles.yaml`` plus ``--profiles FILE``); ``--indexer`` picks the overlap source:
  ``none`` (the router's own history), ``remote`` (the indexer service from discovery,
  ``--indexer-timeout-s``) or ``embedded`` (an in-process index passed to
  :func:`start_router`). ``--seed`` makes the policies' random choices reproducible.
- :func:`start_router(cfg, embedded_index=None)` builds and starts the router. With
  ``--indexer embedded`` pass the index (an object with ``find_matches(hashes)``, like
  ``services.indexer.core.KvIndex``; the caller keeps it fresh, e.g. with the indexer's
  stream consumer, and owns its lifetime); passing one with another mode is an error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from protos import discovery_pb2, router_pb2, router_pb2_grpc
from services.common.config import BaseConfig, ConfigError, load_config
from services.common.discovery import InstanceWatcher
from services.common.server import MeshServer, ServiceSpec, run, setup_logging
from services.common.telemetry import setup_tracing
from services.router.core import RouterCore
from services.router.disagg import DisaggConfig
from services.router.overlaps import (
    INDEXER_MODES,
    EmbeddedSource,
    HistorySource,
    OverlapSource,
    RemoteSource,
)
from services.router.policies.profile import ProfileError
from services.router.policies.registry import PolicyRegistry, default_registry
from services.router.service import Evictor, LoadPoller, RouterServicer


@dataclasses.dataclass
class RouterConfig(BaseConfig):
    """kvmesh router: picks workers for requests."""

    policy: str = dataclasses.field(
        default="least_loaded", metadata={"help": "routing policy or profile name"}
    )
    prefill_policy: str = dataclasses.field(
        default="least_loaded", metadata={"help": "policy or profile for prefill workers"}
    )
    profiles: str = dataclasses.field(
        default="", metadata={"help": "YAML file of extra profiles (same names replace the "
                                      "packaged ones)"}
    )
    indexer: str = dataclasses.field(
        default="none", metadata={"help": "overlap source: none (router history) | remote "
                                          "(indexer service via etcd) | embedded"}
    )
    indexer_timeout_s: float = dataclasses.field(
        default=0.1, metadata={"help": "FindMatches deadline; on failure use the history"}
    )
    evict_interval_s: float = dataclasses.field(
        default=60.0, metadata={"help": "seconds between policy cache evictions (approx)"}
    )
    seed: int = dataclasses.field(
        default=-1, metadata={"help": "seed of the policies' random choices (-1: random)"}
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

    def registry(self) -> PolicyRegistry:
        """Built-in policies and packaged profiles, plus ``--profiles``."""
        return default_registry(self.profiles or None)

    def problems(self) -> list[str]:
        out = super().problems()
        try:
            names = self.registry().names()
        except ProfileError as exc:
            out.append(str(exc))
        else:
            for name in (self.policy, self.prefill_policy):
                if name not in names:
                    out.append(f"unknown policy {name!r}; known: {names}")
        out.extend(self.disagg_config().problems())
        if self.load_poll_s <= 0:
            out.append("load_poll_s must be > 0")
        if self.indexer not in INDEXER_MODES:
            out.append(f"indexer must be one of {INDEXER_MODES}, got {self.indexer!r}")
        if self.indexer == "embedded" and not self.redis_url:
            out.append("--indexer embedded needs --redis-url (the KV event stream)")
        if self.indexer_timeout_s <= 0 or self.evict_interval_s <= 0:
            out.append("indexer_timeout_s and evict_interval_s must be > 0")
        return out


@dataclasses.dataclass
class RouterApp:
    """A started router: server, watcher and poller (stopped together by the server)."""

    server: MeshServer
    servicer: RouterServicer
    watcher: InstanceWatcher
    # The overlap source (``servicer.overlap_source``); RemoteSource counts fallbacks.
    overlaps: OverlapSource | None = None
    indexer_watcher: InstanceWatcher | None = None


async def start_router(cfg: RouterConfig, embedded_index: Any = None) -> RouterApp:
    """Builds and starts a router; stop it with ``app.server.stop()``.

    ``embedded_index``: the in-process index for ``--indexer embedded`` (see the module
    docstring); required in that mode and refused in the others.
    """
    if (cfg.indexer == "embedded") != (embedded_index is not None):
        raise ValueError("an embedded index is required with --indexer embedded and only "
                         f"then (indexer={cfg.indexer!r})")
    registry = cfg.registry()
    rng = random.Random(None if cfg.seed < 0 else cfg.seed)
    core = RouterCore(policy=registry.create(cfg.policy, random.Random(rng.random())),
                      prefill_policy=registry.create(cfg.prefill_policy,
                                                     random.Random(rng.random())),
                      disagg=cfg.disagg_config())
    indexer_watcher: InstanceWatcher | None = None
    overlaps: OverlapSource
    if cfg.indexer == "embedded":
        overlaps = EmbeddedSource(embedded_index)
    elif cfg.indexer == "remote":
        indexer_watcher = InstanceWatcher(cfg.etcd_endpoint, cfg.namespace, "indexer")
        await indexer_watcher.start()
        overlaps = RemoteSource(indexer_watcher.instances, cfg.indexer_timeout_s)
    else:
        overlaps = HistorySource()
    servicer = RouterServicer(core, {}, overlaps)
    watcher = InstanceWatcher(cfg.etcd_endpoint, cfg.namespace, "worker")
    watcher.on_change(servicer.set_records)
    await watcher.start()
    poller = LoadPoller(core, cfg.load_poll_s)
    poller.start()
    evictor = Evictor(core, cfg.evict_interval_s)
    evictor.start()
    spec = ServiceSpec(router_pb2_grpc.add_RouterServicer_to_server, servicer,
                       router_pb2.DESCRIPTOR.services_by_name["Router"].full_name)

    def record(address: str) -> discovery_pb2.InstanceRecord:
        return discovery_pb2.InstanceRecord(
            instance_id=f"router-{address}", component="router", address=address,
            labels={"policy": cfg.policy, "prefill_policy": cfg.prefill_policy,
                    "indexer": cfg.indexer},
        )

    on_stop: list[Callable[[], Awaitable[None]]] = [
        poller.close, evictor.close, watcher.close, overlaps.close]
    if indexer_watcher is not None:
        on_stop.append(indexer_watcher.close)
    server = MeshServer(cfg, "router", [spec], record_factory=record, on_stop=on_stop)
    await server.start()
    return RouterApp(server, servicer, watcher, overlaps, indexer_watcher)


async def amain(cfg: RouterConfig) -> None:
    feed = None
    index = None
    if cfg.indexer == "embedded":
        # Same stream, same core as the indexer service, inside the router process.
        from services.indexer.core import KvIndex
        from services.indexer.feed import IndexFeed

        index = KvIndex()
        feed = IndexFeed(index, cfg.redis_url, cfg.etcd_endpoint, cfg.namespace,
                         f"router-{os.getpid()}")
        await feed.start()
    try:
        app = await start_router(cfg, embedded_index=index)
        await run(app.server)
    finally:
        if feed is not None:
            await feed.close()


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


