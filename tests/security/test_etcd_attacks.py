"""Hijacking traffic and hiding workers through etcd (mTLS, client certificates, a user
per identity: :mod:`services.common.etcd_auth`):

- a fake worker record (``/<ns>/instances/worker/fake``, pointing at an attacker's
  listener) or an overwrite of the decode worker's own record, by ``Put`` and by a
  ``Txn`` put: an outsider (plaintext, or TLS without a client certificate) and another
  CA's certificate (an ``admin`` one: its CN would be etcd's root) fail the handshake; every
  insider certificate that is not that worker's (the prefill worker's instance
  certificate, the shared ``worker`` one, an instance certificate without an etcd user,
  each service role) gets PERMISSION_DENIED. The router still lists the two real
  workers, etcd's worker records are unchanged, the attacker's listener was never dialled,
  and 20 completions through the frontend all ran on the real workers (the decode
  worker's prefix-cache query counter grew by exactly 20 prompts, the prefill worker's by
  whole prompts: those the frontend had prefilled remotely);
- deleting the decode worker's key (``DeleteRange`` of the key or of every worker key)
  or revoking its lease (``LeaseRevoke``: the lease id is in the record anyone may read)
  with another identity's certificate: PERMISSION_DENIED (the handshake, for outsiders
  and another CA); the key, its lease and the worker's routability are unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import grpc
import httpx
from aetcd import rpc

from protos import discovery_pb2
from services.common.discovery import instance_key, instances_prefix
from services.common.etcd_auth import prefix_end
from services.common.tls import MeshTls, channel_options
from tests.security.conftest import (
    ALICE,
    MODEL,
    TIMEOUT_S,
    WHO,
    SecureMesh,
    assert_handshake_refused,
    refused,
)

# Every certificate of the mesh but the admin's and the decode worker's own (the servers'
# etcd and redis have no etcd user, as `worker-intruder`: issued after provisioning).
INSIDERS = ("worker-prefill-0", "worker", "worker-intruder", "frontend", "router",
            "indexer", "planner", "store_master", "store_client", "store_client-victim")
REQUESTS = 20
Call = Callable[[grpc.aio.Channel], Awaitable[object]]


@asynccontextmanager
async def listener() -> AsyncIterator[tuple[str, list[object]]]:
    """An attacker's TCP listener: (its address, the connections it accepted)."""
    accepted: list[object] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer.get_extra_info("peername"))
        writer.close()
    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        yield f"127.0.0.1:{port}", accepted
    finally:
        server.close()
        await server.wait_closed()


def etcd_channels(mesh: SecureMesh, who: str) -> dict[str, grpc.aio.Channel]:
    """The attacker's channels to etcd, by what they present (see the module docstring)."""
    target, ca, options = mesh.etcd_target, mesh.tls("admin").ca, channel_options("etcd")
    if who == "outsider":
        return {"plaintext": grpc.aio.insecure_channel(target),
                "TLS without a client certificate": grpc.aio.secure_channel(
                    target, grpc.ssl_channel_credentials(root_certificates=ca), options)}
    if who == "another CA":
        rogue = mesh.foreign("admin")
        return {"another CA's admin": grpc.aio.secure_channel(
            target, rogue.channel_credentials(), options)}
    assert who == "wrong role", who
    return {stem: grpc.aio.secure_channel(target, MeshTls.load(
        mesh.certs, stem).channel_credentials(), options) for stem in INSIDERS}


async def etcd_attack(mesh: SecureMesh, who: str, call: Call) -> int:
    """Runs ``call`` on each of ``who``'s channels: the handshake fails (outsider, another
    CA) or etcd answers PERMISSION_DENIED (insiders). Returns the attempts made."""
    n = 0
    for what, ch in etcd_channels(mesh, who).items():
        async with ch:
            err = await refused(call(ch))
        if who == "wrong role":
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED, (what, err)
            assert "permission denied" in (err.details() or ""), (what, err.details())
        else:
            assert_handshake_refused(err, what)
        n += 1
    return n


def fake_record(mesh: SecureMesh, instance_id: str, address: str) -> bytes:
    """The decode worker's record, as ``instance_id`` at the attacker's ``address``."""
    rec = discovery_pb2.InstanceRecord()
    rec.CopyFrom(mesh.decode)
    rec.instance_id, rec.address, rec.pid = instance_id, address, 1
    return rec.SerializeToString()


