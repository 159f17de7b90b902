"""``kvmesh certs --identities`` and ``kvmesh etcd-auth`` (the one-shot jobs compose runs)
against a real etcd started with TLS."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from protos import discovery_pb2
from services.common.discovery import EtcdPermissionError, Registration
from services.common.procs import Child, start_etcd
from services.common.tls import MeshTls
from services.launcher import cli

ROLES = "admin,etcd,redis,router,worker:w0,worker:w1"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("certs")
    ids = tmp_path_factory.mktemp("ids")
    assert cli.main(["certs", "--out", str(root), "--roles", ROLES, "--identities",
                     str(ids), "--namespace", "cli"]) == 0
    return root, ids


@pytest.fixture(scope="module")
def tls_etcd(certs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory,
             log_dir: Path) -> Iterator[Child]:
    child = start_etcd(tmp_path_factory.mktemp("etcd"), log_dir, tls_dir=certs[1] / "etcd")
    try:
        yield child
    finally:
        child.stop()


def test_each_identity_folder_holds_only_its_files(certs: tuple[Path, Path]) -> None:
    root, ids = certs
    assert {p.name for p in (ids / "redis").iterdir()} == {
        "ca.pem", "redis.pem", "redis-key.pem", "redis-users.acl"}
    assert "user worker reset on #" in (ids / "redis" / "redis-users.acl").read_text()
    assert {p.name for p in (ids / "worker-w0").iterdir()} == {
        "ca.pem", "worker-w0.pem", "worker-w0-key.pem", "worker-w0.evkey",
        "redis-worker.pass"}
    assert not any((ids / stem / "ca-key.pem").exists() for stem in
                   ("admin", "etcd", "redis", "router", "worker-w0", "worker-w1"))
    assert (root / "ca-key.pem").is_file()


async def test_etcd_auth_provisions_and_a_worker_writes_only_its_own_key(
        certs: tuple[Path, Path], tls_etcd: Child, capsys: pytest.CaptureFixture[str]) -> None:
    root, ids = certs
    args = ["etcd-auth", "--endpoint", tls_etcd.address, "--certs", str(root),
            "--namespace", "cli"]
    assert cli.main(args) == 0
    assert "w0\tcli/read cli/worker/w0" in capsys.readouterr().out
    assert cli.main(args) == 0  # idempotent: compose may run it on every start
    w0 = MeshTls.load(ids / "worker-w0", "worker-w0")
    own = Registration(tls_etcd.address, "cli", discovery_pb2.InstanceRecord(
        instance_id="w0", component="worker", address="127.0.0.1:1"), ttl=10, tls=w0)
    await own.start()
    await own.close()
    fake = Registration(tls_etcd.address, "cli", discovery_pb2.InstanceRecord(
        instance_id="w1", component="worker", address="127.0.0.1:2"), ttl=10, tls=w0)
    with pytest.raises(EtcdPermissionError):
        await fake.start()
    await fake.close()


def test_etcd_auth_refuses_a_plaintext_endpoint(certs: tuple[Path, Path],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["etcd-auth", "--endpoint", "127.0.0.1:1", "--certs", str(certs[0]),
                     "--timeout-s", "1"]) == 1
    assert "needs an https:// etcd" in capsys.readouterr().err
