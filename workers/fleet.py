"""Many mock workers in one process: ``python -m workers.fleet --workers 32 ...``.

Each worker is a whole kvmesh worker as far as the mesh can tell: its own
:class:`~workers.engines.mock.MockEngine`, its own Worker gRPC server on its own port,
its own etcd registration and lease, its own worker id, and (with ``--redis-url`` and
KV events on) its own :class:`~workers.kv.event_relay.KvEventRelay` fed in-process
(``start(zmq_input=False)``; the engine's event sink is ``relay.submit``). They share
one event loop, which is what lets ≥ 32 workers run on a 2-core machine.

Contract:

- :class:`FleetConfig` is a :class:`~workers.config.WorkerConfig` (every flag has a
  ``KVMESH_*`` env var) plus the fleet's own fields: ``workers`` aggregated,
  ``prefill_workers`` and ``decode_workers`` (P/D workers get the simulated ``mock``
  handoff), and the mock engine's knobs (``num_blocks``, ``max_num_batched_tokens``,
  ``timing``, ``speedup_ratio``, ``vocab_size``, ``kv_bytes_per_block``,
  ``transfer_bandwidth``). Shared WorkerConfig fields (block size, context length,
  max_num_seqs, seed, namespace, etcd, Redis, lease, grace) apply to every worker.
  ``worker_id`` is a prefix (default ``mock-<random>-``): worker *i* is
  ``<prefix><role letter><i>`` (``a``/``p``/``d``). With TLS (``tls_dir``, not
  ``insecure``) the fleet needs a *fleet certificate* ``worker:<name>`` with ``<name>``
  ``fleet`` or ``fleet-<x>`` (``tls_cert`` ``worker-<name>``; the only worker instance
  certificates that have sub-ids, :func:`services.common.worker_ids.has_sub_ids`):
  every worker is a sub-id of it, worker *i* is ``<name>.<worker_id><role letter><i>``
  (``worker_id`` default "" here: ``<name>.a0``, ``<name>.a1``, ...), each registers in
  etcd under its own id (the certificate's etcd user may write its sub-ids) and signs
  its KV events with the certificate's event key, naming the certificate as their
  signer, which an indexer accepts for sub-ids of that name. The shared ``worker``
  certificate, another role's, or a worker instance certificate that is no fleet
  certificate (``worker:decode-0`` acts only as ``decode-0``) is a config error naming
  ``tls_cert`` and saying to issue ``worker:fleet-<x>``, and a ``worker_id`` that makes
  ids the certificate may not act as (a ``.`` in it) one naming ``worker_id``.
  :func:`fleet_prefix` is the prefix in force. ``port`` 0 gives every worker a free
  port; otherwise worker *i* listens on ``port + i``. ``metrics_port`` -1 (default here)
  means no Prometheus endpoints; 0 one free port each; otherwise ``metrics_port + i``;
  ``request_plane_port`` likewise (default 0: a free one each; -1: none).
  ``model_path`` is optional (published for the frontend's tokenizer; ``tiny`` and
  ``smollm2`` resolve as for a worker); ``model_name`` defaults to its folder name, else
  ``mock``.
- ``start_fleet(cfg) -> Fleet`` starts every worker (a few at a time) and returns once
  all are registered; on failure it stops those already started and raises.
- ``Fleet.workers``: one :class:`FleetWorker` per worker (id, role, engine, relay,
  server); ``Fleet.stop()`` stops them all (each: NOT_SERVING, lease revoked, engine
  and relay closed). Idempotent.
- ``main(argv)``: runs a fleet until SIGTERM/SIGINT; exit code 2 on a bad config.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from protos import discovery_pb2
from services.common.config import BaseConfig
from services.common.event_bus import stream_name
from services.common.server import MeshServer, serve_main
from services.common.tls import CertError, tls_for
from services.common.worker_ids import SEPARATOR, SHARED_NAME, has_sub_ids, sub_id
from workers.config import WorkerConfig, kv_event_problems
from workers.engines.mock import MockEngine, MockEngineConfig
from workers.engines.mock.timing import make_timing
from workers.kv.event_relay import EventEndpoints, KvEventRelay
from workers.main import build_server, resolve_model_path

log = logging.getLogger(__name__)

ROLE_LETTER = {"agg": "a", "prefill": "p", "decode": "d"}
START_CONCURRENCY = 8


@dataclasses.dataclass
class FleetConfig(WorkerConfig):
    """kvmesh mock fleet: many simulated workers in one process."""

    engine: str = dataclasses.field(default="mock", metadata={"help": "engine kind (mock)"})
    metrics_port: int = dataclasses.field(
        default=-1, metadata={"help": "Prometheus port of worker 0, +i for worker i "
                                      "(0 = any free each, -1 = off)"})
    workers: int = dataclasses.field(default=8, metadata={"help": "aggregated workers"})
    prefill_workers: int = dataclasses.field(default=0, metadata={"help": "prefill workers"})
    decode_workers: int = dataclasses.field(default=0, metadata={"help": "decode workers"})
    num_blocks: int = dataclasses.field(
        default=4096, metadata={"help": "KV blocks per mock engine"})
    max_num_batched_tokens: int = dataclasses.field(
        default=8192, metadata={"help": "token budget per engine step"})
    timing: str = dataclasses.field(
        default="poly", metadata={"help": "step timing: poly | zero | table | table:PATH"})
    speedup_ratio: float = dataclasses.field(
        default=1.0, metadata={"help": "simulated time runs this many times faster"})
    vocab_size: int = dataclasses.field(
        default=0, metadata={"help": "token ids in [0, vocab) (0: model's, else 32000)"})
    kv_bytes_per_block: int = dataclasses.field(
        default=4 << 20, metadata={"help": "simulated bytes of one KV block (P→D transfer)"})
    transfer_bandwidth: float = dataclasses.field(
        default=25e9, metadata={"help": "simulated P→D bandwidth in bytes/s"})

    def problems(self) -> list[str]:
        out = BaseConfig.problems(self)
        if self.engine != "mock":
            out.append(f"a fleet runs mock engines only, got engine {self.engine!r}")
        counts = (self.workers, self.prefill_workers, self.decode_workers)
        if min(counts) < 0 or sum(counts) < 1:
            out.append("worker counts must be >= 0 with at least one worker")
        if (self.prefill_workers > 0) != (self.decode_workers > 0):
            out.append("prefill and decode workers come together (both > 0 or both 0)")
        if self.block_size < 1:
            out.append("block_size must be >= 1")
        if self.max_model_len < 2:
            out.append("max_model_len must be >= 2")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.num_blocks < 1:
            out.append("max_num_seqs, max_num_batched_tokens and num_blocks must be >= 1")
        if not self.speedup_ratio > 0:
            out.append("speedup_ratio must be > 0")
        if self.vocab_size < 0 or self.kv_bytes_per_block < 0:
            out.append("vocab_size and kv_bytes_per_block must be >= 0")
        if not self.transfer_bandwidth > 0:
            out.append("transfer_bandwidth must be > 0")
        if not -1 <= self.metrics_port <= 65535:
            out.append(f"metrics_port out of range: {self.metrics_port}")
        total = sum(counts)
        if self.port and self.port + total - 1 > 65535:
            out.append("port + number of workers exceeds 65535")
        if self.request_plane_port > 0 and self.request_plane_port + total - 1 > 65535:
            out.append("request_plane_port + number of workers exceeds 65535")
        out += kv_event_problems(self)
        try:
            make_timing(self.timing)
        except (ValueError, OSError) as exc:
            out.append(f"timing: {exc}")
        out.extend(self.identity_problems())
        return out

    def certificate_name(self) -> str:
        """The instance name of the fleet's certificate; "" without TLS. CertError (naming
        ``tls_cert``) for the shared ``worker`` certificate, another role's, or a worker
        instance certificate that is no fleet certificate (module docstring)."""
        ident = self.certificate_identity()
        if ident is None:
            return ""
        issue = ("issue a fleet certificate worker:fleet-<x> (tls_cert worker-fleet-<x>, "
                 "e.g. `kvmesh certs --roles worker:fleet-a`)")
        if ident.role != "worker" or ident.name == SHARED_NAME:
            raise CertError(
                f"tls_cert {self.tls_cert or 'worker'!r} is {ident}: a fleet under TLS "
                f"needs a worker instance certificate of its own; {issue}: its workers "
                f"register and sign their KV events as fleet-<x>.<i>, which the shared "
                f"worker certificate may not")
        if not has_sub_ids(ident.name):
            raise CertError(
                f"tls_cert {self.tls_cert!r} is {ident}, no fleet certificate: it acts "
                f"only as {ident.name!r}, with no sub-ids for a fleet's workers; {issue}")
        return ident.name

    def identity_problems(self) -> list[str]:
        """The TLS certificate and worker id rules of the module docstring."""
        try:
            name = self.certificate_name()
        except CertError as exc:
            text = str(exc)
            return [text if text.startswith("tls_cert") else f"tls_cert: {text}"]
        if not name:
            return []
        try:
            sub_id(name, f"{self.worker_id}{ROLE_LETTER['agg']}0")
        except ValueError as exc:
            return [f"worker_id {self.worker_id!r}: under tls_cert {self.tls_cert!r} the "
                    f"fleet's ids are {name}{SEPARATOR}<worker_id><role letter><i>, a "
                    f"sub-id of the certificate's name, so worker_id is letters, digits, "
                    f"'-' or '_' ({exc})"]
        return []

    def roles(self) -> list[str]:
        """One role per worker, in start order."""
        return (["agg"] * self.workers + ["prefill"] * self.prefill_workers
                + ["decode"] * self.decode_workers)

    def engine_config(self, role: str, model_path: str, model_name: str) -> MockEngineConfig:
        """The mock engine of one worker with ``role``."""
        return MockEngineConfig(
            model_name=model_name, model_path=model_path, num_blocks=self.num_blocks,
            block_size=self.block_size, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, timing=self.timing,
            speedup_ratio=self.speedup_ratio, seed=self.seed, vocab_size=self.vocab_size,
            kv_bytes_per_block=self.kv_bytes_per_block,
            transfer_bandwidth=self.transfer_bandwidth,
            handoff="" if role == "agg" else "mock")


@dataclasses.dataclass
class FleetWorker:
    """One started worker of a fleet."""

    worker_id: str
    role: str
    engine: MockEngine
    relay: KvEventRelay | None
    server: MeshServer

    @property
    def address(self) -> str:
        return self.server.address


@dataclasses.dataclass
class Fleet:
    """Started workers; see the module docstring."""

    cfg: FleetConfig
    workers: list[FleetWorker]
    _stopped: bool = False

    def by_role(self, role: str) -> list[FleetWorker]:
        return [w for w in self.workers if w.role == role]

    async def stop(self) -> None:
        """Stops every worker (concurrently). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        await asyncio.gather(*(w.server.stop() for w in self.workers),
                             return_exceptions=True)


