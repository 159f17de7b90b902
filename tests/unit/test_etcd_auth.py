"""etcd auth without etcd: the plan of users and roles per identity (who may write which
key), refused identities, endpoints, etcd's TLS flags, and a worker whose id differs from
its certificate's name refusing to start, and the planner's workers enrolled."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest

from services.common import etcd_auth
from services.common.config import ConfigError, load_config
from services.common.discovery import etcd_client
from services.common.etcd_auth import READ, READWRITE, Grant, SecureEtcdClient, plan
from services.common.procs import etcd_argv
from services.common.tls import CertError, Identity, MeshTls, identity_of, write_mesh_certs
from services.planner.actuators import LocalActuator
from tests.unit.test_planner_actuators import FakeSpawn, decision
from workers.config import WorkerConfig

BASE = b"/ns/instances/"


def by_user(identities: list[Identity]) -> dict[str, dict[str, list[Grant]]]:
    return {u.user: u.roles for u in plan("ns", identities)}


def test_each_identity_gets_exactly_its_grants() -> None:
    users = by_user([Identity("admin", "admin"), Identity("router", "router"),
                     Identity("worker", "worker"), Identity("worker", "prefill-0"),
                     Identity("worker", "fleet-a"), Identity("store_master", "store_master"),
                     Identity("store_client", "store_client"), Identity("etcd", "etcd"),
                     Identity("redis", "redis")])
    read = [Grant(READ, BASE, b"/ns/instances0")]
    assert users["admin"] == {"root": []}
    assert users["router"] == {"ns/read": read, "ns/router": [
        Grant(READWRITE, BASE + b"router/", BASE + b"router0")]}
    assert users["store_master"]["ns/store_master"] == [
        Grant(READWRITE, BASE + b"store_master/", BASE + b"store_master0")]
    # A worker instance: its one key, exactly (no sub-ids: a real worker's certificate);
    # a fleet certificate: its key and the prefix of its sub-ids ("fleet-a." up to
    # "fleet-a/", excluded); the shared role certificate: read only.
    assert users["prefill-0"] == {"ns/read": read, "ns/worker/prefill-0": [
        Grant(READWRITE, BASE + b"worker/prefill-0")]}
    assert users["fleet-a"] == {"ns/read": read, "ns/worker/fleet-a": [
        Grant(READWRITE, BASE + b"worker/fleet-a"),
        Grant(READWRITE, BASE + b"worker/fleet-a.", BASE + b"worker/fleet-a/")]}
    assert users["worker"] == {"ns/read": read}
    assert users["store_client"] == {"ns/read": read}
    assert "etcd" not in users and "redis" not in users


def test_identities_that_etcd_could_not_tell_apart_are_refused() -> None:
    with pytest.raises(ValueError, match="worker/router.*both etcd user 'router'|"
                                         "router/router.*both etcd user 'router'"):
        plan("ns", [Identity("router", "router"), Identity("worker", "router")])
    with pytest.raises(ValueError, match="root"):
        plan("ns", [Identity("worker", "root")])
    assert len(plan("ns", [Identity("worker", "a"), Identity("worker", "a")])) == 1
    # a dotted instance name would be another's sub-id (worker:fleet may act as fleet.b)
    with pytest.raises(ValueError, match=r"worker/fleet\.b: a worker instance name has no "):
        plan("ns", [Identity("worker", "fleet"), Identity("worker", "fleet.b")])
    with pytest.raises(ValueError, match=r"worker/a\.b: a worker instance name has no '\.'"):
        plan("ns", [Identity("worker", "a.b")])


def writable_by(name: str) -> Callable[[str], bool]:
    """Whether etcd's ranges [key, range_end) of worker ``name``'s grants cover an id."""
    (grants,) = [g for u in plan("ns", [Identity("worker", name)])
                 for r, g in u.roles.items() if r == f"ns/worker/{name}"]

    def writable(worker_id: str) -> bool:
        k = BASE + b"worker/" + worker_id.encode()
        return any(k == g.key if not g.range_end else g.key <= k < g.range_end
                   for g in grants)
    return writable


def test_the_sub_id_grant_covers_exactly_the_keys_of_the_rule() -> None:
    """A fleet certificate's grants, against keys of the rule."""
    writable = writable_by("fleet-a")
    for ok in ("fleet-a", "fleet-a.0", "fleet-a.1", "fleet-a.fleet-a12"):
        assert writable(ok), ok
    for refused in ("fleet-ax", "fleet-a-0", "fleet-b", "fleet-b.a", "fleet-a/0", "",
                    "fleet-ab.0", "fleet", "fleet.a"):
        assert not writable(refused), refused


@pytest.mark.parametrize("name", ["prefill-0", "decode-0", "w0", "a"])
def test_a_real_workers_certificate_writes_exactly_its_key(name: str) -> None:
    """No sub-ids for a worker that is no fleet: it cannot register ``<name>.x`` records
    (say 50 pointing at its own listener) to pull traffic to itself."""
    writable = writable_by(name)
    assert writable(name)
    for refused in (f"{name}.fake", f"{name}.0", f"{name}.x1", f"{name}x", f"{name}/0"):
        assert not writable(refused), refused


def test_endpoints() -> None:
    assert etcd_auth.parse_endpoint("127.0.0.1:2379") == ("127.0.0.1", 2379, False)
    assert etcd_auth.parse_endpoint("http://etcd:2379") == ("etcd", 2379, False)
    assert etcd_auth.parse_endpoint("https://127.0.0.1:1") == ("127.0.0.1", 1, True)
    with pytest.raises(ValueError, match="etcd_endpoint"):
        etcd_auth.parse_endpoint("https://nohost")
    assert etcd_auth.prefix_end(b"/a/") == b"/a0"