def put_calls(put: rpc.PutRequest) -> tuple[Call, Call]:
    """``put`` as a Put and inside a Txn."""
    txn = rpc.TxnRequest(success=[rpc.RequestOp(request_put=put)])
    return (lambda ch: rpc.KVStub(ch).Put(put, timeout=TIMEOUT_S),
            lambda ch: rpc.KVStub(ch).Txn(txn, timeout=TIMEOUT_S))


async def counters(mesh: SecureMesh) -> dict[str, int]:
    """Each real worker's prompt tokens looked up in its prefix cache (GetLoad)."""
    snap = await mesh.snapshot()
    return {w: int(load["counters"].get("prefix_cache_queries_tokens", 0))
            for w, load in snap.loads.items()}


async def test_a_fake_worker_registration_is_refused(secure: SecureMesh, who: str) -> None:
    before = await secure.settled()
    decode = secure.decode
    async with listener() as (address, accepted):
        attempts = 0
        for key, instance in ((instances_prefix(secure.namespace, "worker") + "fake", "fake"),
                              (instance_key(secure.namespace, decode), decode.instance_id)):
            put = rpc.PutRequest(key=key.encode(), value=fake_record(secure, instance, address))
            for call in put_calls(put):
                attempts += await etcd_attack(secure, who, call)
        assert attempts >= 4
        assert await secure.snapshot() == before
        # the router's list is the same, and the users' requests go to the real workers
        base = 9000 + 1000 * WHO.index(who)  # prompts no earlier run cached
        prompt = list(range(base, base + 40))
        start = await counters(secure)
        async with httpx.AsyncClient(base_url=secure.url, timeout=60) as client:
            for i in range(REQUESTS):
                resp = await client.post("/v1/completions", headers=ALICE, json={
                    "model": MODEL, "prompt": [i, *prompt], "max_tokens": 2,
                    "temperature": 0, "ignore_eos": True})
                assert resp.status_code == 200, resp.text
                assert resp.json()["usage"]["completion_tokens"] == 2, resp.text
        end = await counters(secure)
        assert accepted == [], "the attacker's listener was dialled"
    grew = {w: end[w] - start[w] for w in end}
    tokens = 1 + len(prompt)
    # every request was decoded on the real decode worker; the prefill worker prefilled
    # those the frontend sent there (conditional disaggregation), whole prompts each, and
    # D continued those after P's token (its prompt one longer: handoff.p_token_first)
    prefilled = grew[secure.prefill.instance_id]
    assert prefilled % tokens == 0 and prefilled <= REQUESTS * tokens, grew
    assert grew[decode.instance_id] == REQUESTS * tokens + prefilled // tokens, grew
    after = await secure.settled()
    assert after.routing == before.routing and after.etcd == before.etcd


async def test_deleting_a_workers_key_or_lease_is_refused(secure: SecureMesh) -> None:
    before = await secure.settled()
    key = instance_key(secure.namespace, secure.decode).encode()
    (_, lease), = [v for k, v in before.etcd.items() if k == key.decode()]
    assert lease, f"{key!r} is not under a lease"
    workers = instances_prefix(secure.namespace, "worker").encode()
    calls: dict[str, Call] = {
        "DeleteRange of the key": lambda ch: rpc.KVStub(ch).DeleteRange(
            rpc.DeleteRangeRequest(key=key), timeout=TIMEOUT_S),
        "DeleteRange of every worker": lambda ch: rpc.KVStub(ch).DeleteRange(
            rpc.DeleteRangeRequest(key=workers, range_end=prefix_end(workers)),
            timeout=TIMEOUT_S),
        "a Txn delete": lambda ch: rpc.KVStub(ch).Txn(rpc.TxnRequest(success=[
            rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))]),
            timeout=TIMEOUT_S),
        "LeaseRevoke of its lease": lambda ch: rpc.LeaseStub(ch).LeaseRevoke(
            rpc.LeaseRevokeRequest(ID=lease), timeout=TIMEOUT_S),
    }
    for who in WHO:
        for what, call in calls.items():
            assert await etcd_attack(secure, who, call), (who, what)
    after = await secure.snapshot()
    assert after == before
    assert secure.decode.instance_id in {w for w, _ in after.routing["workers"]}