def _no_endpoints() -> EventEndpoints:
    """Placeholder endpoints for a relay fed by ``submit`` (never connected)."""
    return EventEndpoints(Path("/nonexistent-kvmesh-fleet"), "", "")


def fleet_prefix(cfg: FleetConfig) -> str:
    """The worker id prefix in force (module docstring): ``<name>.<worker_id>`` under a
    fleet certificate ``worker:<name>``, else ``worker_id`` or a fresh random one."""
    name = cfg.certificate_name()
    if name:
        return f"{name}{SEPARATOR}{cfg.worker_id}"
    return cfg.worker_id or f"mock-{uuid.uuid4().hex[:8]}-"


def worker_config(cfg: FleetConfig, index: int, role: str, prefix: str) -> FleetConfig:
    """The config of worker ``index``: own id, role, ports."""
    def nth(port: int) -> int:
        return port + index if port > 0 else port

    return dataclasses.replace(
        cfg, worker_id=f"{prefix}{ROLE_LETTER[role]}{index}", role=role, port=nth(cfg.port),
        metrics_port=nth(cfg.metrics_port),
        request_plane_port=nth(cfg.request_plane_port), handoff="")


async def _start_one(wcfg: FleetConfig, model_path: str, model_name: str,
                     index: int) -> FleetWorker:
    worker_id = wcfg.resolved_worker_id()
    relay: KvEventRelay | None = None
    engine = MockEngine(wcfg.engine_config(wcfg.role, model_path, model_name))
    if wcfg.publishes_kv_events():
        relay = KvEventRelay(worker_id, wcfg.block_size, wcfg.redis_url,
                             stream_name(wcfg.namespace), _no_endpoints(),
                             reset_cache=engine.reset_prefix_cache,
                             maxlen=wcfg.kv_events_maxlen, tls=tls_for(wcfg, "worker"),
                             flush_delay_s=wcfg.kv_event_flush_ms / 1000)
    try:
        if relay is not None:
            await relay.start(zmq_input=False)
            engine.set_event_sink(relay.submit)
        await engine.start()
        server = build_server(wcfg, engine, relay)
        factory = server.record_factory
        assert factory is not None

        def record(address: str) -> discovery_pb2.InstanceRecord:
            rec = factory(address)
            rec.labels["fleet_index"] = str(index)
            return rec

        server.record_factory = record
        await server.start()
    except BaseException:
        if relay is not None:
            await relay.close()
        await engine.shutdown()
        raise
    return FleetWorker(worker_id, wcfg.role, engine, relay, server)


