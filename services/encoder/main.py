"""Encoder (EPD's E) process wiring: config -> vLLM ec_producer -> gRPC server in etcd.

- :class:`EncoderConfig`: flags and ``KVMESH_*`` env (``validate()`` names each problem).
  ``--model-path tiny-vlm`` is the locally built tiny Idefics3
  (:func:`workers.model.tiny_vlm.ensure_tiny_vlm`).
- :func:`start_encoder(cfg)` -> :class:`EncoderApp`: starts the engine, then the server,
  registered as ``component="encoder"``, ``role=WORKER_ROLE_ENCODE`` with the model, the
  capability ``encode`` and its ``/metrics`` address (``--metrics-port``, -1: off). The
  cache's budget is ``--cache-mib``, which is also the connector's ``retain_mib``.
  ``app.fatal`` resolves when the engine dies (the servicer answers UNAVAILABLE, and
  :func:`serve_main` stops the process with exit code 3), as for a worker.
- ``main(argv)``: :func:`services.common.server.serve_main`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Sequence
from pathlib import Path

from protos import discovery_pb2, encoder_pb2, encoder_pb2_grpc
from services.common.config import BaseConfig
from services.common.server import MeshServer, ServiceSpec, serve_main
from services.encoder.core import EmbeddingCache
from services.encoder.engine import EncoderEngine, EncoderEngineConfig
from services.encoder.images import ImageFlags
from services.encoder.metrics import EncoderMetrics, serve_metrics
from services.encoder.service import Cached, EncoderServicer
from services.router.metrics import MetricsEndpoint


@dataclasses.dataclass
class EncoderConfig(BaseConfig, ImageFlags):
    """kvmesh encoder: image embeddings for EPD consumers over NIXL, with a cache."""

    model_path: str = dataclasses.field(
        default="tiny-vlm", metadata={"help": "model folder, or 'tiny-vlm' (built locally)"}
    )
    model_name: str = dataclasses.field(
        default="", metadata={"help": "served model name (default: the folder's name)"}
    )
    dtype: str = dataclasses.field(
        default="float32", metadata={"help": "model dtype"}
    )
    max_model_len: int = dataclasses.field(
        default=512, metadata={"help": "engine context length (one image per prompt)"}
    )
    max_num_seqs: int = dataclasses.field(
        default=8, metadata={"help": "images encoded in one engine step at most"}
    )
    cache_mib: int = dataclasses.field(
        default=32, metadata={"help": "embedding cache budget (MiB), kept in E's NIXL region"}
    )
    pool_mib: int = dataclasses.field(
        default=64, metadata={"help": "E's NIXL region (MiB): cache plus embeddings in flight"}
    )
    lease_s: float = dataclasses.field(
        default=30.0, metadata={"help": "how long E pins an unread embedding for its consumer"}
    )
    cache_ttl_s: float = dataclasses.field(
        default=0.0, metadata={"help": "oldest cache entry served, seconds (0: no limit)"}
    )
    image_placeholder: str = dataclasses.field(
        default="<image>", metadata={"help": "the model's image marker in a prompt"}
    )
    metrics_port: int = dataclasses.field(
        default=0, metadata={"help": "Prometheus /metrics port (0: any free, -1: off)"}
    )

    def problems(self) -> list[str]:
        out = super().problems()
        if not self.model_path:
            out.append("model_path must not be empty")
        if self.cache_mib < 0 or self.pool_mib < 1 or self.cache_mib >= self.pool_mib:
            out.append(f"cache_mib ({self.cache_mib}) must be >= 0 and below pool_mib "
                       f"({self.pool_mib}): in-flight embeddings need room too")
        if self.lease_s <= 0:
            out.append(f"lease_s must be positive, got {self.lease_s}")
        if self.cache_ttl_s < 0:
            out.append(f"cache_ttl_s must be >= 0, got {self.cache_ttl_s}")
        if self.max_model_len < 32 or self.max_num_seqs < 1:
            out.append("max_model_len must be >= 32 and max_num_seqs >= 1")
        if not -1 <= self.metrics_port <= 65535:
            out.append(f"metrics_port out of range: {self.metrics_port}")
        try:
            self.limits().validate()
        except ValueError as exc:
            out.append(str(exc))
        return out


def resolve_model_path(path: str) -> str:
    if path == "tiny-vlm":
        from workers.model.tiny_vlm import ensure_tiny_vlm

        return str(ensure_tiny_vlm())
    return path


@dataclasses.dataclass
class EncoderApp:
    """A started encoder: server (stops the engine too), engine, servicer, metrics."""

    server: MeshServer
    engine: EncoderEngine
    servicer: EncoderServicer
    metrics_endpoint: MetricsEndpoint | None

    def __post_init__(self) -> None:
        self.fatal: asyncio.Task[str] = asyncio.create_task(self._watch(),
                                                            name="encoder-engine-watch")

    async def _watch(self) -> str:
        reason = await self.engine.wait_dead()
        self.servicer.mark_dead(reason)
        return f"engine dead: {reason}"

    async def stop(self) -> None:
        if not self.fatal.done():
            self.fatal.cancel()
        await self.server.stop()
        if self.metrics_endpoint is not None:
            await self.metrics_endpoint.close()


async def start_encoder(cfg: EncoderConfig) -> EncoderApp:
    """Starts engine, metrics and server (see the module docstring)."""
    cfg.validate()
    model_path = resolve_model_path(cfg.model_path)
    name = cfg.model_name or Path(model_path).name
    engine = EncoderEngine(EncoderEngineConfig(
        model_path=model_path, model_name=name, dtype=cfg.dtype,
        max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
        pool_mib=cfg.pool_mib, retain_mib=cfg.cache_mib, lease_s=cfg.lease_s,
        image_placeholder=cfg.image_placeholder, host=cfg.public_host))
    await engine.start()
    cache: EmbeddingCache[Cached] = EmbeddingCache(cfg.cache_mib << 20, time.monotonic,
                                                   cfg.cache_ttl_s or None)
    servicer = EncoderServicer(engine, cache, cfg.limits(), name)
    metrics = EncoderMetrics(servicer.stats)
    servicer.metrics = metrics
    endpoint = serve_metrics(metrics, cfg.host, cfg.metrics_port) if cfg.metrics_port >= 0 \
        else None
    metrics_address = f"{cfg.public_host}:{endpoint.port}" if endpoint else ""

    def record(address: str) -> discovery_pb2.InstanceRecord:
        return discovery_pb2.InstanceRecord(
            instance_id=f"encoder-{engine.engine_id}", component="encoder", address=address,
            role=discovery_pb2.WORKER_ROLE_ENCODE, model=name, model_path=model_path,
            max_model_len=engine.info.max_model_len, capabilities=["encode"],
            engine="vllm", pid=os.getpid(), metrics_address=metrics_address,
            labels={"ec": "nixl", "cache_mib": str(cfg.cache_mib)})

    spec = ServiceSpec(encoder_pb2_grpc.add_EncoderServicer_to_server, servicer,
                       encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name)
    server = MeshServer(cfg, "encoder", [spec], record_factory=record,
                        on_stop=[engine.shutdown])
    try:
        await server.start()
    except BaseException:
        await engine.shutdown()
        if endpoint is not None:
            await endpoint.close()
        raise
    return EncoderApp(server, engine, servicer, endpoint)


def main(argv: Sequence[str] | None = None) -> int:
    return serve_main(EncoderConfig, argv, "encoder", start_encoder)
