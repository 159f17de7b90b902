"""Damaging the store: ``Remove`` / ``RemoveAll`` by anyone but an admin; unmounting the
victim store client's segment (by a role that mounts none, and by other store clients and
workers: only the identity that mounted it may); mounting a fake 1 PiB segment by a role
that contributes no memory, or a takeover of the victim's segment id by another store
client; holding read leases (``GetReplicaList``, ``ExistKey`` and their
batches) by a role that reads no KV. Each is refused, and the store's objects, segments,
capacity and counters are unchanged (Stats as admin), and the victim's objects are all
there; no refused read left a lease (Stats counts none granted, and an admin removes the
object at once, which a lease would prevent: the control test shows)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest

from protos import store_pb2, store_pb2_grpc
from services.common.grpc_client import channel
from tests.security.conftest import (
    TIMEOUT_S,
    VICTIM,
    VICTIM_CLIENT,
    VICTIM_OBJECTS,
    VICTIM_SEGMENT,
    SecureMesh,
    attack,
    refused,
    roles_except,
)

SVC = "/kvmesh.store.StoreMaster/"
STORE_ROLES = ("worker", "store_client")
# valid data-role identities that are not the victim
OTHER_STORE_CLIENTS = ("store_client-intruder", "worker-intruder", "store_client", "worker",
                       "worker-decode-0")
KEY = store_pb2.KeyRequest(key=VICTIM_OBJECTS[0])


def stub(ch: grpc.aio.Channel) -> store_pb2_grpc.StoreMasterStub:
    return store_pb2_grpc.StoreMasterStub(ch)


async def put(mesh: SecureMesh, key: str) -> None:
    """The victim writes one small object."""
    async with channel(mesh.store_address, mesh.tls(VICTIM)) as ch:
        await stub(ch).PutStart(store_pb2.PutStartRequest(key=key, size=4096, replicas=1),
                                timeout=TIMEOUT_S)
        await stub(ch).PutEnd(store_pb2.KeyRequest(key=key), timeout=TIMEOUT_S)


async def admin_remove(mesh: SecureMesh, key: str) -> None:
    async with channel(mesh.store_address, mesh.tls("admin")) as ch:
        await stub(ch).Remove(store_pb2.KeyRequest(key=key), timeout=TIMEOUT_S)


@pytest.mark.parametrize("method, call", [
    ("Remove", lambda ch: stub(ch).Remove(KEY, timeout=TIMEOUT_S)),
    ("RemoveAll", lambda ch: stub(ch).RemoveAll(store_pb2.RemoveAllRequest(),
                                                timeout=TIMEOUT_S)),
])
async def test_remove_by_a_non_admin_is_refused(secure: SecureMesh, who: str, method: str,
                                                call: Callable[[grpc.aio.Channel], Any]) -> None:
    before = await secure.settled()
    await attack(secure, who, secure.store_address, SVC + method, call, allowed="admin",
                 wrong_roles=roles_except("admin"))
    assert await secure.snapshot() == before
    assert all((await secure.victim_objects()).values())


async def test_unmount_of_another_clients_segment_is_refused(secure: SecureMesh,
                                                             who: str) -> None:
    before = await secure.settled()
    request = store_pb2.UnmountSegmentRequest(client_id=VICTIM_CLIENT,
                                              segment_id=VICTIM_SEGMENT)

    def unmount(ch: grpc.aio.Channel) -> Any:
        return stub(ch).UnmountSegment(request, timeout=TIMEOUT_S)
    await attack(secure, who, secure.store_address, SVC + "UnmountSegment", unmount,
                 allowed="store_client", wrong_roles=roles_except(*STORE_ROLES))
    if who == "wrong role":  # a role that may unmount, but not the victim's segment
        for stem in OTHER_STORE_CLIENTS:
            async with channel(secure.store_address, secure.tls(stem)) as ch:
                err = await refused(unmount(ch))
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED, (stem, err)
            assert f"segment_id: {VICTIM_SEGMENT!r} belongs to store_client/victim" in (
                err.details() or ""), (stem, err.details())
    assert await secure.snapshot() == before
    assert all((await secure.victim_objects()).values())


async def test_mount_of_a_fake_petabyte_segment_by_a_non_store_role_is_refused(
        secure: SecureMesh, who: str) -> None:
    before = await secure.settled()
    request = store_pb2.MountSegmentRequest(client_id="fake", segment_id="fake-pib",
                                            base=1 << 30, size=1 << 50, endpoint="nixl:fake")
    await attack(secure, who, secure.store_address, SVC + "MountSegment",
                 lambda ch: stub(ch).MountSegment(request, timeout=TIMEOUT_S),
                 allowed="store_client", wrong_roles=roles_except(*STORE_ROLES))
    if who == "wrong role":  # nor may another store client take the victim's segment over
        takeover = store_pb2.MountSegmentRequest(
            client_id=VICTIM_CLIENT, segment_id=VICTIM_SEGMENT, base=1 << 30, size=1 << 50,
            endpoint="nixl:fake")
        for stem in OTHER_STORE_CLIENTS:
            async with channel(secure.store_address, secure.tls(stem)) as ch:
                err = await refused(stub(ch).MountSegment(takeover, timeout=TIMEOUT_S))
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED, (stem, err)
            assert "belongs to store_client/victim" in (err.details() or ""), err.details()
    after = await secure.snapshot()
    assert int(after.store["capacity"]) < 1 << 40
    assert after == before


LEASING = {  # every read that grants a read lease on the object
    "GetReplicaList": lambda ch, key: stub(ch).GetReplicaList(
        store_pb2.KeyRequest(key=key), timeout=TIMEOUT_S),
    "ExistKey": lambda ch, key: stub(ch).ExistKey(store_pb2.KeyRequest(key=key),
                                                  timeout=TIMEOUT_S),
    "BatchGetReplicaList": lambda ch, key: stub(ch).BatchGetReplicaList(
        store_pb2.BatchKeysRequest(keys=[key]), timeout=TIMEOUT_S),
    "BatchExistKey": lambda ch, key: stub(ch).BatchExistKey(
        store_pb2.BatchExistKeyRequest(keys=[key]), timeout=TIMEOUT_S),
}


async def test_a_read_lease_blocks_removal(secure: SecureMesh) -> None:
    """Control: a lease an allowed reader takes does stop an admin's Remove, so the
    Remove that follows each refused read below shows that no lease was granted."""
    await put(secure, "lease-control")
    async with channel(secure.store_address, secure.tls("worker")) as ch:
        await LEASING["GetReplicaList"](ch, "lease-control")
    async with channel(secure.store_address, secure.tls("admin")) as ch:
        err = await refused(stub(ch).Remove(store_pb2.KeyRequest(key="lease-control"),
                                            timeout=TIMEOUT_S))
    assert "leased" in (err.details() or ""), err


@pytest.mark.parametrize("method", sorted(LEASING))
async def test_read_leases_by_a_wrong_role_are_refused(secure: SecureMesh, who: str,
                                                       method: str) -> None:
    key = f"lease-probe-{method}-{who.replace(' ', '-')}"
    await put(secure, key)
    before = await secure.settled()
    await attack(secure, who, secure.store_address, SVC + method,
                 lambda ch: LEASING[method](ch, key), allowed="worker",
                 wrong_roles=roles_except(*STORE_ROLES))
    assert await secure.snapshot() == before
    await admin_remove(secure, key)  # not leased: a refused read granted nothing
