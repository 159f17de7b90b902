"""etcd with mTLS and auth against the real etcd 3.4 (``kvmesh up``'s setup): clients
without a certificate, or with one from another CA, get nothing; worker A cannot put or
delete worker B's key, register under another id, or revoke B's lease (etcd answers
PERMISSION_DENIED) and B's key stays as it was; A registers, keeps its lease alive and
puts its key back after a delete, and a router's watcher sees it; a fleet certificate
``worker:fleet-a`` registers its sub-ids ``fleet-a.0`` and ``fleet-a.1`` (a mock fleet's
workers) but not ``fleet-ax`` nor B's; a real worker's certificate (``worker:prefill-0``,
``worker:a``) registers no sub-id at all (``prefill-0.fake``: PERMISSION_DENIED); the
shared ``worker`` role certificate cannot register; a worker enrolled later (the planner's
path) can."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aetcd
import grpc
import pytest

from protos import discovery_pb2
from services.common import etcd_auth
from services.common.discovery import (
    EtcdPermissionError,
    InstanceWatcher,
    Registration,
    etcd_client,
    instance_key,
)
from services.common.procs import Child, start_etcd
from services.common.tls import MeshTls, channel_options, write_mesh_certs
from tests.waiting import wait_for

NS = "auth"


@dataclass
class SecureEtcd:
    child: Child
    certs: Path

    def tls(self, stem: str) -> MeshTls:
        return MeshTls.load(self.certs, stem)

    @property
    def target(self) -> str:
        host, port, _ = etcd_auth.parse_endpoint(self.child.address)
        return f"{host}:{port}"


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory, log_dir: Path) -> Iterator[SecureEtcd]:
    """An etcd with TLS, client certificates and auth on, provisioned like kvmesh up."""
    work = tmp_path_factory.mktemp("etcd-auth")
    certs = work / "certs"
    write_mesh_certs(certs, ["admin", "etcd", "router", "worker", "worker:a", "worker:b",
                             "worker:fleet-a", "worker:prefill-0"])
    child = start_etcd(work, log_dir, tls_dir=certs)
    try:
        assert child.address.startswith("https://")
        etcd_auth.provision(child.address, MeshTls.load(certs, "admin"), NS,
                            etcd_auth.identities_in(certs))
        yield SecureEtcd(child, certs)
    finally:
        child.stop()


def record(instance_id: str, address: str = "127.0.0.1:1") -> discovery_pb2.InstanceRecord:
    return discovery_pb2.InstanceRecord(instance_id=instance_id, component="worker",
                                        address=address)


def key(instance_id: str) -> bytes:
    return instance_key(NS, record(instance_id)).encode()


async def range_status(channel: grpc.aio.Channel) -> grpc.StatusCode:
    try:
        await aetcd.rpc.KVStub(channel).Range(aetcd.rpc.RangeRequest(key=b"/"), timeout=5)
    except grpc.RpcError as exc:
        return exc.code()
    finally:
        await channel.close()
    return grpc.StatusCode.OK


async def test_no_certificate_and_plaintext_are_refused(secure_etcd: SecureEtcd) -> None:
    no_cert = grpc.aio.secure_channel(
        secure_etcd.target, grpc.ssl_channel_credentials(secure_etcd.tls("admin").ca),
        options=channel_options())
    assert await range_status(no_cert) == grpc.StatusCode.UNAVAILABLE
    assert await range_status(grpc.aio.insecure_channel(secure_etcd.target)) == \
        grpc.StatusCode.UNAVAILABLE
    with pytest.raises(ValueError, match="etcd_endpoint"):
        etcd_client(secure_etcd.child.address, None)


async def test_a_certificate_of_another_ca_is_refused(secure_etcd: SecureEtcd,
                                                      tmp_path: Path) -> None:
    write_mesh_certs(tmp_path, ["admin"])  # a CA of its own
    foreign = MeshTls.load(tmp_path, "admin")
    # It trusts the real CA (so only the client certificate is foreign).
    creds = grpc.ssl_channel_credentials(secure_etcd.tls("admin").ca, foreign.key,
                                         foreign.cert)
    channel = grpc.aio.secure_channel(secure_etcd.target, creds, options=channel_options())
    assert await range_status(channel) == grpc.StatusCode.UNAVAILABLE


async def denied(call: object) -> None:
    with pytest.raises(aetcd.exceptions.ClientError) as info:
        await call  # type: ignore[misc]
    assert etcd_auth.permission_denied(info.value), info.value


async def test_a_worker_cannot_touch_another_workers_key(secure_etcd: SecureEtcd) -> None:
    address = secure_etcd.child.address
    b = Registration(address, NS, record("b", "127.0.0.1:2"), ttl=10, tls=secure_etcd.tls(
        "worker-b"))
    await b.start()
    a = etcd_client(address, secure_etcd.tls("worker-a"))
    try:
        before = await a.get(key("b"))
        assert before is not None
        await denied(a.put(key("b"), record("b", "10.6.6.6:6").SerializeToString()))
        await denied(a.delete(key("b")))
        await denied(a.put(key("fake"), record("fake", "10.6.6.6:6").SerializeToString()))
        assert b.lease_id is not None
        await denied(a.revoke_lease(b.lease_id))
        own = await a.lease(10)
        await denied(a.put(key("a"), b"x", lease=b.lease_id))  # own key, B's lease
        await own.revoke()
        after = await a.get(key("b"))
        assert after is not None
        assert (after.value, after.mod_revision, after.lease) == \
            (before.value, before.mod_revision, before.lease)
        fake = Registration(address, NS, record("fake"), ttl=10,
                            tls=secure_etcd.tls("worker-a"))
        with pytest.raises(EtcdPermissionError, match="worker/fake.*worker/a"):
            await fake.start(startup_timeout_s=5)
        await fake.close()
    finally:
        await a.close()
        await b.close()


async def test_a_fleet_certificate_registers_its_sub_ids_only(
        secure_etcd: SecureEtcd) -> None:
    """``worker:fleet-a`` (a mock fleet's certificate) registers ``fleet-a.0`` and
    ``fleet-a.1``, each under its own lease, and a router sees both; ``fleet-ax`` and
    ``b`` stay out of its reach."""
    address = secure_etcd.child.address
    watcher = InstanceWatcher(address, NS, "worker", tls=secure_etcd.tls("router"))
    await watcher.start()
    subs = {"fleet-a.0", "fleet-a.1"}
    regs = [Registration(address, NS, record(w, f"127.0.0.1:{10 + i}"), ttl=10,
                         tls=secure_etcd.tls("worker-fleet-a"))
            for i, w in enumerate(sorted(subs))]
    try:
        for reg in regs:
            await reg.start()
        await wait_for(lambda: subs <= set(watcher.instances()), 10,
                       lambda: f"the router to see {sorted(subs)} "
                               f"({sorted(watcher.instances())})")
        assert regs[0].lease_id != regs[1].lease_id
        for other in ("fleet-ax", "b", "b.0"):
            reg = Registration(address, NS, record(other), ttl=10,
                               tls=secure_etcd.tls("worker-fleet-a"))
            with pytest.raises(EtcdPermissionError, match=f"worker/{other}.*worker/fleet-a"):
                await reg.start(startup_timeout_s=5)
            await reg.close()
        a = etcd_client(address, secure_etcd.tls("worker-fleet-a"))
        try:
            await denied(a.put(key("fleet-ax"), b"x"))
            await denied(a.delete(key("b.0")))
        finally:
            await a.close()
    finally:
        for reg in regs:
            await reg.close()
        await wait_for(lambda: not subs & set(watcher.instances()), 10, "the revokes to show")
        await watcher.close()


async def test_a_real_workers_certificate_registers_no_sub_id(
        secure_etcd: SecureEtcd) -> None:
    """A compromised real worker (``worker:prefill-0``, ``worker:a``: no fleet
    certificate) cannot add records ``<name>.<x>`` pointing at its own listener (to pull
    KV-aware routing to itself): etcd answers PERMISSION_DENIED, and a router sees none;
    its own key still registers."""
    address = secure_etcd.child.address
    watcher = InstanceWatcher(address, NS, "worker", tls=secure_etcd.tls("router"))
    await watcher.start()
    own = Registration(address, NS, record("prefill-0", "127.0.0.1:20"), ttl=10,
                       tls=secure_etcd.tls("worker-prefill-0"))
    try:
        await own.start()
        await wait_for(lambda: "prefill-0" in watcher.instances(), 10,
                       "the router to see prefill-0")
        for name, fake in (("prefill-0", "prefill-0.fake"), ("prefill-0", "prefill-0.x1"),
                           ("a", "a.0")):
            reg = Registration(address, NS, record(fake, "127.0.0.1:20"), ttl=10,
                               tls=secure_etcd.tls(f"worker-{name}"))
            with pytest.raises(EtcdPermissionError,
                               match=f"worker/{fake} for worker/{name}: permission denied.*"
                                     f"a fleet certificate worker:fleet-<x>"):
                await reg.start(startup_timeout_s=5)
            await reg.close()
            client = etcd_client(address, secure_etcd.tls(f"worker-{name}"))
            try:
                await denied(client.put(key(fake), record(fake).SerializeToString()))
            finally:
                await client.close()
        admin = etcd_client(address, secure_etcd.tls("admin"))
        try:
            for fake in ("prefill-0.fake", "prefill-0.x1", "a.0"):
                assert await admin.get(key(fake)) is None, fake
        finally:
            await admin.close()
        assert not [w for w in watcher.instances() if "." in w and not
                    w.startswith("fleet-")], sorted(watcher.instances())
    finally:
        await own.close()
        await wait_for(lambda: "prefill-0" not in watcher.instances(), 10,
                       "the revoke to show")
        await watcher.close()


async def test_the_shared_worker_certificate_cannot_register(secure_etcd: SecureEtcd) -> None:
    reg = Registration(secure_etcd.child.address, NS, record("worker"), ttl=10,
                       tls=secure_etcd.tls("worker"))
    with pytest.raises(EtcdPermissionError, match="instance certificate worker:worker"):
        await reg.start(startup_timeout_s=5)
    await reg.close()


async def test_own_registration_lives_and_a_router_sees_it(secure_etcd: SecureEtcd) -> None:
    address = secure_etcd.child.address
    watcher = InstanceWatcher(address, NS, "worker", tls=secure_etcd.tls("router"))
    await watcher.start()
    reg = Registration(address, NS, record("a", "127.0.0.1:3"), ttl=2,
                       tls=secure_etcd.tls("worker-a"))
    admin = etcd_client(address, secure_etcd.tls("admin"))
    try:
        await reg.start()
        await wait_for(lambda: "a" in watcher.instances(), 10, "the router to see worker a")
        first = reg.lease_id
        # Keepalives (every ttl/3) hold the 2 s lease for more than a TTL, none failing.
        await wait_for(lambda: reg.keepalives[0] >= 4, 20, "four keepalives")
        assert reg.keepalives[1] == 0
        kv = await admin.get(key("a"))
        assert kv is not None and kv.lease == first == reg.lease_id
        assert "a" in watcher.instances()
        assert await admin.delete(key("a"))  # someone with rights deletes it: A restores it
        await wait_for(lambda: admin.get(key("a")), 10, "worker a to put its key back")
        await wait_for(lambda: "a" in watcher.instances(), 10, "the router to see it again")
    finally:
        await reg.close()
        await wait_for(lambda: "a" not in watcher.instances(), 10, "the revoke to show")
        await admin.close()
        await watcher.close()


async def test_provision_is_idempotent_and_enrolls_new_workers(
        secure_etcd: SecureEtcd, tmp_path: Path) -> None:
    """The planner's path: the worker's certificate and etcd user are made with the
    planner's folder, and the worker, holding only its own folder (no CA key, no admin
    certificate, no events.key nor another role's password), registers its key but not
    another worker's."""
    address = secure_etcd.child.address
    own = tmp_path / "planner-decode-1"
    env = await asyncio.to_thread(etcd_auth.enroll_worker, secure_etcd.certs, address, NS,
                                  "planner-decode-1", own)
    assert env == {"KVMESH_TLS_DIR": str(own), "KVMESH_INSECURE": "0",
                   "KVMESH_TLS_CERT": "worker-planner-decode-1",
                   "KVMESH_WORKER_ID": "planner-decode-1"}
    assert {p.name for p in own.iterdir()} == {
        "ca.pem", "worker-planner-decode-1.pem", "worker-planner-decode-1-key.pem",
        "worker-planner-decode-1.evkey", "redis-worker.pass"}
    again = await asyncio.to_thread(etcd_auth.enroll_worker, secure_etcd.certs, address, NS,
                                    "planner-decode-1", own)
    assert again == env
    tls = MeshTls.load(env["KVMESH_TLS_DIR"], env["KVMESH_TLS_CERT"])
    reg = Registration(address, NS, record("planner-decode-1"), ttl=10, tls=tls)
    try:
        await reg.start()
        admin = etcd_client(address, secure_etcd.tls("admin"))
        try:
            assert await admin.get(key("planner-decode-1")) is not None
        finally:
            await admin.close()
    finally:
        await reg.close()
    other = Registration(address, NS, record("a"), ttl=10, tls=tls)
    with pytest.raises(EtcdPermissionError, match="worker/a.*worker/planner-decode-1"):
        await other.start(startup_timeout_s=5)
    await other.close()
