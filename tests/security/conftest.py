"""One secure mesh for the whole package, started the way ``kvmesh up`` starts it, and the
tools the attack tests share.

Contract:

- :func:`secure` (package scope) runs :class:`services.launcher.up.LocalMesh` with its
  defaults (mTLS with certificates it generates into its state folder, disaggregated: one
  prefill and one decode worker, the remote indexer) on mock workers (``--engine mock``,
  the tiny model's tokenizer), with an API key file of two tenants (alice: ``sk-alice``,
  bob: ``sk-bob``) and ``--metrics-auth``, given to the frontend as ``kvmesh up`` gives
  every flag: its ``KVMESH_*`` variable in the children's environment. ``kvmesh up``
  starts no store master, so one is started beside the mesh, as a child process with the
  mesh's environment (certificates included) and no persistence; a victim store client
  (its own ``store_client-victim`` certificate) mounts a segment there and writes
  :data:`VICTIM_OBJECTS` into it. Instance certificates for the store clients and a whole
  second CA (``rogue``) are written with :func:`services.common.tls.write_mesh_certs`.
- :func:`who` parametrizes an attack over the three attackers of :data:`WHO`; each
  attack is then run by :func:`attack`:

  - ``outsider``: a plaintext channel and a TLS channel that trusts the mesh CA but
    presents no certificate: the handshake fails, so the call ends UNAVAILABLE with a
    transport reason (:func:`assert_handshake_refused`) and no server ever answered;
  - ``wrong role``: a valid mesh certificate of each role the method does not allow:
    PERMISSION_DENIED naming the method and the role;
  - ``another CA``: a certificate of the *allowed* role from another CA (trusting the
    mesh CA): the handshake fails as for an outsider.

- :meth:`SecureMesh.settled` waits until no request is in flight (router and workers) and
  the index matches every worker's own KV state, then takes a :class:`Snapshot`: routing
  (ListWorkers as admin; the router's in-flight, unroutable and failure-report metrics),
  the workers' loads and counters (GetLoad as planner), the index (Dump and Stats as
  admin) and the store (Stats as admin: objects, segments, capacity, leases granted,
  removals) and etcd's worker records (key → record bytes and lease, read as admin).
  Tests compare it with :meth:`SecureMesh.snapshot` after an attack: "nothing
  changed". :meth:`SecureMesh.victim_objects` (after the last snapshot: it takes leases)
  checks the victim's objects are all still there.
- etcd and Redis as an attacker reaches them: :attr:`SecureMesh.etcd_target` (host:port
  of the https etcd), :attr:`SecureMesh.redis_url` (``rediss://``),
  :meth:`SecureMesh.redis` (a client logged in as a certificate's role, as the mesh's
  services log in); :meth:`SecureMesh.restart` kills a child by PID and has the
  launcher's supervisor restart it (``kvmesh up`` calls ``supervise()`` every 0.2 s; the
  tests call it while they wait), then re-reads :attr:`SecureMesh.records`.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import redis.asyncio as aioredis
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import (
    discovery_pb2,
    indexer_pb2,
    indexer_pb2_grpc,
    kv_events_pb2,
    router_pb2,
    router_pb2_grpc,
    store_pb2,
    store_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.discovery import etcd_client, instances_prefix, read_instance_records
from services.common.grpc_client import channel, sync_channel
from services.common.procs import Child, free_port, spawn
from services.common.redis_conn import redis_client
from services.common.tls import ROLES, MeshTls, channel_options, write_mesh_certs
from services.launcher.up import LocalMesh, MeshSpec
from tests.waiting import wait_for, wait_for_sync

MODEL = "tiny-llama"
BLOCK = MeshSpec().block_size
KEYS = "# two tenants, as kvmesh up --api-key-file reads them\nsk-alice alice\nsk-bob bob\n"
ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}
VICTIM = "store_client-victim"  # the certificate stem of the store client that is attacked
VICTIM_CLIENT, VICTIM_SEGMENT = "victim", "victim-seg"
VICTIM_OBJECTS = tuple(f"victim-obj-{i}" for i in range(3))
WHO = ("outsider", "wrong role", "another CA")
TIMEOUT_S = 5.0
# gRPC's words for a channel that never became ready (so no call was ever sent) ...
NEVER_CONNECTED = "failed to connect to all addresses"
# ... because the TLS handshake (or a plaintext hello to a TLS server) failed: with TLS 1.3
# the server's refusal of the client certificate reaches the client as a closed socket
# (a gRPC server), or as a bad_certificate alert it cannot decrypt (etcd, Go's TLS:
# "Unwrap failed (TSI_DATA_CORRUPTED)").
HANDSHAKE_REASONS = ("socket closed", "ssl", "handshake", "tls", "connection reset",
                     "tsi_data_corrupted")


@dataclass(frozen=True)
class Snapshot:
    """What an attack must not change (module docstring)."""

    routing: dict[str, Any]
    loads: dict[str, Any]
    index: dict[str, Any]
    store: dict[str, Any]
    etcd: dict[str, tuple[bytes, int]]


@dataclass
class SecureMesh:
    """The running mesh and how to reach its parts."""

    launcher: LocalMesh
    url: str
    certs: Path
    rogue: Path
    records: dict[str, list[discovery_pb2.InstanceRecord]]
    store: Child
    store_address: str

    def tls(self, stem: str) -> MeshTls:
        """The mesh's certificate ``<stem>.pem`` (a role, or ``role-name``)."""
        return MeshTls.load(self.certs, stem)

    def foreign(self, role: str) -> MeshTls:
        """A ``role`` certificate of another CA, presented by a client trusting the mesh
        CA (so the only thing wrong is who signed it)."""
        rogue = MeshTls.load(self.rogue, role)
        return MeshTls(self.tls(role).ca, rogue.cert, rogue.key, rogue.identity)

    def address(self, component: str) -> str:
        (rec,) = self.records[component]
        return rec.address

    def worker(self, role: int) -> discovery_pb2.InstanceRecord:
        (rec,) = [r for r in self.records["worker"] if r.role == role]
        return rec

    @property
    def prefill(self) -> discovery_pb2.InstanceRecord:
        return self.worker(discovery_pb2.WORKER_ROLE_PREFILL)

    @property
    def decode(self) -> discovery_pb2.InstanceRecord:
        return self.worker(discovery_pb2.WORKER_ROLE_DECODE)

    async def router_metrics(self) -> dict[str, float]:
        """The router's unlabelled /metrics samples."""
        (rec,) = self.records["router"]
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
            resp = await client.get(f"http://{rec.metrics_address}/metrics")
        assert resp.status_code == 200, resp.text
        out = {}
        for line in resp.text.splitlines():
            name, _, value = line.partition(" ")
            if name and not name.startswith("#") and "{" not in name:
                out[name] = float(value)
        return out

    async def snapshot(self) -> Snapshot:
        """Routing, worker loads, index and store as allowed roles see them now."""
        metrics = await self.router_metrics()
        async with channel(self.address("router"), self.tls("admin")) as ch:
            listed = await router_pb2_grpc.RouterStub(ch).ListWorkers(
                router_pb2.ListWorkersRequest(), timeout=TIMEOUT_S)
        routing = {"workers": sorted((w.instance_id, w.address) for w in listed.workers),
                   **{k: metrics[k] for k in ("kvmesh_router_inflight_requests",
                                              "kvmesh_router_unroutable_workers",
                                              "kvmesh_router_failure_reports_total")}}
        loads = {}
        for rec in self.records["worker"]:
            async with channel(rec.address, self.tls("planner")) as ch:
                loads[rec.instance_id] = MessageToDict(await worker_pb2_grpc.WorkerStub(
                    ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=TIMEOUT_S))
        async with channel(self.address("indexer"), self.tls("admin")) as ch:
            stub = indexer_pb2_grpc.IndexerStub(ch)
            dump = await stub.Dump(indexer_pb2.DumpRequest(), timeout=TIMEOUT_S)
            stats = await stub.Stats(indexer_pb2.StatsRequest(), timeout=TIMEOUT_S)
        index = {"stats": MessageToDict(stats),
                 **{s.worker_id: (s.event_id, blocks(s)) for s in dump.workers}}
        async with channel(self.store_address, self.tls("admin")) as ch:
            store = MessageToDict(await store_pb2_grpc.StoreMasterStub(ch).Stats(
                store_pb2.StatsRequest(), timeout=TIMEOUT_S))
        return Snapshot(routing, loads, index, store, await self.etcd_workers())

    async def etcd_workers(self) -> dict[str, tuple[bytes, int]]:
        """etcd's worker records as the admin reads them: key → (value, lease id)."""
        client = etcd_client(self.launcher_etcd, self.tls("admin"))
        await client.connect()
        try:
            kvs = await client.get_prefix(instances_prefix(self.namespace, "worker").encode())
        finally:
            await client.close()
        return {kv.key.decode(): (kv.value, kv.lease) for kv in kvs}

    @property
    def launcher_etcd(self) -> str:
        """The mesh's etcd endpoint (``https://host:port``)."""
        assert self.launcher.etcd is not None
        return self.launcher.etcd.address

    @property
    def etcd_target(self) -> str:
        """host:port of the mesh's etcd (a gRPC target)."""
        return self.launcher_etcd.removeprefix("https://")

    @property
    def namespace(self) -> str:
        return self.launcher.spec.namespace

    @property
    def redis_url(self) -> str:
        """The ``rediss://`` URL the mesh's services get."""
        assert self.launcher.redis is not None
        return f"rediss://{self.launcher.redis.address}"

    def redis(self, stem: str) -> aioredis.Redis:
        """A Redis client logged in as the ACL user of certificate ``stem``'s role."""
        return redis_client(self.redis_url, self.tls(stem))

    async def restart(self, name: str, component: str) -> None:
        """SIGKILLs child ``name`` (by its PID), has the supervisor restart it, waits
        until etcd holds exactly the records of :data:`REGISTERED` again, ``component``'s
        from the new process (its instance id or start time changed: the old record stays
        until its lease expires), and re-reads :attr:`records`."""
        old = self.launcher.child(name)
        os.kill(old.pid, signal.SIGKILL)
        old.proc.wait(timeout=TIMEOUT_S)

        def restarted() -> bool:
            self.launcher.supervise()
            return self.launcher.child(name).pid != old.pid
        wait_for_sync(restarted, 30, lambda: f"{name} to be restarted", interval_s=0.1)
        before = {k: [r.instance_id for r in v] for k, v in self.records.items()}

        def incarnations(recs: list[discovery_pb2.InstanceRecord]) -> set[tuple[str, int]]:
            return {(r.instance_id, r.started_at_ms) for r in recs}
        old_records = incarnations(self.records[component])

        async def registered() -> bool:
            self.launcher.supervise()  # as `kvmesh up` does meanwhile
            records = await instance_records(self.launcher_etcd, self.namespace,
                                             self.tls("admin"))
            if not all(len(records.get(k, ())) == n for k, n in REGISTERED.items()):
                return False
            if incarnations(records[component]) & old_records:
                return False
            self.records.clear()
            self.records.update(records)
            return True
        await wait_for(registered, 30, lambda: f"{REGISTERED} in etcd after restarting "
                       f"{name}; before: {before}, now {self.records}")

    async def victim_objects(self) -> dict[str, bool]:
        """Whether each of :data:`VICTIM_OBJECTS` exists, asked by the victim (this grants
        read leases, counted in the store's Stats: call it after the last snapshot)."""
        async with channel(self.store_address, self.tls(VICTIM)) as ch:
            held = await store_pb2_grpc.StoreMasterStub(ch).BatchExistKey(
                store_pb2.BatchExistKeyRequest(keys=VICTIM_OBJECTS), timeout=TIMEOUT_S)
        return dict(zip(VICTIM_OBJECTS, held.exists, strict=True))

    async def unsettled(self) -> dict[str, object]:
        """What is still moving: requests in flight on the router or a worker, workers
        whose blocks in the index differ from their own GetKvState. Empty when settled."""
        out: dict[str, object] = {}
        inflight = (await self.router_metrics())["kvmesh_router_inflight_requests"]
        if inflight:
            out["router in flight"] = inflight
        async with channel(self.address("indexer"), self.tls("admin")) as ch:
            dump = await indexer_pb2_grpc.IndexerStub(ch).Dump(indexer_pb2.DumpRequest(),
                                                               timeout=TIMEOUT_S)
        indexed = {s.worker_id: blocks(s) for s in dump.workers}
        for rec in self.records["worker"]:
            async with channel(rec.address, self.tls("router")) as ch:
                stub = worker_pb2_grpc.WorkerStub(ch)
                load = await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=TIMEOUT_S)
                state = await stub.GetKvState(kv_events_pb2.KvStateRequest(),
                                              timeout=TIMEOUT_S)
            if load.active_requests or load.num_running or load.num_waiting:
                out[rec.instance_id] = (load.active_requests, load.num_running,
                                        load.num_waiting)
            if blocks(state) != indexed.get(rec.instance_id, frozenset()):
                out[f"{rec.instance_id} index"] = "differs from its GetKvState"
        return out

    async def settled(self) -> Snapshot:
        """Waits until :meth:`unsettled` is empty, then snapshots."""
        last: dict[str, object] = {}

        async def calm() -> bool:
            nonlocal last
            last = await self.unsettled()
            return not last
        await wait_for(calm, 30, lambda: f"the mesh to settle; still {last}", interval_s=0.1)
        return await self.snapshot()


