"""AFD worker wiring: config → engine config, etcd record fields, pairing ↔ registration.

Contract (called by :mod:`workers.main` when ``--engine afd``):

- :func:`afd_engine_config`: the :class:`~workers.engines.afd.mesh_engine.AfdEngineConfig`
  of a :class:`~workers.config.WorkerConfig`. The transport endpoint is
  :func:`~workers.engines.afd.mesh_engine.endpoint_name` of the namespace and the FFN
  worker's id (the FFN's own id on the FFN side, ``--afd-ffn-id`` on the attention side),
  so the pairing is by FFN worker id.
- :func:`afd_record_fields`: what the etcd record says. Attention worker: role ``agg``
  (it serves whole requests, like an aggregated worker), capabilities plus
  :data:`~services.common.discovery.AFD_ATTENTION`; labels (for people)
  ``afd_role=afd_attention``, ``afd_ffn=<ffn id>``, ``afd_attention_id``,
  ``afd_transport``, ``afd_endpoint``. FFN worker: role unspecified, capabilities
  exactly ``[AFD_FFN]`` (no ``generate``: the router drops such records,
  :func:`services.common.discovery.routable`), labels ``afd_role=afd_ffn``,
  ``afd_attention_workers``, ``afd_transport``, ``afd_endpoint``.
- :func:`wait_first_pairing`: an attention worker waits (``--afd-pair-timeout-s``) for
  its FFN before it registers at all; RuntimeError naming the endpoint when none came.
- :func:`follow_pairing`: from then on the registration follows the pairing. **Choice**:
  while no FFN is paired the attention worker cannot serve a single token, so it turns
  health NOT_SERVING and revokes its etcd lease (the router's watch drops it at once and
  routes nothing to it; requests still reaching it are refused with ``AfdUnavailable``);
  once an FFN listens again on the endpoint it re-pairs, registers anew and turns
  SERVING. Requests in flight when the FFN went away end with the transport error (the
  engine frees their KV); they are not retried on the same worker.
"""

from __future__ import annotations

import asyncio
import logging
import time

from grpc_health.v1 import health_pb2

from protos import discovery_pb2
from services.common.discovery import AFD_ATTENTION, AFD_FFN, Registration
from services.common.server import MeshServer
from services.common.tls import tls_for
from workers.config import WorkerConfig
from workers.engines.afd.mesh_engine import AfdAttentionEngine, AfdEngineConfig, endpoint_name
from workers.engines.base import Engine

log = logging.getLogger(__name__)


def _ffn_id(cfg: WorkerConfig) -> str:
    return cfg.resolved_worker_id() if cfg.afd_role == "ffn" else cfg.afd_ffn_id


def afd_engine_config(cfg: WorkerConfig, model_path: str, name: str) -> AfdEngineConfig:
    return AfdEngineConfig(
        model_path=model_path, model_name=name, role=cfg.afd_role,
        endpoint=endpoint_name(cfg.namespace, _ffn_id(cfg)), transport=cfg.afd_transport,
        attention_id=cfg.afd_attention_id, attention_workers=cfg.afd_attention_workers,
        microbatches=cfg.afd_microbatches, max_batch_tokens=cfg.afd_max_batch_tokens,
        max_model_len=cfg.max_model_len, block_size=cfg.block_size,
        kv_cache_gib=cfg.kv_cache_gib, threads=cfg.afd_threads,
        recv_timeout_s=cfg.afd_recv_timeout_s, ffn_id=_ffn_id(cfg))


def afd_record_fields(cfg: WorkerConfig, caps: list[str],
                      role: int) -> tuple[list[str], int, dict[str, str]]:
    """(capabilities, role, labels) of an AFD worker's record (module docstring)."""
    labels = {"afd_transport": cfg.afd_transport,
              "afd_endpoint": endpoint_name(cfg.namespace, _ffn_id(cfg))}
    if cfg.afd_role == "ffn":
        labels.update(afd_role=AFD_FFN, afd_attention_workers=str(cfg.afd_attention_workers))
        return [AFD_FFN], discovery_pb2.WORKER_ROLE_UNSPECIFIED, labels
    labels.update(afd_role=AFD_ATTENTION, afd_ffn=cfg.afd_ffn_id,
                  afd_attention_id=str(cfg.afd_attention_id))
    return [*caps, AFD_ATTENTION], role, labels


async def wait_first_pairing(cfg: WorkerConfig, engine: Engine) -> None:
    if not isinstance(engine, AfdAttentionEngine):
        return
    if not await engine.wait_paired(cfg.afd_pair_timeout_s):
        raise RuntimeError(f"no AFD FFN worker {cfg.afd_ffn_id!r} answered at endpoint "
                           f"{engine.config.endpoint!r} within {cfg.afd_pair_timeout_s} s")


class _PairingFollower:
    """Health and etcd registration of a started attention worker follow its pairing."""

    def __init__(self, cfg: WorkerConfig, engine: AfdAttentionEngine,
                 server: MeshServer) -> None:
        self.cfg = cfg
        self.engine = engine
        self.server = server
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    def changed(self, paired: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._apply())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _apply(self) -> None:
        async with self._lock:  # the latest state wins, whatever order changes came in
            paired = self.engine.paired
            srv = self.server
            reg = srv.registration
            # MeshServer has no public pause: its health servicer and registration slot
            # are driven here, and stop() still closes whichever registration is current.
            if srv._stopped:  # noqa: SLF001
                return
            if paired and reg is None:
                assert srv.record_factory is not None
                record = srv.record_factory(srv.address)
                record.started_at_ms = int(time.time() * 1000)
                new = Registration(self.cfg.etcd_endpoint, self.cfg.namespace, record,
                                   self.cfg.lease_ttl, tls=tls_for(self.cfg, "worker"))
                await new.start()
                srv._registration = new  # noqa: SLF001
                await srv._set_all(health_pb2.HealthCheckResponse.SERVING)  # noqa: SLF001
                log.info("AFD attention worker paired again: registered, SERVING")
            elif not paired and reg is not None:
                await srv._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)  # noqa: SLF001
                srv._registration = None  # noqa: SLF001
                await reg.close()
                log.warning("AFD attention worker lost its FFN: NOT_SERVING, left etcd")


def follow_pairing(cfg: WorkerConfig, engine: Engine, server: MeshServer) -> None:
    """Starts following (module docstring); a no-op for the FFN worker."""
    if isinstance(engine, AfdAttentionEngine):
        follower = _PairingFollower(cfg, engine, server)
        engine.on_pairing(follower.changed)
        if not engine.paired:  # lost between the first pairing and the registration
            follower.changed(False)
