"""Planner process wiring: MeshObserver → PlannerCore.tick → Actuator, registered in etcd.

Contract:

- :class:`PlannerConfig` (flags + ``KVMESH_*`` env, one ``validate()``) maps onto
  :class:`PlannerSettings`, a performance model and an actuator.
- :class:`PlannerLoop.step` runs one tick: collect observations, ``core.tick(clock(), obs)``,
  apply the decision when it has actions or the mesh differs from it (an actuator error
  is logged; the next tick applies again), publish the desired counts in ``desired_replicas``
  of the planner's etcd record, and return the decision. ``start()`` runs ``step``
  every ``tick_s`` through :class:`~services.common.periodic.Periodic` (an error is logged
  and the next tick backs off); ``close()`` stops it. ``clock`` is required.
- :func:`start_planner` builds and starts everything and registers the planner as
  component ``planner`` through :class:`MeshServer` (health + reflection only; no gRPC API).
  Stopping the server stops the loop, the observer and the actuator (the local actuator
  stops the workers it started). Its scrapes of the frontends' ``/metrics`` send
  :meth:`PlannerConfig.scrape_api_key` as a Bearer token.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from protos import discovery_pb2
from services.common.config import BaseConfig
from services.common.injected import Clock
from services.common.perf_model import load_perf_model
from services.common.periodic import Periodic
from services.common.server import MeshServer, serve_main
from services.common.tls import tls_for
from services.planner.actuators import ACTUATORS, Actuator, LocalActuator, make_actuator
from services.planner.core import (
    AGG_POOLS,
    DISAGG_POOLS,
    PlannerCore,
    PlannerSettings,
    PoolLimits,
    ScalingDecision,
)
from services.planner.observe import MeshObserver, Snapshot
from services.planner.predictors import PREDICTORS

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PlannerConfig(BaseConfig):
    """kvmesh planner: predicts load and scales prefill/decode workers."""

    mode: str = dataclasses.field(default="disagg", metadata={
        "help": "disagg (prefill + decode pools) or agg (one pool of agg workers)"})
    throughput_interval_s: float = dataclasses.field(default=180.0, metadata={
        "help": "throughput-based prediction period (0 = off)"})
    load_interval_s: float = dataclasses.field(default=5.0, metadata={
        "help": "load-based correction period (0 = off)"})
    tick_s: float = dataclasses.field(default=0.0, metadata={
        "help": "observation period (0 = the shorter enabled interval)"})
    ttft_slo_ms: float = dataclasses.field(default=1000.0, metadata={"help": "TTFT SLO"})
    itl_slo_ms: float = dataclasses.field(default=50.0, metadata={"help": "ITL SLO"})
    min_prefill: int = dataclasses.field(default=1, metadata={"help": "min prefill replicas"})
    max_prefill: int = dataclasses.field(default=8, metadata={"help": "max prefill replicas"})
    min_decode: int = dataclasses.field(default=1, metadata={
        "help": "min decode replicas (agg workers in agg mode)"})
    max_decode: int = dataclasses.field(default=8, metadata={
        "help": "max decode replicas (agg workers in agg mode)"})
    cooldown_s: float = dataclasses.field(default=30.0, metadata={
        "help": "no load-based change of a pool this long after its last change"})
    predictor: str = dataclasses.field(default="constant", metadata={
        "help": "load predictor: " + ", ".join(PREDICTORS)})
    predictor_window: int = dataclasses.field(default=8, metadata={
        "help": "history window of moving_average / arima"})
    queue_high: float = dataclasses.field(default=2.0, metadata={
        "help": "waiting requests per worker above which a pool scales up"})
    kv_high: float = dataclasses.field(default=0.85, metadata={
        "help": "mean KV usage above which a pool scales up"})
    kv_low: float = dataclasses.field(default=0.4, metadata={
        "help": "mean KV usage below which a pool may scale down"})
    perf_model: str = dataclasses.field(default="mocker", metadata={
        "help": "'mocker' (Dynamo polynomial) or a JSON table of measured points"})
    perf_speedup: float = dataclasses.field(default=1.0, metadata={
        "help": "speedup ratio of the mocker polynomial"})
    kv_capacity_tokens: int = dataclasses.field(default=262144, metadata={
        "help": "KV capacity per replica in tokens (mocker model)"})
    actuator: str = dataclasses.field(default="dry_run", metadata={
        "help": "how to scale: " + ", ".join(ACTUATORS)})
    worker_env: str = dataclasses.field(default="{}", metadata={
        "help": "local actuator: JSON object of extra env vars for spawned workers"})
    worker_log_dir: str = dataclasses.field(default=".kvmesh/logs/planner", metadata={
        "help": "local actuator: logs of spawned workers"})
    compose_file: str = dataclasses.field(default="", metadata={
        "help": "compose actuator: compose file (-f)"})
    compose_project: str = dataclasses.field(default="", metadata={
        "help": "compose actuator: project name (-p)"})
    compose_services: str = dataclasses.field(
        default="prefill=prefill,decode=decode,agg=worker",
        metadata={"help": "compose actuator: pool=service,..."})
    k8s_deployments: str = dataclasses.field(
        default="prefill=kvmesh-prefill,decode=kvmesh-decode,agg=kvmesh-agg",
        metadata={"help": "kubernetes actuator: pool=Deployment,... (pools: prefill, "
                          "decode, agg; the only Deployments it scales)"})
    k8s_namespace: str = dataclasses.field(default="", metadata={
        "help": "kubernetes actuator: namespace of the Deployments (empty: the pod's own "
                "in cluster, the kubeconfig context's, else default)"})
    k8s_kubeconfig: str = dataclasses.field(default="", metadata={
        "help": "kubernetes actuator: kubeconfig file (empty: in-cluster service account)"})
    k8s_context: str = dataclasses.field(default="", metadata={
        "help": "kubernetes actuator: kubeconfig context (empty: its current context)"})
    k8s_timeout_s: float = dataclasses.field(default=10.0, metadata={
        "help": "kubernetes actuator: timeout of each API request"})
    k8s_conflict_retries: int = dataclasses.field(default=3, metadata={
        "help": "kubernetes actuator: re-reads and re-patches after a 409 Conflict"})
    metrics_urls: str = dataclasses.field(default="", metadata={
        "help": "comma-separated frontend /metrics URLs (default: discover frontends)"})
    scrape_timeout_s: float = dataclasses.field(default=2.0, metadata={
        "help": "timeout of GetLoad and /metrics scrapes"})
    frontend_api_key: str = dataclasses.field(default="", metadata={
        "help": "API key sent as a Bearer token to the frontends' /metrics (a frontend "
                "with --metrics-auth wants one; default: KVMESH_API_KEY)"})

    def scrape_api_key(self, environ: Mapping[str, str] = os.environ) -> str:
        """The key the planner's scrapes send: ``frontend_api_key``, else
        ``KVMESH_API_KEY`` (the key a client command of ``kvmesh`` sends), else none."""
        return self.frontend_api_key or environ.get("KVMESH_API_KEY", "")

    def worker_env_dict(self) -> dict[str, str]:
        data = json.loads(self.worker_env or "{}")
        if not isinstance(data, dict):
            raise ValueError("worker_env must be a JSON object")
        return {str(k): str(v) for k, v in data.items()}

    def compose_map(self) -> dict[str, str]:
        out = {}
        for item in filter(None, (s.strip() for s in self.compose_services.split(","))):
            pool, sep, svc = item.partition("=")
            if not sep or not pool or not svc:
                raise ValueError(f"bad compose_services item {item!r}")
            out[pool] = svc
        return out

    def k8s_map(self) -> dict[str, str]:
        """``k8s_deployments`` as pool → Deployment; ValueError naming a bad item."""
        out: dict[str, str] = {}
        for item in filter(None, (s.strip() for s in self.k8s_deployments.split(","))):
            pool, sep, name = (x.strip() for x in item.partition("="))
            if not sep or not pool or not name:
                raise ValueError(f"k8s_deployments: bad item {item!r} (want pool=Deployment)")
            if pool not in DISAGG_POOLS + AGG_POOLS:
                raise ValueError(f"k8s_deployments: the planner has no pool {pool!r} (its "
                                 f"pools: {', '.join(DISAGG_POOLS + AGG_POOLS)})")
            out[pool] = name
        return out

    def settings(self) -> PlannerSettings:
        dec = PoolLimits(self.min_decode, self.max_decode)
        return PlannerSettings(
            mode=self.mode, throughput_interval_s=self.throughput_interval_s,
            load_interval_s=self.load_interval_s, ttft_slo_ms=self.ttft_slo_ms,
            itl_slo_ms=self.itl_slo_ms, cooldown_s=self.cooldown_s, predictor=self.predictor,
            predictor_window=self.predictor_window, queue_high=self.queue_high,
            kv_high=self.kv_high, kv_low=self.kv_low,
            limits={"prefill": PoolLimits(self.min_prefill, self.max_prefill),
                    "decode": dec, "agg": dec})

    def resolved_tick_s(self) -> float:
        if self.tick_s > 0:
            return self.tick_s
        return min(x for x in (self.load_interval_s, self.throughput_interval_s) if x > 0)

    def problems(self) -> list[str]:
        out = super().problems() + self.settings().problems()
        if self.tick_s < 0 or self.scrape_timeout_s <= 0:
            out.append("tick_s must be >= 0 and scrape_timeout_s > 0")
        if self.actuator not in ACTUATORS:
            out.append(f"unknown actuator {self.actuator!r}")
        if self.perf_speedup <= 0 or self.kv_capacity_tokens < 1:
            out.append("perf_speedup must be > 0 and kv_capacity_tokens >= 1")
        if self.perf_model not in ("mocker", "polynomial") and not Path(self.perf_model).is_file():
            out.append(f"perf_model {self.perf_model!r} is neither 'mocker' nor a file")
        try:
            self.worker_env_dict()
            self.compose_map()
        except ValueError as exc:
            out.append(str(exc))
        if self.actuator == "kubernetes":
            out += self._k8s_problems()
        return out

    def _k8s_problems(self) -> list[str]:
        out = []
        try:
            mapped = self.k8s_map()
        except ValueError as exc:
            return [str(exc)]
        pools = AGG_POOLS if self.mode == "agg" else DISAGG_POOLS
        missing = [p for p in pools if p not in mapped]
        if missing:
            out.append(f"k8s_deployments: no Deployment for pool(s) {', '.join(missing)} "
                       f"of mode {self.mode!r}")
        if self.k8s_kubeconfig and not Path(self.k8s_kubeconfig).is_file():
            out.append(f"k8s_kubeconfig: {self.k8s_kubeconfig!r} is not a file")
        if self.k8s_context and not self.k8s_kubeconfig:
            out.append("k8s_context needs k8s_kubeconfig (in-cluster config has no contexts)")
        if self.k8s_timeout_s <= 0 or self.k8s_conflict_retries < 0:
            out.append("k8s_timeout_s must be > 0 and k8s_conflict_retries >= 0")
        return out


def build_actuator(cfg: PlannerConfig) -> Actuator:
    """The configured actuator. The local one gives workers the mesh's etcd, namespace,
    Redis and lease TTL plus ``worker_env``, and none of the planner's other KVMESH_*;
    with a tls dir, each worker also its own instance certificate, etcd user and worker
    id, issued in the planner's folder and copied alone into the worker's own folder
    (:func:`services.common.etcd_auth.enroll_worker`; never the CA key, the admin
    certificate or another role's secrets). The kubernetes one gets the Deployments of the
    mode's pools only, and loads its client configuration here, at start-up (in-cluster, or
    ``k8s_kubeconfig``): without one the planner does not start
    (:class:`~services.planner.kubernetes.KubernetesConfigError`)."""
    if cfg.actuator == "local":
        env = {"KVMESH_ETCD_ENDPOINT": cfg.etcd_endpoint, "KVMESH_NAMESPACE": cfg.namespace,
               "KVMESH_REDIS_URL": cfg.redis_url, "KVMESH_LEASE_TTL": str(cfg.lease_ttl),
               **cfg.worker_env_dict()}
        # the planner's own KVMESH_* settings (port, host, ...) must not leak into workers
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
        prepare = None
        if cfg.tls_dir and not cfg.insecure:  # each worker its certificate and etcd user
            from services.common.etcd_auth import enroll_worker

            prepare = functools.partial(enroll_worker, cfg.tls_dir, cfg.etcd_endpoint,
                                        cfg.namespace)
        return LocalActuator(Path(cfg.worker_log_dir), {**inherited, **env}, prepare=prepare)
    if cfg.actuator == "compose":
        return make_actuator("compose", services=cfg.compose_map(),
                             compose_file=cfg.compose_file, project=cfg.compose_project)
    if cfg.actuator == "kubernetes":
        from services.planner.kubernetes import load_client_configuration, resolve_namespace

        pools = AGG_POOLS if cfg.mode == "agg" else DISAGG_POOLS
        return make_actuator(
            "kubernetes", deployments={p: d for p, d in cfg.k8s_map().items() if p in pools},
            namespace=resolve_namespace(cfg.k8s_namespace, cfg.k8s_kubeconfig, cfg.k8s_context),
            configuration=load_client_configuration(cfg.k8s_kubeconfig, cfg.k8s_context),
            timeout_s=cfg.k8s_timeout_s, conflict_retries=cfg.k8s_conflict_retries)
    return make_actuator(cfg.actuator)


def external_workers(snapshot: Snapshot, own_pids: set[int]) -> dict[str, int]:
    """Ready workers per pool that the local actuator did not start (by published pid)."""
    out: dict[str, int] = {}
    for load in snapshot.observations.workers:
        rec = snapshot.records.get(load.worker_id)
        pid = rec.pid if rec is not None else 0
        if not (pid > 0 and pid in own_pids):
            out[load.role] = out.get(load.role, 0) + 1
    return out


class Observer(Protocol):
    """Anything that yields the mesh's current :class:`Snapshot` (MeshObserver, fakes)."""

    async def collect(self) -> Snapshot:
        ...


