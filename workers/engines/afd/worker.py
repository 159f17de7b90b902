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
- :func:`afd_engine`: the engine :mod:`workers.main` builds. ``--afd-transport shm``:
  :mod:`~workers.engines.afd.mesh_engine`'s engines. ``nixl``
  (:mod:`~workers.engines.afd.transport_nixl`; UCX pinned first with
  :func:`workers.kv.nixl.ucx_env` of the advertised host, an operator's ``UCX_TLS`` /
  ``UCX_NET_DEVICES`` kept): :class:`NixlFfnEngine` / :class:`NixlAttentionEngine`,
  the same engines with a NIXL endpoint, paired as follows.

NIXL pairing (both directions, nothing but the FFN's record in etcd):

- The FFN worker publishes its endpoint's ``info()`` in its own etcd record, label
  :data:`NIXL_INFO_LABEL` = base64 of those opaque bytes (the transport's
  :class:`~workers.engines.afd.transport_nixl.EndpointInfo`; read only by
  :func:`ffn_nixl_info`). It never changes while the process lives; a restarted FFN
  publishes a new one under the same worker id.
- The attention worker watches the ``worker`` records (read access is all it needs, also
  with etcd auth, which lets a worker write only its own key — and it has none while
  unpaired). For its FFN's info it makes a fresh endpoint, ``connect``s it and
  ``announce``s its own info in band (a NIXL notification); the FFN server connects every
  attention endpoint that announces itself (2A1F: each; one with the same attention id
  replaces the old one) and acknowledges; once acknowledged the attention worker is
  paired. An info whose process on this host has exited is skipped (its record outlives
  it by up to a lease); one the FFN refused (sizes differ) is not retried until the FFN's
  record changes; an unacknowledged endpoint is replaced when the record changes.
- Lost: a transport error mid-request (the FFN's process gone, a WRITE failed, a
  timeout), or, while idle (every ~0.2 s), the FFN's goodbye, its process gone, or its
  record gone or changed. Then exactly as with shm: the requests end with the error,
  their KV freed, the worker leaves etcd, and pairs again with the next FFN record.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import torch
from grpc_health.v1 import health_pb2

from protos import discovery_pb2
from services.common.discovery import AFD_ATTENTION, AFD_FFN, InstanceWatcher, Registration
from services.common.server import MeshServer
from services.common.tls import tls_for
from workers.config import WorkerConfig
from workers.engines.afd.connector import AfdTransportError
from workers.engines.afd.engine import SplitExecutor
from workers.engines.afd.mesh_engine import (
    AfdAttentionEngine,
    AfdEngineConfig,
    AfdFfnEngine,
    endpoint_name,
)
from workers.engines.afd.observe import TimedAttentionConnector, TimedFfnConnector, TimedFfnSide
from workers.engines.afd.transport_nixl import EndpointInfo, NixlAfdConnector, pid_gone
from workers.engines.base import Engine, EngineInfo

log = logging.getLogger(__name__)

NIXL_INFO_LABEL = "afd_nixl_info"  # FFN record: base64 of its NIXL endpoint's info()
_ACK_WAIT_S = 0.2  # one pairing try's wait for the FFN's acknowledgement
_IDLE_POLL_S = 0.2  # the FFN server's wait for work (as mesh_engine's)


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


def afd_record_fields(cfg: WorkerConfig, caps: list[str], role: int,
                      engine: Engine | None = None) -> tuple[list[str], int, dict[str, str]]:
    """(capabilities, role, labels) of an AFD worker's record (module docstring); a NIXL
    FFN worker's needs its started ``engine`` (RuntimeError without)."""
    labels = {"afd_transport": cfg.afd_transport,
              "afd_endpoint": endpoint_name(cfg.namespace, _ffn_id(cfg))}
    if cfg.afd_role == "ffn":
        labels.update(afd_role=AFD_FFN, afd_attention_workers=str(cfg.afd_attention_workers))
        if cfg.afd_transport == "nixl":
            if not isinstance(engine, NixlFfnEngine):
                raise RuntimeError("a NIXL AFD FFN worker's record needs its started engine")
            labels[NIXL_INFO_LABEL] = base64.b64encode(engine.nixl_info()).decode("ascii")
        return [AFD_FFN], discovery_pb2.WORKER_ROLE_UNSPECIFIED, labels
    labels.update(afd_role=AFD_ATTENTION, afd_ffn=cfg.afd_ffn_id,
                  afd_attention_id=str(cfg.afd_attention_id))
    return [*caps, AFD_ATTENTION], role, labels


def afd_engine(cfg: WorkerConfig, model_path: str, name: str) -> Engine:
    """The (unstarted) engine of ``cfg``'s AFD role and transport (module docstring)."""
    config = afd_engine_config(cfg, model_path, name)
    worker_id = cfg.resolved_worker_id()
    if cfg.afd_transport != "nixl":
        from workers.engines import create_engine

        return create_engine("afd", config=config, worker_id=worker_id)
    from workers.kv.nixl import ucx_env

    for key, value in ucx_env(cfg.public_host).items():
        if key.startswith("UCX_"):
            os.environ.setdefault(key, value)
    if cfg.afd_role == "ffn":
        return NixlFfnEngine(config, worker_id)

    def watcher() -> InstanceWatcher:
        return InstanceWatcher(cfg.etcd_endpoint, cfg.namespace, "worker",
                               tls=tls_for(cfg, "worker"))

    return NixlAttentionEngine(config, worker_id, watcher)


def ffn_nixl_info(record: discovery_pb2.InstanceRecord | None) -> bytes | None:
    """The NIXL endpoint info an FFN worker's record publishes (None: not an FFN record,
    or no readable :data:`NIXL_INFO_LABEL`)."""
    if record is None or AFD_FFN not in record.capabilities:
        return None
    text = record.labels.get(NIXL_INFO_LABEL, "")
    if not text:
        return None
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        log.warning("FFN record %s: label %s is not base64", record.instance_id,
                    NIXL_INFO_LABEL)
        return None


class NixlFfnEngine(AfdFfnEngine):
    """:class:`AfdFfnEngine` on a NIXL endpoint, which connects every attention endpoint
    that announces itself (module docstring)."""

    def __init__(self, config: AfdEngineConfig, worker_id: str = "") -> None:
        super().__init__(config, worker_id)
        self._nixl: NixlAfdConnector | None = None

    def nixl_info(self) -> bytes:
        """The endpoint's info for the record (RuntimeError before ``start``)."""
        if self._nixl is None:
            raise RuntimeError("engine not started")
        return self._nixl.info()

    async def start(self) -> None:
        from workers.engines.afd.ffn_server import FfnServer
        from workers.engines.afd.model import load_config, load_ffn_side

        cfg = self.config
        torch.set_num_threads(cfg.threads)
        mcfg = load_config(cfg.model_path)
        ffn = await asyncio.to_thread(load_ffn_side, cfg.model_path, mcfg)
        self._nixl = NixlAfdConnector("ffn", cfg.transport_config(mcfg.hidden_size))
        self._conn = self._nixl
        timed = TimedFfnConnector(self._nixl, self.metrics_collector)
        self._server = FfnServer(TimedFfnSide(ffn, timed), timed)
        self._info = EngineInfo(
            engine="afd", model=cfg.model_name, model_path=cfg.model_path,
            block_size=cfg.block_size,
            max_model_len=min(cfg.max_model_len, mcfg.max_position_embeddings),
            kv_layout=f"afd-ffn:llama:float32:l{mcfg.num_layers}:h{mcfg.hidden_size}")
        loop = asyncio.get_running_loop()
        dead: asyncio.Future[str] = loop.create_future()
        self._dead = dead
        server = self._server

        def settle(reason: str) -> None:
            if not dead.done():
                dead.set_result(reason)

        def run() -> None:
            try:
                server.run(self._stop.is_set, poll_s=_IDLE_POLL_S)
            except BaseException as exc:  # noqa: BLE001 - reported through wait_dead
                log.exception("AFD FFN server died")
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(settle, f"AFD FFN server died: {exc!r}")

        self._thread = threading.Thread(target=run, name="afd-ffn", daemon=True)
        self._thread.start()
        log.info("AFD FFN serving on NIXL (%d attention workers)", cfg.attention_workers)


class NixlAttentionEngine(AfdAttentionEngine):
    """:class:`AfdAttentionEngine` paired over NIXL through its FFN's etcd record (module
    docstring). ``watcher()`` makes the (unstarted) watcher of the ``worker`` records."""

    def __init__(self, config: AfdEngineConfig, worker_id: str,
                 watcher: Callable[[], InstanceWatcher]) -> None:
        super().__init__(config, worker_id)
        self._make_watcher = watcher
        self._watcher: InstanceWatcher | None = None
        self._ffn_lock = threading.Lock()
        self._ffn_info: bytes | None = None  # the FFN record's info (asyncio side writes)
        # engine thread only:
        self._pending: NixlAfdConnector | None = None  # announced, not yet acknowledged
        self._pending_for: bytes | None = None
        self._refused_for: bytes | None = None
        self._raw: NixlAfdConnector | None = None
        self._paired_for: bytes | None = None

    async def start(self) -> None:
        self._watcher = self._make_watcher()
        self._watcher.on_change(self._records_changed)
        await self._watcher.start()
        try:
            await super().start()
        except BaseException:
            await self._watcher.close()
            raise

    def _records_changed(self, records: dict[str, discovery_pb2.InstanceRecord]) -> None:
        info = ffn_nixl_info(records.get(self.config.ffn_id))
        with self._ffn_lock:
            self._ffn_info = info

    def _ffn_now(self) -> bytes | None:
        with self._ffn_lock:
            return self._ffn_info

    def _drop_pending(self) -> None:
        if self._pending is not None:
            with contextlib.suppress(Exception):
                self._pending.close()
        self._pending = self._pending_for = None

    def _announce_to(self, info: bytes) -> bool:
        """A fresh endpoint, connected to the FFN's ``info`` and announced (pending)."""
        cfg = self.config
        try:
            peer = EndpointInfo.from_bytes(info)
        except ValueError as exc:
            self._refused_for = info
            self._last_error = f"the FFN's {NIXL_INFO_LABEL} label: {exc}"
            log.error("AFD pairing with %s: %s", cfg.ffn_id, self._last_error)
            return False
        if peer.host == socket.gethostname() and pid_gone(peer.pid):
            self._last_error = (f"the FFN's NIXL endpoint (pid {peer.pid}) has exited; "
                                "waiting for a new FFN record")
            return False
        assert self._tcfg is not None
        conn: NixlAfdConnector | None = None
        try:
            conn = NixlAfdConnector("attention", self._tcfg, cfg.attention_id)
            conn.connect(info)
            conn.announce()
        except ValueError as exc:  # sizes differ: not until the FFN's record changes
            self._refused_for = info
            self._last_error = f"the FFN's NIXL endpoint does not fit: {exc}"
            log.error("AFD pairing with %s: %s", cfg.ffn_id, self._last_error)
        except Exception as exc:  # NIXL / transport errors: try again
            self._last_error = f"{type(exc).__name__}: {exc}"
            log.warning("AFD pairing with %s failed: %s", cfg.ffn_id, exc)
            self._stop.wait(0.5)
        else:
            self._pending, self._pending_for = conn, info
            return True
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
        return False

    def _try_pair(self) -> None:
        cfg = self.config
        info = self._ffn_now()
        if self._pending is not None and self._pending_for != info:
            self._drop_pending()  # the FFN restarted (or left) meanwhile
        if info is None:
            self._last_error = (f"no FFN worker {cfg.ffn_id!r} with a NIXL endpoint "
                                f"({NIXL_INFO_LABEL}) in etcd")
            return
        if info == self._refused_for:
            return
        if self._pending is None and not self._announce_to(info):
            return
        pending = self._pending
        assert pending is not None
        try:
            ready = pending.wait_ready(_ACK_WAIT_S)
        except ValueError as exc:
            self._refused_for = info
            self._last_error = str(exc)
            log.error("AFD pairing with %s: %s", cfg.ffn_id, exc)
            self._drop_pending()
            return
        except AfdTransportError as exc:
            self._last_error = f"{type(exc).__name__}: {exc}"
            self._drop_pending()
            return
        if not ready:
            self._last_error = "the FFN worker has not acknowledged this endpoint yet"
            return
        self._pending = self._pending_for = None
        self._raw, self._paired_for = pending, info
        timed = TimedAttentionConnector(pending, self.metrics_collector)
        assert self._core is not None
        self._core.set_executor(SplitExecutor(timed, cfg.attention_id,
                                              recv_timeout=cfg.recv_timeout_s))
        self._counts["pairings"] += 1
        self._set_conn(timed, "")
        log.info("AFD attention %d paired with the FFN %s over NIXL", cfg.attention_id,
                 cfg.ffn_id)

    def _probe(self) -> None:
        super()._probe()
        raw = self._raw
        if self._conn is None or raw is None:
            return
        info = self._ffn_now()
        if info != self._paired_for:
            self._lost("the FFN worker's etcd record " + (
                "is gone" if info is None else "has a new NIXL endpoint (restarted)"))
            return
        try:
            gone = raw.check_peers().get(-1, "no FFN endpoint connected")
        except AfdTransportError as exc:
            gone = f"{type(exc).__name__}: {exc}"
        if gone:
            self._lost(gone)

    async def shutdown(self) -> None:
        await super().shutdown()  # the engine thread is done: its state is ours now
        self._drop_pending()
        if self._watcher is not None:
            await self._watcher.close()
            self._watcher = None


async def wait_first_pairing(cfg: WorkerConfig, engine: Engine) -> None:
    if not isinstance(engine, AfdAttentionEngine):
        return
    if not await engine.wait_paired(cfg.afd_pair_timeout_s):
        last = engine._last_error  # noqa: SLF001 - why the last try failed
        raise RuntimeError(f"no AFD FFN worker {cfg.afd_ffn_id!r} answered at endpoint "
                           f"{engine.config.endpoint!r} ({cfg.afd_transport}) within "
                           f"{cfg.afd_pair_timeout_s} s{': ' + last if last else ''}")


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
