"""Planner actuators: local launcher (fake spawn), docker compose (injected runner), dry run;
the identity folder a local worker gets in a mesh with certificates (its own certificate,
key and secrets only) and the refusal to start one when a mesh secret is missing."""

from __future__ import annotations

import functools
import logging
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from services.common.etcd_auth import enroll_worker
from services.common.tls import (
    CertError,
    Identity,
    MeshTls,
    derive_event_key,
    write_mesh_certs,
)
from services.planner.actuators import (
    ComposeActuator,
    DryRunActuator,
    LocalActuator,
    make_actuator,
)
from services.planner.core import ScaleAction, ScalingDecision


def decision(**desired: int) -> ScalingDecision:
    return ScalingDecision(0.0, dict(desired), {}, {})


class FakeProc:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


class FakeChild:
    """Quacks like services.common.procs.Child; records stop()."""

    def __init__(self, name: str, pid: int, env: Mapping[str, str], argv: Sequence[str]) -> None:
        self.name = name
        self.proc = FakeProc(pid)
        self.env = dict(env)
        self.argv = list(argv)
        self.stopped = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.returncode is None

    def stop(self, timeout: float = 10.0) -> int | None:
        self.stopped = True
        self.proc.returncode = 0
        return 0


class FakeSpawn:
    def __init__(self) -> None:
        self.children: list[FakeChild] = []

    def __call__(self, name: str, argv: Sequence[str], log_dir: Path,
                 env: Mapping[str, str] | None = None) -> FakeChild:
        child = FakeChild(name, 1000 + len(self.children), env or {}, argv)
        self.children.append(child)
        return child


async def test_local_actuator_spawns_and_stops_its_own_children(tmp_path: Path) -> None:
    fake = FakeSpawn()
    act = LocalActuator(tmp_path, {"KVMESH_ETCD_ENDPOINT": "e:1", "KVMESH_ENGINE": "mock"},
                        argv=["py", "-m", "workers"], spawn_fn=fake)  # type: ignore[arg-type]
    await act.apply(decision(prefill=2, decode=1))
    assert [(c.name, c.env["KVMESH_ROLE"]) for c in fake.children] == [
        ("planner-prefill-1", "prefill"), ("planner-prefill-2", "prefill"),
        ("planner-decode-3", "decode")]
    assert all(c.env["KVMESH_ENGINE"] == "mock" and c.argv == ["py", "-m", "workers"]
               for c in fake.children)
    # idempotent
    await act.apply(decision(prefill=2, decode=1))
    assert len(fake.children) == 3
    # scale prefill down by one: the newest prefill child stops, nothing else
    await act.apply(decision(prefill=1, decode=1))
    assert [c.name for c in fake.children if c.stopped] == ["planner-prefill-2"]
    assert act.pids() == {1000, 1002}
    # a child that died is replaced
    fake.children[2].proc.returncode = 1
    await act.apply(decision(prefill=1, decode=1))
    assert fake.children[-1].name == "planner-decode-4"
    await act.close()
    assert all(not c.alive() for c in fake.children)
    assert act.pids() == set()


async def test_local_actuator_counts_external_workers(tmp_path: Path) -> None:
    fake = FakeSpawn()
    act = LocalActuator(tmp_path, {}, external={"decode": 2}, spawn_fn=fake)  # type: ignore[arg-type]
    await act.apply(decision(decode=2))
    assert fake.children == []  # the two external ones suffice; they are never stopped
    await act.apply(decision(decode=3))
    assert [c.name for c in fake.children] == ["planner-decode-1"]
    await act.apply(decision(decode=1))
    assert fake.children[0].stopped


async def test_compose_actuator_command_and_runner() -> None:
    ran: list[list[str]] = []

    async def runner(argv: Sequence[str]) -> int:
        ran.append(list(argv))
        return 0

    act = ComposeActuator({"prefill": "prefill-worker", "decode": "decode-worker"},
                          compose_file="docker-compose.yml", project="kvmesh", runner=runner)
    await act.apply(decision(prefill=2, decode=3))
    assert ran == [["docker", "compose", "-f", "docker-compose.yml", "-p", "kvmesh", "up", "-d",
                    "--no-recreate", "--scale", "decode-worker=3", "--scale",
                    "prefill-worker=2", "decode-worker", "prefill-worker"]]
    await act.apply(decision(prefill=2, decode=3))  # unchanged: no command
    assert len(ran) == 1
    assert ComposeActuator({"agg": "worker"}).command({"agg": 4}) == [
        "docker", "compose", "up", "-d", "--no-recreate", "--scale", "worker=4", "worker"]


async def test_compose_actuator_failure_raises_and_retries() -> None:
    codes = [1, 0]
    calls = 0

    async def runner(argv: Sequence[str]) -> int:
        nonlocal calls
        calls += 1
        return codes.pop(0)

    act = ComposeActuator({"decode": "worker"}, runner=runner)
    with pytest.raises(RuntimeError, match="exited 1"):
        await act.apply(decision(decode=2))
    await act.apply(decision(decode=2))  # not remembered as applied: tried again
    assert calls == 2