class PlannerLoop:
    """Observe → tick → actuate, every ``tick_s``; see the module docstring."""

    def __init__(self, core: PlannerCore, observer: Observer, actuator: Actuator,
                 tick_s: float, clock: Clock,
                 publish: Callable[[ScalingDecision], Awaitable[None]] | None = None) -> None:
        self.core = core
        self.observer = observer
        self.actuator = actuator
        self.clock = clock
        self.last: ScalingDecision | None = None
        self._publish = publish
        self.periodic = Periodic("planner-loop", self.step, tick_s)

    async def step(self) -> ScalingDecision:
        """One observe → tick → actuate round."""
        snap = await self.observer.collect()
        decision = self.core.tick(self.clock(), snap.observations)
        for a in decision.actions:
            log.info("%s %s by %d (%d → %d, %s): %s", a.kind, a.pool, a.n, a.from_replicas,
                     a.to_replicas, a.source, a.reason)
        for note in decision.notes:
            log.debug("planner: %s", note)
        if isinstance(self.actuator, LocalActuator):
            self.actuator.external = external_workers(snap, self.actuator.pids())
        if decision.actions or decision.ready != decision.desired:
            try:
                await self.actuator.apply(decision)
            except Exception:
                log.exception("actuator failed; retrying next tick")
        self.last = decision
        if self._publish is not None:
            try:
                await self._publish(decision)
            except Exception:
                log.exception("publishing the desired counts failed")
        return decision

    def start(self) -> None:
        """Runs :meth:`step` every ``tick_s`` (first at once) until :meth:`close`."""
        self.periodic.start()

    async def close(self) -> None:
        """Stops the loop and waits for it. Idempotent."""
        await self.periodic.stop()