async def start_fleet(cfg: FleetConfig) -> Fleet:
    """Starts every worker of ``cfg``; see the module docstring."""
    cfg.validate()
    model_path = resolve_model_path(cfg.model_path) if cfg.model_path else ""
    model_name = cfg.model_name or (Path(model_path).name if model_path else "mock")
    prefix = fleet_prefix(cfg)
    gate = asyncio.Semaphore(START_CONCURRENCY)

    async def one(i: int, role: str) -> FleetWorker:
        async with gate:
            return await _start_one(worker_config(cfg, i, role, prefix), model_path,
                                    model_name, i)

    results = await asyncio.gather(*(one(i, r) for i, r in enumerate(cfg.roles())),
                                   return_exceptions=True)
    started = [r for r in results if isinstance(r, FleetWorker)]
    errors = [r for r in results if isinstance(r, BaseException)]
    fleet = Fleet(cfg, started)
    if errors:
        await fleet.stop()
        raise errors[0]
    log.info("fleet of %d mock workers serving (%s)", len(started),
             ", ".join(f"{r}={len(fleet.by_role(r))}" for r in ROLE_LETTER
                       if fleet.by_role(r)))
    return fleet


def main(argv: Sequence[str] | None = None) -> int:
    return serve_main(FleetConfig, argv, "fleet", start_fleet)


if __name__ == "__main__":
    sys.exit(main())