def blocks(state: kv_events_pb2.KvState) -> frozenset[tuple[str, int]]:
    """A worker's (tier, block hash) pairs."""
    return frozenset((t.tier, h) for t in state.tiers for h in t.block_hashes)


async def instance_records(etcd: str, namespace: str, tls: MeshTls) -> dict[str, list[
        discovery_pb2.InstanceRecord]]:
    """Every instance record in etcd, by component (read with the admin certificate: etcd
    is mTLS with auth in a default mesh)."""
    out: dict[str, list[discovery_pb2.InstanceRecord]] = {}
    for rec in await read_instance_records(etcd, namespace, "", tls):
        out.setdefault(rec.component, []).append(rec)
    return out


def start_store_master(launcher: LocalMesh) -> tuple[Child, str]:
    """A store master beside the mesh, with its environment (certificates, etcd); no
    persistence, and a client TTL longer than the tests, so the victim need not ping."""
    port = free_port()
    argv = [sys.executable, "-m", "services.store_master", "--port", str(port),
            "--persist", "none", "--client-ttl-s", "3600"]
    child = spawn("store_master", argv, launcher.spec.log_dir, launcher.child_env("store_master"))
    address = f"127.0.0.1:{port}"

    def serving() -> bool:
        assert child.alive(), child.log_tail()
        try:
            with sync_channel(address, MeshTls.load(launcher.tls_dir or "", "admin")) as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                            timeout=1)
        except grpc.RpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
    try:
        wait_for_sync(serving, 60, lambda: f"the store master to serve; {child.log_tail()}",
                      interval_s=0.1)
    except BaseException:
        child.stop()
        raise
    return child, address


