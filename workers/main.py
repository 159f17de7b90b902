"""Worker process wiring: config → engine → gRPC server registered in etcd.

A started :class:`WorkerApp` watches its engine (:meth:`Engine.wait_dead`): when the
engine dies, the servicer answers every Generate UNAVAILABLE ``engine dead: <reason>``
and ``WorkerApp.fatal`` resolves to that reason, so :func:`serve_main` turns the worker
NOT_SERVING, revokes its lease, stops it and exits with code 3 for its supervisor
(``kvmesh up``) to restart it.

Besides its gRPC port a worker serves its Generate calls on a TCP request plane
(:mod:`workers.request_plane`, ``--request-plane-port``, 0 = a free port, -1 = none;
mTLS with ``--tls-dir``) and publishes it as ``request_plane_address``; the frontend
calls it there (``--worker-transport tcp``, its default), at a fraction of gRPC's CPU.

AFD (``--engine afd``, :mod:`workers.engines.afd.worker`): ``--afd-role attention`` is
an ``agg`` worker with the capability ``afd_attention`` that registers only once paired
with its FFN worker (``--afd-ffn-id``) and leaves etcd (health NOT_SERVING) while
unpaired; ``--afd-role ffn`` registers with the capability ``afd_ffn`` and no
``generate``, so no router ever sends it a request.

EPD: ``--ec-role ec_consumer`` gives the vLLM engine the EC connector
(:func:`workers.ec.configs.ec_transfer_config`, ``--ec-backend``) and UCX on the
worker's host for its EngineCore; ``--max-images`` is vLLM's per-prompt image limit
(every vLLM worker; a text-only model ignores it) and the worker's :class:`ImageLimits`;
the record lists the capability ``images`` (and ``ec_consumer``) when the engine
accepts images. The deployments:

- E/PD: an ``agg`` worker with ``--ec-role ec_consumer``.
- E/P/D: P is ``--role prefill --ec-role ec_consumer``: its engine has both the EC
  connector (E's embeddings in) and the NIXL KV connector (the prompt's KV out to D),
  each with its own NIXL agent. D is a plain ``--role decode`` worker and needs **the
  images with their mm_hashes and P's KV, never the embeddings**: after the NIXL READ
  vLLM recomputes only the prompt's last token, which is text (images come only in chat
  messages, and the chat template's generation prompt follows them), so D's scheduler
  never schedules the vision encoder (were that token an image's, D would encode the
  image itself); but vLLM's processor still expands each image marker into the image's
  placeholder tokens (its prompt update wants the image item), and the mm_hash
  (``multi_modal_uuids``) goes into D's block hashes (``("mm", mm_hash, offset)`` extra
  keys), so D's prefix-cache keys equal P's and the router's, and a different image
  behind the same text is no false local hit on D. A request the router serves on D
  alone (conditional disaggregation) is an aggregated one there: D encodes its images
  itself. Proved in ``tests/integration/test_epd_mesh.py`` with the vision towers of P
  and D zeroed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from protos import discovery_pb2, worker_pb2, worker_pb2_grpc
from services.common.discovery import DECODE_ALONE
from services.common.event_bus import stream_name
from services.common.server import MeshServer, ServiceSpec, serve_main
from services.common.tls import tls_for
from services.encoder.images import ImageLimits
from workers.config import WorkerConfig
from workers.engines import create_engine
from workers.engines.base import Engine
from workers.kv.event_relay import EventEndpoints, KvEventRelay, vllm_kv_events_config
from workers.request_plane import RequestPlane
from workers.service import WorkerServicer

ROLE = {
    "agg": discovery_pb2.WORKER_ROLE_AGG,
    "prefill": discovery_pb2.WORKER_ROLE_PREFILL,
    "decode": discovery_pb2.WORKER_ROLE_DECODE,
}


def resolve_model_path(path: str) -> str:
    """'tiny' → the locally generated test model; 'tiny-vlm' → the locally built tiny
    Idefics3 (EPD); 'smollm2' → the prepared SmolLM2."""
    if path == "tiny":
        from workers.model.tiny import ensure_tiny_model

        return str(ensure_tiny_model())
    if path == "tiny-vlm":
        from workers.model.tiny_vlm import ensure_tiny_vlm

        return str(ensure_tiny_vlm())
    if path == "smollm2":
        from workers.model.prepare import prepare_smollm2

        return str(prepare_smollm2(progress=False))
    return path


def build_engine(cfg: WorkerConfig, events: EventEndpoints | None = None) -> Engine:
    """Creates (not starts) the configured engine; with ``events`` its KV event
    publisher binds those endpoints."""
    model_path = resolve_model_path(cfg.model_path) if cfg.model_path else ""
    name = cfg.model_name or (Path(model_path).name if model_path else cfg.engine)
    if cfg.engine == "mock":  # one simulated engine; many in one process: workers.fleet
        return create_engine("mock", model_path=model_path, model_name=name,
                             block_size=cfg.block_size, max_model_len=cfg.max_model_len,
                             max_num_seqs=cfg.max_num_seqs, seed=cfg.seed,
                             handoff="" if cfg.role == "agg" else "mock")
    if cfg.engine == "vllm":
        from workers.engines.vllm_engine import VllmEngineConfig
        from workers.kv.configs import worker_kv_transfer

        kv = worker_kv_transfer(cfg)
        # vLLM's per-prompt image limit on every vLLM worker (a text-only model ignores
        # it): an E/P/D decode worker has no EC role but takes the images too.
        kwargs: dict[str, Any] = {"max_num_seqs": cfg.max_num_seqs,
                                  "limit_mm_per_prompt": {"image": cfg.max_images}}
        env = dict(kv.env)
        if cfg.ec_role:  # EPD: this worker reads embeddings from encoders
            from workers.ec.configs import ec_env, ec_transfer_config

            kwargs["ec_transfer_config"] = ec_transfer_config(
                "ec_consumer", "example" if cfg.ec_backend == "example" else "nixl",
                shared_storage_path=cfg.ec_shared_path or None)
            env = {**ec_env(cfg.public_host), **env}
        return create_engine(
            "vllm",
            config=VllmEngineConfig(
                model_path=model_path,
                served_model_name=name,
                block_size=cfg.block_size,
                max_model_len=cfg.max_model_len,
                dtype=cfg.dtype,
                kv_cache_space_gib=cfg.kv_cache_gib,
                seed=cfg.seed,
                engine_kwargs=kwargs,
                kv_transfer_config=kv.config,
                kv_events_config=vllm_kv_events_config(events) if events else None,
                env=env,  # for its EngineCore only, not this whole process
                kv_handoff_timeout_s=cfg.kv_handoff_timeout_s,
            ),
        )
    if cfg.engine == "sglang":  # a child SGLang server (.sglvenv); P/D by its bootstrap
        from workers.engines.sglang.engine import SglangEngineConfig, kv_pool_tokens

        return create_engine("sglang", config=SglangEngineConfig(
            model_path=model_path, served_model_name=name, role=cfg.role,
            page_size=cfg.block_size, max_model_len=cfg.max_model_len, dtype=cfg.dtype,
            max_total_tokens=kv_pool_tokens(model_path, cfg.dtype, cfg.kv_cache_gib),
            seed=cfg.seed, host=cfg.public_host,
            kv_events_endpoint=events.events if events else "",
            kv_events_replay_endpoint=events.replay if events else "",
            kv_handoff_timeout_s=cfg.kv_handoff_timeout_s))
    if cfg.engine == "afd":
        from workers.engines.afd.worker import afd_engine

        return afd_engine(cfg, model_path, name)
    return create_engine(cfg.engine, model_path=model_path, model_name=name)


def build_relay(cfg: WorkerConfig, engine: Engine,
                events: EventEndpoints) -> KvEventRelay:
    """The relay of the engine's KV events to the namespace's stream (not started);
    SGLang's events are converted to vLLM's form first (:mod:`workers.kv.sglang_events`)."""
    convert = None
    if cfg.engine == "sglang":
        from workers.kv.sglang_events import SglangEventConverter

        convert = SglangEventConverter(cfg.block_size)
    return KvEventRelay(cfg.resolved_worker_id(), cfg.block_size, cfg.redis_url,
                        stream_name(cfg.namespace), events,
                        reset_cache=engine.reset_prefix_cache, maxlen=cfg.kv_events_maxlen,
                        tls=tls_for(cfg, "worker"), convert=convert,
                        flush_delay_s=cfg.kv_event_flush_ms / 1000)


def build_server(cfg: WorkerConfig, engine: Engine,
                 relay: KvEventRelay | None = None) -> MeshServer:
    """The worker's MeshServer; the engine must be started (its info is published).
    With a ``relay`` the worker answers GetKvState and closes the relay on stop."""
    worker_id = cfg.resolved_worker_id()
    servicer = WorkerServicer(engine, worker_id, relay,
                              ImageLimits(max_images=cfg.max_images),
                              stream_interval=cfg.stream_interval)
    rec_caps = ["generate", "abort", "load"]
    if cfg.role == "prefill" and engine.info.engine != "sglang":
        rec_caps.append(DECODE_ALONE)
    if engine.accepts_images:
        rec_caps.append("images")
        if cfg.ec_role:
            rec_caps.append(cfg.ec_role)
    metrics_address = ""
    if cfg.metrics_port >= 0:
        from workers.metrics import serve_metrics

        port = serve_metrics(engine, worker_id, cfg.role, cfg.host, cfg.metrics_port)
        metrics_address = f"{cfg.public_host}:{port}"

    plane = (RequestPlane(servicer.streams, cfg.host, cfg.request_plane_port, cfg.public_host,
                          tls_for(cfg, "worker"))
             if cfg.request_plane_port >= 0 else None)
    servicer.request_plane = plane
    role: int = ROLE[cfg.role]
    labels: dict[str, str] = {}
    if cfg.engine == "afd":  # AFD: the attention worker serves, the FFN worker never does
        from workers.engines.afd.worker import afd_record_fields

        rec_caps, role, labels = afd_record_fields(cfg, rec_caps, role, engine)

    def record(address: str) -> discovery_pb2.InstanceRecord:
        info = engine.info
        rec = discovery_pb2.InstanceRecord(
            instance_id=worker_id,
            component="worker",
            address=address,
            role=discovery_pb2.WorkerRole.ValueType(role),
            labels=labels,
            model=info.model,
            model_path=info.model_path,
            block_size=info.block_size,
            max_model_len=info.max_model_len,
            capabilities=rec_caps,
            engine=info.engine,
            kv_layout=info.kv_layout,
            pid=os.getpid(),
            metrics_address=metrics_address,
            # the incarnation its KV events carry (0 without a relay: the server's clock)
            started_at_ms=relay.started_at_ms if relay is not None else 0,
            request_plane_address=plane.address if plane is not None else "",
        )
        if info.handoff.get("mode"):
            rec.handoff.CopyFrom(discovery_pb2.KvHandoff(
                mode=info.handoff["mode"], engine_id=info.handoff.get("engine_id", ""),
                side_channel_host=info.handoff.get("host", ""),
                side_channel_port=int(info.handoff.get("port", 0)),
                tp_size=int(info.handoff.get("tp_size", 1)),
                kv_load_failure_policy=cfg.kv_load_failure_policy,
            ))
        return rec

    spec = ServiceSpec(
        worker_pb2_grpc.add_WorkerServicer_to_server,
        servicer,
        worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name,
    )
    # the engine first (running requests end), then the open GenerateStreams (on gRPC and
    # on the request plane), then the plane's connections
    on_stop: list[Callable[[], Awaitable[None]]] = [engine.shutdown, servicer.streams.close]
    before: list[Callable[[], Awaitable[object]]] = []
    if plane is not None:
        before.append(plane.start)
        on_stop.append(plane.close)
    if relay is not None:
        on_stop.append(relay.close)
        if "kv_events" not in rec_caps:
            rec_caps.append("kv_events")
    return MeshServer(cfg, "worker", [spec], record_factory=record, on_stop=on_stop,
                      before_register=before)


@dataclasses.dataclass
class WorkerApp:
    """A started worker: engine, optional KV event relay, server. ``fatal`` resolves to
    ``"engine dead: <reason>"`` when the engine dies (see the module docstring)."""

    server: MeshServer
    engine: Engine
    relay: KvEventRelay | None
    events: EventEndpoints | None

    def __post_init__(self) -> None:
        self.fatal: asyncio.Task[str] = asyncio.create_task(self._watch_engine(),
                                                            name="worker-engine-watch")

    async def _watch_engine(self) -> str:
        reason = await self.engine.wait_dead()
        for spec in self.server.services:
            if isinstance(spec.servicer, WorkerServicer):
                spec.servicer.mark_dead(reason)
        return f"engine dead: {reason}"

    async def stop(self) -> None:
        """Stops the server (which stops engine and relay) and removes the ipc folder."""
        if not self.fatal.done():
            self.fatal.cancel()
        await self.server.stop()
        if self.events is not None:
            self.events.remove()


async def start_worker(cfg: WorkerConfig) -> WorkerApp:
    """Builds and starts engine, relay (when KV events are published: started before
    the engine, so it sees the first batch) and server."""
    zmq_events = cfg.publishes_kv_events() and cfg.engine in ("vllm", "sglang")
    events = EventEndpoints.create() if zmq_events else None
    engine = build_engine(cfg, events)
    relay = None
    if cfg.publishes_kv_events():  # vLLM, SGLang publish on ZMQ; others call submit()
        relay = build_relay(cfg, engine, events or EventEndpoints(Path("/nonexistent"), "", ""))
    try:
        if relay is not None:
            await relay.start(zmq_input=zmq_events)
            set_sink = getattr(engine, "set_event_sink", None)
            if not zmq_events and set_sink is not None:
                set_sink(relay.submit)
        await engine.start()
        if cfg.engine == "afd":  # an attention worker registers once paired with its FFN
            from workers.engines.afd.worker import wait_first_pairing

            await wait_first_pairing(cfg, engine)
        server = build_server(cfg, engine, relay)
        await server.start()
        if cfg.engine == "afd":
            from workers.engines.afd.worker import follow_pairing

            follow_pairing(cfg, engine, server)
    except BaseException:
        if relay is not None:
            await relay.close()
        await engine.shutdown()
        if events is not None:
            events.remove()
        raise
    return WorkerApp(server, engine, relay, events)


def main(argv: Sequence[str] | None = None) -> int:
    return serve_main(WorkerConfig, argv, "worker", start_worker)