def test_clients_follow_the_endpoint(tmp_path: Path) -> None:
    write_mesh_certs(tmp_path, ["router"])
    tls = MeshTls.load(tmp_path, "router")
    assert isinstance(etcd_client("https://127.0.0.1:1", tls), SecureEtcdClient)
    assert not isinstance(etcd_client("127.0.0.1:1", tls), SecureEtcdClient)
    with pytest.raises(ValueError, match="etcd_endpoint.*--tls-dir"):
        etcd_client("https://127.0.0.1:1", None)


def test_etcd_flags_with_and_without_tls(tmp_path: Path) -> None:
    plain = etcd_argv(tmp_path, 1, 2)
    assert "--client-cert-auth" not in plain and "http://127.0.0.1:1" in plain
    secure = etcd_argv(tmp_path, 1, 2, tmp_path / "certs")
    assert "https://127.0.0.1:1" in secure and "--client-cert-auth" in secure
    assert secure[secure.index("--cert-file") + 1] == str(tmp_path / "certs" / "etcd.pem")
    assert secure[secure.index("--trusted-ca-file") + 1] == str(tmp_path / "certs" / "ca.pem")
    assert "http://127.0.0.1:2" in secure  # the single member's peer URL stays on loopback


def worker_args(certs: Path, *extra: str) -> list[str]:
    return ["--engine", "mock", "--tls-dir", str(certs), *extra]


def test_worker_id_is_bound_to_its_instance_certificate(tmp_path: Path) -> None:
    write_mesh_certs(tmp_path, ["worker", "worker:prefill-0", "worker:fleet-a"])
    cfg = load_config(WorkerConfig, worker_args(tmp_path, "--tls-cert", "worker-prefill-0"),
                      {})
    assert cfg.resolved_worker_id() == "prefill-0"
    same = load_config(WorkerConfig, worker_args(tmp_path, "--tls-cert", "worker-prefill-0",
                                                 "--worker-id", "prefill-0"), {})
    assert same.resolved_worker_id() == "prefill-0"
    with pytest.raises(ConfigError, match="worker_id 'decode-0'.*'prefill-0'.*tls_cert"):
        load_config(WorkerConfig, worker_args(tmp_path, "--tls-cert", "worker-prefill-0",
                                              "--worker-id", "decode-0"), {})
    # a real worker's certificate has no sub-ids at all
    for bad in ("prefill-0.x1", "prefill-0.fake", "prefill-0.", "prefill-0x"):
        with pytest.raises(ConfigError, match=f"worker_id {bad!r}.*tls_cert.*has no sub-ids "
                                              f"\\(only a fleet certificate"):
            load_config(WorkerConfig, worker_args(
                tmp_path, "--tls-cert", "worker-prefill-0", "--worker-id", bad), {})
    # a sub-id of a fleet certificate's name is its own; nothing else with that head is
    sub = load_config(WorkerConfig, worker_args(tmp_path, "--tls-cert", "worker-fleet-a",
                                                "--worker-id", "fleet-a.x1"), {})
    assert sub.resolved_worker_id() == "fleet-a.x1"
    for bad in ("fleet-a.", "fleet-a.x.y", "fleet-ax", "other.fleet-a"):
        with pytest.raises(ConfigError, match=f"worker_id {bad!r}.*tls_cert.*nor one of its "
                                              f"sub-ids"):
            load_config(WorkerConfig, worker_args(
                tmp_path, "--tls-cert", "worker-fleet-a", "--worker-id", bad), {})
    # The shared role certificate binds no id; without TLS nothing is checked.
    role = load_config(WorkerConfig, worker_args(tmp_path, "--worker-id", "x"), {})
    assert role.resolved_worker_id() == "x"
    insecure = load_config(WorkerConfig, worker_args(
        tmp_path, "--insecure", "--tls-cert", "worker-prefill-0", "--worker-id", "y"), {})
    assert insecure.resolved_worker_id() == "y"
    with pytest.raises(ConfigError, match="tls_cert.*worker-gone.pem"):
        load_config(WorkerConfig, worker_args(tmp_path, "--tls-cert", "worker-gone"), {})


async def test_the_local_actuator_enrolls_each_worker(tmp_path: Path) -> None:
    """Each worker the planner starts gets its own certificate and worker id; without the
    CA key nothing is started and the error says what is missing."""
    certs = tmp_path / "certs"
    write_mesh_certs(certs, ["admin", "worker"])  # the mesh secrets a worker needs
    fake = FakeSpawn()
    prepare = functools.partial(etcd_auth.enroll_worker, certs, "127.0.0.1:1", "ns")
    act = LocalActuator(tmp_path, {}, spawn_fn=fake, prepare=prepare)  # type: ignore[arg-type]
    await act.apply(decision(decode=1))
    (child,) = fake.children
    assert child.env["KVMESH_WORKER_ID"] == child.name == "planner-decode-1"
    assert child.env["KVMESH_TLS_CERT"] == "worker-planner-decode-1"
    pem = (certs / "worker-planner-decode-1.pem").read_bytes()
    assert identity_of(pem) == Identity("worker", "planner-decode-1")
    (certs / "ca-key.pem").unlink()
    fake2 = FakeSpawn()
    act2 = LocalActuator(tmp_path, {}, spawn_fn=fake2, prepare=prepare)  # type: ignore[arg-type]
    with pytest.raises(CertError, match="ca-key.pem"):
        await act2.apply(decision(prefill=1))
    assert fake2.children == []


def test_an_https_etcd_needs_certificates() -> None:
    with pytest.raises(ConfigError, match="etcd_endpoint 'https://e:1' is https"):
        load_config(WorkerConfig, ["--engine", "mock", "--etcd-endpoint", "https://e:1"], {})
