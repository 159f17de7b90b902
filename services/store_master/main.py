"""Store master process wiring: config → StoreMaster core (+ Redis metadata) → gRPC API.

Contract:

- :class:`StoreMasterConfig`: every tunable of the core as a flag / ``KVMESH_*`` env var,
  plus the allocation strategy, eviction policy, tick interval, persistence
  (``--persist auto|redis|none``; auto = redis when ``--redis-url`` is set) and ``--seed``
  (the random placement and eviction sampling; -1: from the OS).
- :func:`start_store_master(cfg, clock=time.time)` builds the core with ``clock`` and a
  ``random.Random`` from ``--seed`` (:func:`~services.common.config.seeded_rng`), loads
  the namespace's persisted metadata (when persistence is on), serves the API, registers
  in etcd as component ``store_master``, and runs :attr:`StoreMasterApp.ticker`, a
  :class:`~services.common.periodic.Periodic` calling :func:`tick_once` (the core's
  ``tick``, then the persister's Redis-restart ``check`` and a flush) every
  ``tick_interval_s``, first after one interval; an error is logged and the next tick
  backs off. Stopping the server stops the ticker and flushes once more.
- Redis restarts are noticed within one tick: the persister rewrites the whole metadata
  (``app.persister.rewrites`` counts it; see :mod:`services.store_master.persist`).
- Stopping never hangs on a cancellation lost inside a Redis call (redis-py sends through
  ``asyncio.wait_for`` when ``socket_timeout`` is set, its default since 8.0, and Python
  3.11's ``wait_for`` drops a cancel that arrives as the send completes): a tick that ends
  after the stop began raises ``CancelledError`` itself.
- The clock is wall time (``time.time``) so deadlines persisted in Redis stay meaningful
  across a restart; tests inject a fake clock they advance.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence

from protos import discovery_pb2, store_pb2, store_pb2_grpc
from services.common.config import SeededConfig, seeded_rng
from services.common.periodic import Periodic
from services.common.server import MeshServer, ServiceSpec, serve_main
from services.common.tls import tls_for
from services.store_master.core import (
    POLICIES,
    STRATEGIES,
    Clock,
    MasterParams,
    RestoreReport,
    StoreMaster,
    make_eviction_policy,
    make_strategy,
)
from services.store_master.persist import Persister, RedisMetadata
from services.store_master.service import StoreMasterServicer

log = logging.getLogger(__name__)

PERSIST_MODES = ("auto", "redis", "none")


@dataclasses.dataclass
class StoreMasterConfig(SeededConfig):
    """kvmesh store master: object metadata, replicas, leases and segments of the KV store."""

    read_lease_ttl_s: float = dataclasses.field(
        default=10.0, metadata={"help": "read lease granted by GetReplicaList/ExistKey (s)"})
    soft_pin_ttl_s: float = dataclasses.field(
        default=1800.0, metadata={"help": "soft pin lifetime, refreshed by reads (s)"})
    client_ttl_s: float = dataclasses.field(
        default=10.0, metadata={"help": "a store client not pinging this long is dropped (s)"})
    put_timeout_s: float = dataclasses.field(
        default=30.0, metadata={"help": "PutStart without PutEnd is reclaimed after (s)"})
    high_watermark: float = dataclasses.field(
        default=0.90, metadata={"help": "evict when used/capacity reaches this"})
    eviction_ratio: float = dataclasses.field(
        default=0.05, metadata={"help": "fraction of capacity one eviction round frees"})
    max_replicas: int = dataclasses.field(
        default=8, metadata={"help": "most replicas one PutStart may ask for"})
    max_client_gib: float = dataclasses.field(
        default=4096.0, metadata={"help": "most memory one client (certificate identity) "
                                          "may mount, GiB"})
    max_client_segments: int = dataclasses.field(
        default=64, metadata={"help": "most segments one client (certificate identity) "
                                      "may mount"})
    allocation_strategy: str = dataclasses.field(
        default="random", metadata={"help": "replica placement: " + ", ".join(STRATEGIES)})
    eviction_policy: str = dataclasses.field(
        default="sampled_lru", metadata={"help": "victim choice: " + ", ".join(POLICIES)})
    eviction_sample: int = dataclasses.field(
        default=8, metadata={"help": "candidates drawn per victim by sampled_lru"})
    tick_interval_s: float = dataclasses.field(
        default=1.0, metadata={"help": "period of leases/TTL/zombie/liveness/eviction work"})
    persist: str = dataclasses.field(
        default="auto", metadata={"help": "metadata persistence: auto (redis when "
                                          "--redis-url is set), redis, none"})

    def params(self) -> MasterParams:
        return MasterParams(
            lease_ttl_s=self.read_lease_ttl_s, soft_pin_ttl_s=self.soft_pin_ttl_s,
            client_ttl_s=self.client_ttl_s, put_timeout_s=self.put_timeout_s,
            high_watermark=self.high_watermark, eviction_ratio=self.eviction_ratio,
            max_replicas=self.max_replicas,
            max_client_bytes=int(self.max_client_gib * (1 << 30)),
            max_client_segments=self.max_client_segments)

    def persist_to_redis(self) -> bool:
        return self.persist == "redis" or (self.persist == "auto" and bool(self.redis_url))

    def problems(self) -> list[str]:
        out = super().problems()
        out += self.params().problems()
        if self.allocation_strategy not in STRATEGIES:
            out.append(f"unknown allocation_strategy {self.allocation_strategy!r} "
                       f"(known: {', '.join(STRATEGIES)})")
        if self.eviction_policy not in POLICIES:
            out.append(f"unknown eviction_policy {self.eviction_policy!r} "
                       f"(known: {', '.join(POLICIES)})")
        if self.eviction_sample < 1:
            out.append("eviction_sample must be >= 1")
        if self.tick_interval_s <= 0:
            out.append("tick_interval_s must be > 0")
        if self.persist not in PERSIST_MODES:
            out.append(f"persist must be one of {', '.join(PERSIST_MODES)}")
        elif self.persist == "redis" and not self.redis_url:
            out.append("--persist redis needs --redis-url")
        return out


@dataclasses.dataclass
class StoreMasterApp:
    """A started store master: server (stops the ticker too), core, persister, ticker."""

    server: MeshServer
    master: StoreMaster
    persister: Persister
    restored: RestoreReport | None
    ticker: Periodic


async def tick_once(master: StoreMaster, persister: Persister) -> None:
    """One round of the core's periodic work, then a Redis-restart check and a flush (even
    when ``tick`` raised; the ticker logs the error and backs off)."""
    try:
        report = master.tick()
        if report.zombies_reclaimed or report.clients_lost or report.objects_evicted:
            log.info("store tick: %s", report)
    finally:
        await persister.check()
        await persister.flush()


async def start_store_master(cfg: StoreMasterConfig, clock: Clock = time.time) -> StoreMasterApp:
    """Restores persisted metadata, then serves; stop with ``app.server.stop()``."""
    rng = seeded_rng(cfg.seed)
    master = StoreMaster(clock, rng, cfg.params(),
                         strategy=make_strategy(cfg.allocation_strategy, rng),
                         eviction=make_eviction_policy(cfg.eviction_policy, rng,
                                                       cfg.eviction_sample))
    store = (RedisMetadata(cfg.redis_url, cfg.namespace, tls_for(cfg, "store_master"))
             if cfg.persist_to_redis() else None)
    restored = None
    if store is not None:
        try:
            segments, objects = await store.load()
            _, marked = await store.epoch()
        except BaseException:
            await store.close()
            raise
        if (segments or objects) and not marked:
            log.warning("store metadata in Redis has no sentinel: written after a Redis "
                        "reset that no master rewrote, so it may lack objects (each record "
                        "restored is whole; the missing ones are simply unknown)")
        restored = master.restore(segments, objects)
        log.info("store metadata restored: %s", restored)
    persister = Persister(master, store)
    await persister.flush()  # drops what restore could not keep
    await persister.mark()
    stopping = asyncio.Event()

    async def tick() -> None:
        await tick_once(master, persister)
        if stopping.is_set():  # the stop's cancel was swallowed (see the module docstring)
            raise asyncio.CancelledError

    ticker = Periodic("store-master-tick", tick, cfg.tick_interval_s, delay_first=True)
    ticker.start()

    async def stop_ticker() -> None:
        stopping.set()
        await ticker.stop()
        await persister.flush()
        if store is not None:
            await store.close()

    servicer = StoreMasterServicer(master, persister)
    spec = ServiceSpec(store_pb2_grpc.add_StoreMasterServicer_to_server, servicer,
                       store_pb2.DESCRIPTOR.services_by_name["StoreMaster"].full_name)

    def record(address: str) -> discovery_pb2.InstanceRecord:
        return discovery_pb2.InstanceRecord(
            instance_id=f"store-master-{address}", component="store_master", address=address,
            labels={"persist": "redis" if store is not None else "none"})

    server = MeshServer(cfg, "store_master", [spec], record_factory=record,
                        on_stop=[stop_ticker])
    try:
        await server.start()
    except BaseException:
        await stop_ticker()
        raise
    return StoreMasterApp(server, master, persister, restored, ticker)


async def _serve(cfg: StoreMasterConfig) -> MeshServer:
    return (await start_store_master(cfg)).server


def main(argv: Sequence[str] | None = None) -> int:
    return serve_main(StoreMasterConfig, argv, "store-master", _serve)