@dataclasses.dataclass
class PlannerApp:
    """A started planner."""

    server: MeshServer
    loop: PlannerLoop
    core: PlannerCore


async def start_planner(cfg: PlannerConfig,
                        clock: Clock = time.monotonic) -> PlannerApp:
    """Builds, registers and starts the planner; stop it with ``app.server.stop()``.
    ``clock`` is the planner's time (seconds, monotonic): what its intervals and rates are
    measured in."""
    model = load_perf_model(cfg.perf_model, cfg.perf_speedup, cfg.kv_capacity_tokens)
    core = PlannerCore(cfg.settings(), model)
    urls = [u.strip() for u in cfg.metrics_urls.split(",") if u.strip()]
    observer = MeshObserver(cfg.etcd_endpoint, cfg.namespace, cfg.scrape_timeout_s, urls,
                            tls_for(cfg, "planner"), api_key=cfg.scrape_api_key())
    actuator = build_actuator(cfg)
    await observer.start()
    labels = {"mode": cfg.mode, "actuator": cfg.actuator}
    published: dict[str, int] = {}

    def record(address: str) -> discovery_pb2.InstanceRecord:
        return discovery_pb2.InstanceRecord(instance_id=f"planner-{address}",
                                            component="planner", address=address,
                                            labels=labels, desired_replicas=published)

    holder: dict[str, MeshServer] = {}

    async def publish(decision: ScalingDecision) -> None:
        new = dict(decision.desired)
        server = holder.get("server")
        if new == published or server is None or server.registration is None:
            return
        published.clear()
        published.update(new)
        await server.registration.update(record(server.address))

    loop = PlannerLoop(core, observer, actuator, cfg.resolved_tick_s(), clock, publish=publish)
    server = MeshServer(cfg, "planner", [], record_factory=record,
                        on_stop=[loop.close, observer.close, actuator.close])
    holder["server"] = server
    try:
        await server.start()
    except BaseException:
        await observer.close()
        raise
    loop.start()
    return PlannerApp(server, loop, core)


async def _serve(cfg: PlannerConfig) -> MeshServer:
    return (await start_planner(cfg)).server


def main(argv: Sequence[str] | None = None) -> int:
    return serve_main(PlannerConfig, argv, "planner", _serve)