async def test_dry_run_logs_actions(caplog: pytest.LogCaptureFixture) -> None:
    act = make_actuator("dry_run")
    assert isinstance(act, DryRunActuator)
    dec = ScalingDecision(1.0, {"decode": 3}, {"decode": 2}, {"decode": 2}, (
        ScaleAction("decode", "scale_up", 1, 2, 3, "load", "queue 4.0/worker > 2"),))
    with caplog.at_level(logging.INFO, logger="services.planner.actuators"):
        await act.apply(dec)
    assert act.applied == [dec]
    assert "scale_up decode by 1 (2 → 3, load): queue 4.0/worker > 2" in caplog.text
    with pytest.raises(ValueError, match="unknown actuator"):
        make_actuator("k8s")


WORKER_FILES = {"ca.pem", "worker-planner-decode-1.pem", "worker-planner-decode-1-key.pem",
                "worker-planner-decode-1.evkey", "redis-worker.pass"}


def mesh_folder(tmp_path: Path) -> Path:
    """A planner's certificate folder as ``kvmesh certs`` writes it (CA key included)."""
    certs = tmp_path / "certs"
    write_mesh_certs(certs, ["admin", "planner", "worker", "indexer", "router",
                             "store_master"])
    return certs


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_a_local_worker_gets_its_own_identity_folder_only(tmp_path: Path) -> None:
    """The certificate is issued in the planner's folder; the child's KVMESH_TLS_DIR is a
    0700 folder of its own with exactly the CA certificate, its certificate and key, its
    event key and the worker Redis password: no CA key, no admin files, no other secret.
    The folder goes when the child is stopped or found dead."""
    certs = mesh_folder(tmp_path)
    fake = FakeSpawn()
    prepare = functools.partial(enroll_worker, certs, "127.0.0.1:1", "ns")
    act = LocalActuator(tmp_path / "logs", {}, spawn_fn=fake,  # type: ignore[arg-type]
                        prepare=prepare)
    await act.apply(decision(decode=1))
    (child,) = fake.children
    own = act.identity_dir("planner-decode-1")
    assert child.env["KVMESH_TLS_DIR"] == str(own) != str(certs)
    assert child.env["KVMESH_TLS_CERT"] == "worker-planner-decode-1"
    assert child.env["KVMESH_WORKER_ID"] == "planner-decode-1"
    assert {p.name for p in own.iterdir()} == WORKER_FILES
    assert mode(own) == mode(own.parent) == 0o700
    for name in WORKER_FILES - {"ca.pem", "worker-planner-decode-1.pem"}:
        assert mode(own / name) == 0o600, name
    # the same material as the planner's folder, which keeps the issued certificate
    for name in WORKER_FILES:
        assert (own / name).read_bytes() == (certs / name).read_bytes(), name
    events = (certs / "events.key").read_bytes()
    assert (own / "worker-planner-decode-1.evkey").read_bytes() == derive_event_key(
        events, "planner-decode-1")
    tls = MeshTls.load(own, "worker-planner-decode-1")
    assert tls.identity == Identity("worker", "planner-decode-1")
    assert tls.secret("redis-worker.pass") == (certs / "redis-worker.pass").read_bytes()
    await act.apply(decision(decode=0))
    assert child.stopped and not own.exists()
    # a child found dead loses its folder too; its replacement gets a new one
    await act.apply(decision(decode=1))
    fake.children[-1].proc.returncode = 1
    await act.apply(decision(decode=1))
    assert not act.identity_dir("planner-decode-2").exists()
    assert fake.children[-1].env["KVMESH_TLS_DIR"] == str(act.identity_dir("planner-decode-3"))
    assert act.identity_dir("planner-decode-3").is_dir()
    await act.close()
    assert not act.identity_dir("planner-decode-3").exists()


@pytest.mark.parametrize("missing", ["events.key", "redis-worker.pass", "ca-key.pem"])
async def test_a_missing_mesh_secret_stops_the_spawn_and_is_named(
        tmp_path: Path, missing: str, caplog: pytest.LogCaptureFixture) -> None:
    """A secret the mesh already has is never made up (a fresh events.key would make the
    worker's events forged, a fresh Redis password fail its login): the error names the
    file, is logged with the child's name, and nothing is spawned or left behind."""
    certs = mesh_folder(tmp_path)
    (certs / missing).unlink()
    before = {p.name: p.read_bytes() for p in certs.iterdir()}
    fake = FakeSpawn()
    prepare = functools.partial(enroll_worker, certs, "127.0.0.1:1", "ns")
    act = LocalActuator(tmp_path / "logs", {}, spawn_fn=fake,  # type: ignore[arg-type]
                        prepare=prepare)
    with caplog.at_level(logging.ERROR, logger="services.planner.actuators"), \
            pytest.raises(CertError, match=f"cannot enroll worker 'planner-decode-1' "
                                           f"without {missing}"):
        await act.apply(decision(decode=1))
    assert fake.children == []
    assert f"cannot start planner-decode-1: tls_dir {certs}" in caplog.text
    assert missing in caplog.text
    assert not act.identity_dir("planner-decode-1").exists()
    assert {p.name: p.read_bytes() for p in certs.iterdir()} == before  # nothing created


async def test_an_https_etcd_needs_the_admin_certificate(tmp_path: Path) -> None:
    certs = mesh_folder(tmp_path)
    (certs / "admin-key.pem").unlink()
    with pytest.raises(CertError, match="without admin-key.pem$"):
        enroll_worker(certs, "https://127.0.0.1:1", "ns", "w1", tmp_path / "w1")
    assert not (tmp_path / "w1").exists()
