"""Router process wiring: etcd watch of workers → RouterCore → Router gRPC API.

Contract:

- :class:`RouterConfig` holds every flag (each with a ``KVMESH_*`` env var). ``--policy``
  and ``--prefill-policy`` take a built-in policy or a profile name (packaged
  ``profiles.yaml`` plus ``--profiles FILE``); ``--indexer`` picks the overlap source:
  ``none`` (the router's own history), ``remote`` (the indexer service from discovery,
  ``--indexer-timeout-s``) or ``embedded`` (an in-process index passed to
  :func:`start_router`). ``--seed`` makes the policies' random choices reproducible:
  each policy gets its own ``random.Random`` drawn from one seeded here
  (:func:`~services.common.config.seeded_rng`; -1: from the OS).
- The clock (``time.monotonic``) and the RNGs are created here and passed to the core,
  the policies (through the registry's context) and the evictor; the profiles and
  perf-model files are read here too (``policy_setup.default_registry``).
- :func:`start_router(cfg, embedded_index=None)` builds and starts the router. With
  ``--indexer embedded`` pass the index (an object with ``find_matches(hashes)``, like
  ``services.indexer.core.KvIndex``; the caller keeps it fresh, e.g. with the indexer's
  stream consumer, and owns its lifetime); passing one with another mode is an error.
- Admission control: ``--admission none|early|current_load`` (default none) with
  ``--admission-ttft-slo-ms``, ``--admission-itl-slo-ms`` and ``--admission-perf-model``
  (``mocker`` = Dynamo's mocker polynomials, or a JSON perf table;
  ``services.common.perf_model.load_perf_model``), scaled by
  ``--admission-perf-speedup`` (the mock engine's ``speedup_ratio``), with
  ``--admission-kv-capacity-tokens`` (0: each decode worker's load report, blocks ×
  block size), ``--admission-decode-correction`` (actual / model ITL) and
  ``--admission-default-output-tokens`` (when a request carries no ``max_tokens``).
  :meth:`RouterConfig.make_admission` builds the
  :class:`~services.router.admission.live.RouterAdmission` (None for ``none``).
- Resilience: ``--failure-hold-s`` (default 5) is how long a ``ReportFailure`` keeps a
  worker unroutable unless it re-registers first; ``--inflight-ttl-s`` (default 600, keep
  it ≥ the frontend's longest request) drops in-flight entries no one released, checked
  every ``min(ttl / 4, 30)`` s (:class:`~services.router.service.InflightExpiry`).
- ``--metrics-port`` (0 = any free, -1 = off) serves the router's Prometheus metrics
  (:mod:`services.router.metrics`) on ``--host``; the address is published as the
  router record's ``metrics_address`` and the endpoint stops with the server.
- Replica sync: ``--replica-sync`` (off by default; needs ``--redis-url``) shares this
  router's in-flight load with the other routers of the namespace, and counts theirs
  (:mod:`services.router.replica_sync`): snapshots at most every
  ``--replica-sync-interval-ms`` after a change, a heartbeat every third of
  ``--replica-peer-timeout-s``, after which a silent peer stops counting. Turn it on for
  every router of a deployment with several (``kvmesh up --frontends N --router
  embedded`` does).
- EPD: a second watcher follows etcd's component ``encoder`` into the servicer's
  :class:`~services.router.encoders.EncoderPicker` (which E gets a request's images).
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from protos import discovery_pb2, router_pb2, router_pb2_grpc
from services.common.config import SeededConfig, seeded_rng
from services.common.discovery import InstanceWatcher
from services.common.perf_model import PerfModel, load_perf_model
from services.common.server import MeshServer, ServiceSpec, serve_main
from services.common.tls import tls_for
from services.router.admission.core import POLICIES as ADMISSION_POLICIES
from services.router.admission.core import AdmissionSettings
from services.router.admission.live import RouterAdmission
from services.router.core import RouterCore
from services.router.disagg import DisaggConfig
from services.router.indexer_modes import INDEXER_MODES
from services.router.metrics import RouterMetrics, serve_metrics
from services.router.overlaps import (
    EmbeddedSource,
    HistorySource,
    OverlapSource,
    RemoteSource,
)
from services.router.policies.base import Clock
from services.router.policies.profile import ProfileError
from services.router.policies.registry import PolicyRegistry
from services.router.policy_setup import default_registry
from services.router.replica_sync import DEFAULT_INTERVAL_S, DEFAULT_PEER_TIMEOUT_S, ReplicaSync
from services.router.service import Evictor, InflightExpiry, LoadPoller, RouterServicer


@dataclasses.dataclass
class RouterConfig(SeededConfig):
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
    prefill_whole: bool = dataclasses.field(
        default=False, metadata={"help": "P/D: when every D's KV would pass --whole-d-kv, "
                                         "a P worker that can decode alone serves the "
                                         "request whole (off by default)"}
    )
    whole_d_kv: float = dataclasses.field(
        default=0.9, metadata={"help": "P serves whole when every D's predicted KV is past "
                                       "this fraction ..."}
    )
    whole_p_kv: float = dataclasses.field(
        default=0.8, metadata={"help": "... and P's stays at or below this one"}
    )

    admission: str = dataclasses.field(
        default="none", metadata={"help": "admission control: none | early (Mooncake early "
                                          "rejection) | current_load"}
    )
    admission_ttft_slo_ms: float = dataclasses.field(
        default=2000.0, metadata={"help": "admission: TTFT SLO in ms"}
    )
    admission_itl_slo_ms: float = dataclasses.field(
        default=50.0, metadata={"help": "admission: ITL (decode step) SLO in ms"}
    )
    admission_perf_model: str = dataclasses.field(
        default="mocker", metadata={"help": "admission: 'mocker' or a JSON perf table path"}
    )
    admission_perf_speedup: float = dataclasses.field(
        default=1.0, metadata={"help": "admission: divide the mocker model's times by this "
                                       "(the mock engine's speedup_ratio)"}
    )
    admission_kv_capacity_tokens: int = dataclasses.field(
        default=0, metadata={"help": "admission: KV tokens per decode worker (0: from its "
                                     "load report)"}
    )
    admission_decode_correction: float = dataclasses.field(
        default=1.0, metadata={"help": "admission: actual / model ITL"}
    )
    admission_default_output_tokens: int = dataclasses.field(
        default=256, metadata={"help": "admission: expected output when max_tokens is unset"}
    )
    failure_hold_s: float = dataclasses.field(
        default=5.0, metadata={"help": "seconds a reported worker failure keeps it "
                                       "unroutable (unless it re-registers first)"}
    )
    inflight_ttl_s: float = dataclasses.field(
        default=1800.0, metadata={"help": "drop in-flight requests not released after this "
                                          "many seconds (>= the frontend's longest attempt: "
                                          "P and D, 600 s each, plus routing)"}
    )
    metrics_port: int = dataclasses.field(
        default=0, metadata={"help": "Prometheus /metrics port (0 = any free, -1 = off)"}
    )
    replica_sync: bool = dataclasses.field(
        default=False, metadata={"help": "share in-flight load with the namespace's other "
                                         "routers over Redis, and count theirs (several "
                                         "routers or frontend replicas)"}
    )
    replica_sync_interval_ms: float = dataclasses.field(
        default=DEFAULT_INTERVAL_S * 1000, metadata={
            "help": "replica sync: longest wait between a change and its snapshot"}
    )
    replica_peer_timeout_s: float = dataclasses.field(
        default=DEFAULT_PEER_TIMEOUT_S, metadata={
            "help": "replica sync: a peer not heard from for this long stops counting"}
    )

    def admission_settings(self) -> AdmissionSettings:
        """The admission knobs as the core's AdmissionSettings."""
        return AdmissionSettings(itl_slo_ms=self.admission_itl_slo_ms,
                                 ttft_slo_ms=self.admission_ttft_slo_ms,
                                 decode_correction=self.admission_decode_correction)

    def perf_model(self, capacity_tokens: int = 0) -> PerfModel:
        """The admission performance model for a worker of ``capacity_tokens`` (0: the
        model's default)."""
        if capacity_tokens > 0:
            return load_perf_model(self.admission_perf_model, self.admission_perf_speedup,
                                   capacity_tokens)
        return load_perf_model(self.admission_perf_model, self.admission_perf_speedup)

    def make_admission(self) -> RouterAdmission | None:
        """The router's admission control (None when ``--admission none``)."""
        if self.admission == "none":
            return None
        return RouterAdmission(self.admission, self.perf_model, self.admission_settings(),
                               self.admission_kv_capacity_tokens,
                               self.admission_default_output_tokens)

    def disagg_config(self) -> DisaggConfig:
        """The P/D knobs as the core's DisaggConfig."""
        return DisaggConfig(order=self.disagg_order, conditional=self.conditional_disagg,
                            isl_max=self.isl_max, isl_ratio=self.isl_ratio,
                            prefill_max_queue=self.prefill_max_queue,
                            decode_first_threshold=self.decode_first_threshold,
                            prefill_whole=self.prefill_whole, whole_d_kv=self.whole_d_kv,
                            whole_p_kv=self.whole_p_kv)

    def registry(self, clock: Clock) -> PolicyRegistry:
        """Built-in policies and packaged profiles, plus ``--profiles`` (files read here,
        in ``policy_setup``); policies that take a clock get ``clock``."""
        return default_registry(self.profiles or None, context={"clock": clock})

    def problems(self) -> list[str]:
        out = super().problems()
        try:
            names = self.registry(time.monotonic).names()
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
        if self.failure_hold_s < 0:
            out.append(f"failure_hold_s must be >= 0, got {self.failure_hold_s}")
        if not self.inflight_ttl_s > 0:
            out.append(f"inflight_ttl_s must be > 0, got {self.inflight_ttl_s}")
        if self.replica_sync and not self.redis_url:
            out.append("--replica-sync needs --redis-url (the sync stream)")
        if self.replica_sync and self.admission != "none":
            out.append(f"--replica-sync with --admission {self.admission} is not supported: "
                       "admission control counts only this router's own flights, so each "
                       "replica would admit as if it were alone")
        if not self.replica_sync_interval_ms > 0 or not self.replica_peer_timeout_s > 0:
            out.append("replica_sync_interval_ms and replica_peer_timeout_s must be > 0, "
                       f"got {self.replica_sync_interval_ms} and "
                       f"{self.replica_peer_timeout_s}")
        if not -1 <= self.metrics_port <= 65535:
            out.append(f"metrics_port out of range: {self.metrics_port}")
        if self.admission not in ADMISSION_POLICIES:
            out.append(f"admission must be one of {ADMISSION_POLICIES}, got {self.admission!r}")
        out.extend(self.admission_settings().problems())
        if self.admission_perf_speedup <= 0 or self.admission_kv_capacity_tokens < 0 \
                or self.admission_default_output_tokens < 1:
            out.append("admission_perf_speedup must be > 0, admission_kv_capacity_tokens "
                       ">= 0 and admission_default_output_tokens >= 1")
        elif self.admission != "none":
            try:
                self.make_admission()
            except (OSError, ValueError) as exc:
                out.append(f"admission perf model: {exc}")
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
    # host:port of the Prometheus endpoint ("" with --metrics-port -1).
    metrics_address: str = ""
    sync: ReplicaSync | None = None  # with --replica-sync