def seed_victim(address: str, certs: Path) -> None:
    """The victim store client mounts its segment and writes :data:`VICTIM_OBJECTS`."""
    with sync_channel(address, MeshTls.load(certs, VICTIM)) as ch:
        stub = store_pb2_grpc.StoreMasterStub(ch)
        stub.MountSegment(store_pb2.MountSegmentRequest(
            client_id=VICTIM_CLIENT, segment_id=VICTIM_SEGMENT, base=1 << 20, size=64 << 20,
            endpoint="nixl:victim"), timeout=TIMEOUT_S)
        for key in VICTIM_OBJECTS:
            put = stub.PutStart(store_pb2.PutStartRequest(key=key, size=1 << 16, replicas=1),
                                timeout=TIMEOUT_S)
            assert [r.segment_id for r in put.replicas] == [VICTIM_SEGMENT], put
            stub.PutEnd(store_pb2.KeyRequest(key=key), timeout=TIMEOUT_S)


REGISTERED = {"frontend": 1, "router": 1, "indexer": 1, "worker": 2, "store_master": 1}


@pytest.fixture(scope="package")
async def secure(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SecureMesh]:
    work = tmp_path_factory.mktemp("secure")
    keys = work / "api-keys"
    keys.write_text(KEYS)
    rogue = work / "rogue"
    write_mesh_certs(rogue, ROLES)  # a CA of its own
    launcher = LocalMesh(MeshSpec(model="tiny", engine="mock", http_port=0,
                                  log_dir=work / "logs"))
    with pytest.MonkeyPatch.context() as env:  # what `kvmesh up` passes to the frontend
        env.setenv("KVMESH_API_KEY_FILE", str(keys))
        env.setenv("KVMESH_METRICS_AUTH", "1")
        url = launcher.start()  # blocks until the frontend serves; nothing else runs yet
    store: Child | None = None
    try:
        assert launcher.tls_dir is not None and launcher.etcd is not None
        certs = launcher.tls_dir
        write_mesh_certs(certs, [VICTIM.replace("-", ":", 1), "store_client:intruder",
                                 "worker:intruder"])
        store, store_address = start_store_master(launcher)
        seed_victim(store_address, certs)
        etcd, namespace = launcher.etcd.address, launcher.spec.namespace
        records: dict[str, list[discovery_pb2.InstanceRecord]] = {}

        async def registered() -> bool:
            nonlocal records
            records = await instance_records(etcd, namespace, MeshTls.load(certs, "admin"))
            return all(len(records.get(k, ())) == n for k, n in REGISTERED.items())
        await wait_for(registered, 30, lambda: f"{REGISTERED} in etcd, got {records}")
        yield SecureMesh(launcher, url, certs, rogue, records, store, store_address)
    finally:
        if store is not None:
            store.stop()
        launcher.stop()


