"""``kvmesh up --frontends 2 --router embedded`` on mock workers: two frontend processes
share one HTTP port, each with its own router, in sync over Redis. Requests on the shared
port are served; each replica is reachable on its own port (its etcd ``http_address``);
each router counts the other as a peer; a SIGKILLed replica is restarted, the survivor
drops the dead one's load after the peer timeout and meets the new one."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.common.discovery import read_instance_records
from tests.e2e.test_launcher import Supervised, kvmesh_up
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervised]:
    log_dir = tmp_path_factory.mktemp("replicas") / "logs"
    with kvmesh_up(log_dir, "--engine", "mock", "--model", "tiny", "--mode", "agg",
                   "--workers", "2", "--frontends", "2", "--router", "embedded",
                   "--insecure", timeout_s=120) as (proc, url, out):
        yield Supervised(proc, url, log_dir, out)


async def peers_by_router(etcd: str) -> dict[str, float]:
    """Each live router's ``kvmesh_router_replica_peers`` (its metrics address → value);
    a killed router's record lingers until its lease expires: it is left out."""
    out = {}
    async with httpx.AsyncClient(timeout=5) as c:
        for rec in await read_instance_records(etcd, "kvmesh", "router"):
            try:
                text = (await c.get(f"http://{rec.metrics_address}/metrics")).text
            except httpx.ConnectError:
                continue
            line = next(x for x in text.splitlines()
                        if x.startswith("kvmesh_router_replica_peers "))
            out[rec.metrics_address] = float(line.split()[1])
    return out


async def complete(url: str) -> None:
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(f"{url}/v1/completions", json={
            "model": "tiny-llama", "prompt": "one two three", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


async def test_two_replicas_share_the_port_and_sync_their_routers(
        replicas: Supervised) -> None:
    mesh = replicas
    etcd = mesh.address("etcd")
    status = mesh.status()
    assert status["frontend"]["state"] == status["frontend-1"]["state"] == "running"
    fronts = await read_instance_records(etcd, "kvmesh", "frontend")
    shared = mesh.url.rsplit(":", 1)[1]
    own = sorted(r.http_address for r in fronts)
    assert len(own) == 2 and len(set(own)) == 2, own
    assert all(not a.endswith(f":{shared}") for a in own), (own, shared)
    # both replicas answer on their own port, and the shared one serves every request
    for address in own:
        await complete(f"http://{address}")
    await asyncio.gather(*(complete(mesh.url) for _ in range(16)))
    await wait_for(lambda: peers_by_router(etcd), 10, "the routers' metrics")
    last: dict[str, float] = {}

    async def each_sees_one_peer() -> bool:
        nonlocal last
        last = await peers_by_router(etcd)
        return len(last) == 2 and set(last.values()) == {1.0}
    await wait_for(each_sees_one_peer, 30, lambda: f"each router to count 1 peer: {last}")


async def test_a_killed_replica_is_replaced_and_the_survivor_meets_the_new_one(
        replicas: Supervised) -> None:
    mesh = replicas
    etcd = mesh.address("etcd")
    old = int(mesh.status()["frontend-1"]["pid"])
    os.kill(old, signal.SIGKILL)  # no leaving snapshot: the survivor must time it out
    await wait_for(lambda: mesh.status()["frontend-1"]["pid"] != str(old)
                   and mesh.status()["frontend-1"]["state"] == "running", 30,
                   lambda: f"frontend-1 restarted: {mesh.status()}")
    survivor_log = Path(mesh.log_dir / "frontend.log")
    await wait_for(lambda: "not heard from" in survivor_log.read_text(), 30,
                   "the survivor to time out the killed replica")
    last: dict[str, float] = {}

    async def met_again() -> bool:
        nonlocal last
        last = await peers_by_router(etcd)
        return len(last) == 2 and set(last.values()) == {1.0}
    await wait_for(met_again, 30, lambda: f"two routers, one peer each: {last}")
    await asyncio.gather(*(complete(mesh.url) for _ in range(8)))
