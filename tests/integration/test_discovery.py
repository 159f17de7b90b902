"""etcd discovery against real etcd: the watcher's start-up failure is reported, the
watcher resyncs after etcd restarts (the records written while it was away reach it), and
a registration puts its key back when someone deletes it while its lease lives, and one
whose lease cannot be revoked at close (etcd gone) says so."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import aetcd
import pytest

from protos import discovery_pb2
from services.common.discovery import (
    InstanceWatcher,
    Registration,
    etcd_client,
    instance_key,
)
from services.common.procs import Child, free_port, start_etcd
from tests.waiting import wait_for

NS = "disc"


async def test_start_raises_when_etcd_is_unreachable() -> None:
    watcher = InstanceWatcher(f"127.0.0.1:{free_port()}", NS, "worker")
    with pytest.raises(aetcd.exceptions.ConnectionFailedError):
        await watcher.start()
    await watcher.close()


@pytest.fixture
def own_etcd(tmp_path: Path, log_dir: Path) -> Iterator[tuple[Child, Path]]:
    """An etcd of the test's own (the test stops and restarts it); stopped at the end."""
    child = start_etcd(tmp_path, log_dir)
    try:
        yield child, tmp_path
    finally:
        child.stop()


async def _put(address: str, instance_id: str) -> None:
    rec = discovery_pb2.InstanceRecord(instance_id=instance_id, component="worker",
                                       address="127.0.0.1:1")
    client = etcd_client(address)
    try:
        await client.connect()
        await client.put(instance_key(NS, rec).encode(), rec.SerializeToString())
    finally:
        await client.close()


async def test_watcher_resyncs_after_an_etcd_restart(own_etcd: tuple[Child, Path],
                                                     log_dir: Path) -> None:
    child, work = own_etcd
    host, port = child.address.split(":")
    await _put(child.address, "w1")
    watcher = InstanceWatcher(child.address, NS, "worker")
    await watcher.start()
    restarted: Child | None = None
    try:
        assert set(watcher.instances()) == {"w1"}
        peer = _peer_port(child)
        child.stop()
        restarted = start_etcd(work, log_dir, port=int(port), peer_port=peer)
        await _put(restarted.address, "w2")
        await wait_for(lambda: set(watcher.instances()) == {"w1", "w2"}, 30,
                       lambda: f"the watcher to resync after the restart "
                               f"(has {sorted(watcher.instances())})")
    finally:
        await watcher.close()
        if restarted is not None:
            restarted.stop()


def _peer_port(child: Child) -> int:
    """The peer port etcd was started with (from its command line)."""
    args = list(child.proc.args)  # type: ignore[arg-type]
    url = args[args.index("--listen-peer-urls") + 1]
    return int(url.rsplit(":", 1)[1])


async def test_registration_puts_a_deleted_key_back(etcd: Child) -> None:
    rec = discovery_pb2.InstanceRecord(instance_id="phoenix", component="worker",
                                       address="127.0.0.1:1")
    reg = Registration(etcd.address, NS, rec, ttl=3)  # keepalive every 1 s
    await reg.start()
    client = etcd_client(etcd.address)
    await client.connect()
    try:
        key = reg.key.encode()
        first = await client.get(key)
        assert first is not None and first.lease == reg.lease_id
        assert await client.delete(key)
        assert await client.get(key) is None
        back = await wait_for(lambda: client.get(key), 15,
                              "the registration to put its deleted key back")
        assert back.value == rec.SerializeToString()
        assert back.lease == reg.lease_id  # the same lease: it still expires with us
    finally:
        await reg.close()
        await client.close()


async def test_records_a_wiped_etcd_lost_stay_until_the_grace_ends(
        own_etcd: tuple[Child, Path], log_dir: Path) -> None:
    child, work = own_etcd
    port, peer = int(child.address.split(":")[1]), _peer_port(child)
    await _put(child.address, "dead")
    await _put(child.address, "alive")
    watcher = InstanceWatcher(child.address, NS, "worker", resync_grace_s=2.0)
    await watcher.start()
    seen: list[set[str]] = []
    watcher.on_change(lambda recs: seen.append(set(recs)))
    child.stop()
    shutil.rmtree(work / "etcd-data")
    restarted = await asyncio.to_thread(start_etcd, work, log_dir, port, peer)
    try:
        async def put_alive() -> bool:  # its owner re-registers; "dead" never does
            try:
                await _put(restarted.address, "alive")
            except aetcd.exceptions.ConnectionFailedError:
                return False  # a wiped etcd may listen before it serves
            return True
        await wait_for(put_alive, 30, "the restarted etcd to take a put")
        await wait_for(lambda: set(watcher.instances()) == {"alive"}, 30,
                       lambda: f"'dead' to go after the grace (has {seen})")
        # Neither was ever missing before the grace ended: no routing gap.
        assert all("alive" in s for s in seen), seen
        assert any(s == {"alive", "dead"} for s in seen), seen
    finally:
        await watcher.close()
        restarted.stop()


async def test_a_lease_that_cannot_be_revoked_is_said(own_etcd: tuple[Child, Path],
                                                      caplog: pytest.LogCaptureFixture
                                                      ) -> None:
    child, _ = own_etcd
    rec = discovery_pb2.InstanceRecord(instance_id="orphan", component="worker",
                                       address="127.0.0.1:1")
    reg = Registration(child.address, NS, rec, ttl=3)
    await reg.start()
    child.stop()  # etcd gone: the revoke cannot reach it
    with caplog.at_level("WARNING", "services.common.discovery"):
        await reg.close()
    said = [r.getMessage() for r in caplog.records
            if r.getMessage().startswith(f"could not revoke the lease of {reg.key}")]
    assert len(said) == 1 and "TTL 3 s" in said[0], caplog.text