@pytest.fixture(params=WHO)
def who(request: pytest.FixtureRequest) -> str:
    """The attacker: see :data:`WHO` and the module docstring."""
    return str(request.param)


Call = Callable[[grpc.aio.Channel], Awaitable[object]]


async def refused(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    """The error ``call`` fails with (the test fails if it succeeds)."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


def assert_handshake_refused(err: grpc.aio.AioRpcError, what: str) -> None:
    """No server answered: the channel never connected (UNAVAILABLE, "failed to connect"),
    for a TLS reason, so no call reached a servicer or interceptor."""
    details = (err.details() or "").lower()
    assert err.code() == grpc.StatusCode.UNAVAILABLE, (what, err.code(), err.details())
    assert NEVER_CONNECTED in details, (what, err.details())
    assert any(r in details for r in HANDSHAKE_REASONS), (what, err.details())


def outsider_channels(address: str, mesh_ca: bytes) -> dict[str, grpc.aio.Channel]:
    """Channels of callers holding no mesh certificate."""
    return {
        "plaintext": grpc.aio.insecure_channel(address),
        "TLS without a client certificate": grpc.aio.secure_channel(
            address, grpc.ssl_channel_credentials(root_certificates=mesh_ca),
            options=channel_options()),
    }


async def attack(mesh: SecureMesh, who: str, address: str, method: str, call: Call,
                 allowed: str, wrong_roles: tuple[str, ...]) -> list[grpc.aio.AioRpcError]:
    """Runs ``call`` (gRPC ``method`` on ``address``) as ``who`` and asserts it is refused
    as the module docstring says; ``allowed`` is a role the method allows (the foreign
    certificate's), ``wrong_roles`` the insiders to try. Returns the errors."""
    errors = []
    if who == "outsider":
        for what, ch in outsider_channels(address, mesh.tls(allowed).ca).items():
            async with ch:
                err = await refused(call(ch))
            assert_handshake_refused(err, what)
            errors.append(err)
    elif who == "another CA":
        async with channel(address, mesh.foreign(allowed)) as ch:
            err = await refused(call(ch))
        assert_handshake_refused(err, f"a {allowed} certificate of another CA")
        errors.append(err)
    else:
        assert who == "wrong role", who
        assert wrong_roles and allowed not in wrong_roles
        for role in wrong_roles:
            async with channel(address, mesh.tls(role)) as ch:
                err = await refused(call(ch))
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED, (role, err)
            details = err.details() or ""
            assert method in details and f"role {role.split('-')[0]!r}" in details, (
                role, details)
            errors.append(err)
    return errors


def roles_except(*allowed: str) -> tuple[str, ...]:
    """The kvmesh roles (not etcd's or Redis's server certificates) other than
    ``allowed``."""
    return tuple(r for r in ROLES if r not in (*allowed, "etcd", "redis"))


async def drain(stream: Any) -> list[Any]:
    """Every message of a server stream."""
    return [m async for m in stream]