async def start_router(cfg: RouterConfig, embedded_index: Any = None) -> RouterApp:
    """Builds and starts a router; stop it with ``app.server.stop()``.

    ``embedded_index``: the in-process index for ``--indexer embedded`` (see the module
    docstring); required in that mode and refused in the others.
    """
    if (cfg.indexer == "embedded") != (embedded_index is not None):
        raise ValueError("an embedded index is required with --indexer embedded and only "
                         f"then (indexer={cfg.indexer!r})")
    clock: Clock = time.monotonic  # the router's one clock: core, policies, evictor
    registry = cfg.registry(clock)
    rng = seeded_rng(cfg.seed)
    core = RouterCore(policy=registry.create(cfg.policy, random.Random(rng.random())),
                      prefill_policy=registry.create(cfg.prefill_policy,
                                                     random.Random(rng.random())),
                      disagg=cfg.disagg_config(), admission=cfg.make_admission(),
                      clock=clock, failure_hold_s=cfg.failure_hold_s,
                      inflight_ttl_s=cfg.inflight_ttl_s)
    metrics = RouterMetrics(core)
    tls = tls_for(cfg, "router")
    indexer_watcher: InstanceWatcher | None = None
    overlaps: OverlapSource
    if cfg.indexer == "embedded":
        overlaps = EmbeddedSource(embedded_index)
    elif cfg.indexer == "remote":
        indexer_watcher = InstanceWatcher(cfg.etcd_endpoint, cfg.namespace, "indexer", tls=tls)
        await indexer_watcher.start()
        overlaps = RemoteSource(indexer_watcher.instances, cfg.indexer_timeout_s, tls=tls)
    else:
        overlaps = HistorySource()
    servicer = RouterServicer(core, {}, overlaps, metrics)
    watcher = InstanceWatcher(cfg.etcd_endpoint, cfg.namespace, "worker", tls=tls)
    watcher.on_change(servicer.set_records)
    await watcher.start()
    encoder_watcher = InstanceWatcher(cfg.etcd_endpoint, cfg.namespace, "encoder", tls=tls)
    encoder_watcher.on_change(servicer.set_encoders)
    await encoder_watcher.start()
    poller = LoadPoller(core, cfg.load_poll_s, tls, metrics)
    poller.start()
    evictor = Evictor(core, cfg.evict_interval_s, clock)
    evictor.start()
    expiry = InflightExpiry(core, min(cfg.inflight_ttl_s / 4, 30.0), metrics,
                            on_drop=servicer.encoders.release)
    expiry.start()
    endpoint = (serve_metrics(metrics, cfg.host, cfg.metrics_port) if cfg.metrics_port >= 0
                else None)
    metrics_address = f"{cfg.public_host}:{endpoint.port}" if endpoint is not None else ""
    spec = ServiceSpec(router_pb2_grpc.add_RouterServicer_to_server, servicer,
                       router_pb2.DESCRIPTOR.services_by_name["Router"].full_name)

    def record(address: str) -> discovery_pb2.InstanceRecord:
        return discovery_pb2.InstanceRecord(
            instance_id=f"router-{address}", component="router", address=address,
            labels={"policy": cfg.policy, "prefill_policy": cfg.prefill_policy,
                    "indexer": cfg.indexer, "admission": cfg.admission},
            metrics_address=metrics_address,
        )

    on_stop: list[Callable[[], Awaitable[None]]] = [
        poller.close, evictor.close, expiry.close, watcher.close, encoder_watcher.close,
        overlaps.close]
    if endpoint is not None:
        on_stop.append(endpoint.close)
    if indexer_watcher is not None:
        on_stop.append(indexer_watcher.close)
    server = MeshServer(cfg, "router", [spec], record_factory=record, on_stop=on_stop)
    await server.start()
    sync = None
    if cfg.replica_sync:  # it leaves after the calls in flight (their releases publish)
        sync = ReplicaSync(core, cfg.redis_url, cfg.namespace, tls,
                           interval_s=cfg.replica_sync_interval_ms / 1000,
                           peer_timeout_s=cfg.replica_peer_timeout_s,
                           on_failure=lambda op: metrics.sync_failures.labels(op).inc())
        await sync.start()
        server.after_stop.append(sync.close)
    return RouterApp(server, servicer, watcher, overlaps, indexer_watcher, metrics_address,
                     sync)


async def start_router_with_index(cfg: RouterConfig, consumer: str) -> tuple[RouterApp, Any]:
    """:func:`start_router`, and with ``--indexer embedded`` first the same stream
    consumer (``consumer``: its Redis consumer name) and index as the indexer service,
    stopped with the router's server; returns the app and the index (None without)."""
    if cfg.indexer != "embedded":
        return await start_router(cfg), None
    from services.indexer.core import KvIndex
    from services.indexer.feed import IndexFeed

    index = KvIndex()
    feed = IndexFeed(index, cfg.redis_url, cfg.etcd_endpoint, cfg.namespace, consumer,
                     clock=time.monotonic, tls=tls_for(cfg, "router"))
    await feed.start()
    try:
        app = await start_router(cfg, embedded_index=index)
    except BaseException:
        await feed.close()
        raise
    app.server.on_stop.append(feed.close)
    return app, index


async def _serve(cfg: RouterConfig) -> MeshServer:
    """The router process (with ``--indexer embedded`` the index runs inside it)."""
    return (await start_router_with_index(cfg, f"router-{os.getpid()}"))[0].server


def main(argv: Sequence[str] | None = None) -> int:
    return serve_main(RouterConfig, argv, "router", _serve)
