"""Infrastructure faults on a P/D mesh of mock workers: the indexer killed and restarted,
etcd restarted with its data kept and wiped, a worker's etcd key deleted, Redis restarted
with its append-only file kept and wiped. Each asserts that requests
are served again, that every worker is routable, that nothing is held on a worker and
that the index matches every worker afterwards."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aetcd
import pytest

from services.common.discovery import etcd_client, instances_prefix
from tests.faults.mesh import NS, FaultMesh, monotonic
from tests.faults.table import FaultTable
from tests.faults.test_worker_faults import settled
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
async def mesh(tmp_path_factory: pytest.TempPathFactory, tiny_model: str,
               ) -> AsyncIterator[FaultMesh]:
    m = FaultMesh(tmp_path_factory.mktemp("faults-infra"), tiny_model)
    await asyncio.to_thread(m.start)
    try:
        yield m
    finally:
        await asyncio.to_thread(m.stop)


async def served(mesh: FaultMesh, tag: str, n: int = 10) -> str:
    """"k/n" of ``n`` fresh requests that got 200, with the other answers."""
    bad = []
    for i in range(n):
        resp = await mesh.completion(f"{tag} {i} " * 40, 4)
        if resp.status_code != 200:
            bad.append(f"{resp.status_code} {resp.text[:200]}")
    return f"{n - len(bad)}/{n}" + (f" (others: {bad})" if bad else "")


async def registered(mesh: FaultMesh) -> bool:
    """Every worker's key is in etcd."""
    client = etcd_client(mesh.etcd_address)
    try:
        await client.connect()
        kvs = await client.get_prefix(instances_prefix(NS, "worker").encode())
    except aetcd.exceptions.ClientError:
        return False  # still starting
    finally:
        await client.close()
    keys = {kv.key.decode().rsplit("/", 1)[1] for kv in kvs}
    return set(mesh.workers()) <= keys


async def all_routable(mesh: FaultMesh) -> bool:
    return set(mesh.workers()) <= await mesh.routable()


async def recovered(mesh: FaultMesh, started: float) -> float:
    """Waits until every worker is routable, a request is served and the index matches
    every worker; returns the seconds since ``started``."""
    await wait_for(lambda: all_routable(mesh), 60, "every worker routable again")

    async def serves() -> bool:
        return (await mesh.completion("probe " * 40, 2)).status_code == 200
    await wait_for(serves, 60, "a request served again")
    await settled(mesh, mesh.workers())
    return monotonic() - started


async def test_indexer_killed_and_restarted(mesh: FaultMesh, fault_table: FaultTable) -> None:
    assert await served(mesh, "before") == "10/10"
    mesh.kill("indexer")
    down = await served(mesh, "indexer down")  # the router falls back to its history
    started = monotonic()
    mesh.restart("indexer")
    seconds = await recovered(mesh, started)
    observed = f"{down} served while down; index rebuilt"
    assert fault_table.record("kill -9 of the indexer, then restart",
                              "10/10 served while down; index rebuilt", observed,
                              seconds_to_recover=seconds), observed


@pytest.mark.parametrize("wipe", [False, True], ids=["data-kept", "data-wiped"])
async def test_etcd_restart(mesh: FaultMesh, fault_table: FaultTable, wipe: bool) -> None:
    started = monotonic()
    await asyncio.to_thread(mesh.restart_etcd, wipe)
    await recovered(mesh, started)
    # The routers' lists may still carry the records a wiped etcd lost (their grace):
    # every worker must be back in etcd itself.
    await wait_for(lambda: registered(mesh), 30, "every worker's key back in etcd")
    seconds = monotonic() - started
    after = await served(mesh, f"after etcd wipe={wipe}")
    observed = f"every worker re-registered; {after} served after"
    what = "wiped" if wipe else "kept"
    assert fault_table.record(f"etcd restart, data {what}",
                              "every worker re-registered; 10/10 served after", observed,
                              seconds_to_recover=seconds), observed


@pytest.mark.parametrize("keep", [True, False], ids=["aof-kept", "wiped"])
async def test_redis_restart(mesh: FaultMesh, fault_table: FaultTable, keep: bool) -> None:
    assert await served(mesh, f"before redis keep={keep}") == "10/10"
    started = monotonic()
    await asyncio.to_thread(mesh.restart_redis, keep)
    during = await served(mesh, "after redis restart")
    seconds = await recovered(mesh, started)
    observed = f"{during} served; index matches every worker again"
    what = "append-only file kept" if keep else "data wiped"
    assert fault_table.record(f"Redis restart, {what}",
                              "10/10 served; index matches every worker again", observed,
                              seconds_to_recover=seconds), observed


async def test_a_deleted_worker_key_comes_back(mesh: FaultMesh, fault_table: FaultTable) -> None:
    victim = "decode-1"
    client = etcd_client(mesh.etcd_address)
    await client.connect()
    try:
        key = instances_prefix(NS, "worker") + victim
        assert await client.delete(key.encode())
        deleted = monotonic()

        async def back() -> bool:
            return await client.get(key.encode()) is not None
        await wait_for(back, 30, f"{victim}'s key to be put back")
        seconds = monotonic() - deleted
    finally:
        await client.close()
    await wait_for(lambda: all_routable(mesh), 30, f"{victim} routable again")
    observed = f"key back, {victim} routable; {await served(mesh, 'after delete')} served"
    assert fault_table.record("a worker's etcd key deleted while its lease lives",
                              f"key back, {victim} routable; 10/10 served", observed,
                              seconds_to_come_back=seconds), observed
