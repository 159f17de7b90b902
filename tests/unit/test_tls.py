"""Mesh certificates (:mod:`services.common.tls`) and the authorization table
(:mod:`services.common.authz`): the role read back from a generated certificate, a
certificate of another CA refused, ``kvmesh certs``, and who may call what."""

from __future__ import annotations

import stat
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from protos import (
    frontend_pb2,
    indexer_pb2,
    router_pb2,
    store_pb2,
    worker_pb2,
)
from services.common import authz, tls
from services.common.authz import POLICY, decide
from services.common.config import BaseConfig, ConfigError, load_config
from services.common.tls import (
    ROLES,
    CertError,
    Identity,
    MeshTls,
    channel_options,
    export_identity,
    identity_of,
    issue,
    make_ca,
    spiffe_id,
    tls_for,
    verify_signed_by,
    write_mesh_certs,
)
from services.launcher import cli


@pytest.fixture(scope="module")
def ca() -> tuple[bytes, bytes]:
    return make_ca()


@pytest.mark.parametrize("role", ROLES)
def test_the_role_is_read_back_from_a_generated_certificate(ca: tuple[bytes, bytes],
                                                            role: str) -> None:
    cert, key = issue(*ca, role, f"{role}-7")
    assert identity_of(cert) == Identity(role, f"{role}-7")
    assert b"PRIVATE KEY" in key
    verify_signed_by(cert, ca[0])


def test_a_certificate_of_another_ca_is_refused(ca: tuple[bytes, bytes]) -> None:
    other = make_ca("intruder CA")
    forged, _ = issue(*other, "admin")
    assert identity_of(forged).role == "admin"  # it claims the role ...
    with pytest.raises(CertError, match="not issued by this CA|bad signature"):
        verify_signed_by(forged, ca[0])  # ... but the mesh CA did not sign it


def test_unknown_roles_and_bad_names_are_refused(ca: tuple[bytes, bytes]) -> None:
    with pytest.raises(CertError, match="role: unknown 'root'"):
        issue(*ca, "root")
    with pytest.raises(CertError, match="name: "):
        issue(*ca, "worker", "a/b")
    with pytest.raises(CertError, match="not PEM"):
        identity_of(b"garbage")
    assert spiffe_id("router", "r1") == "spiffe://kvmesh/router/r1"


def test_write_mesh_certs_keeps_the_ca_and_existing_certificates(tmp_path: Path) -> None:
    written = write_mesh_certs(tmp_path, ["router", "worker:decode-0"])
    names = {p.name for p in written}
    assert names == {"ca.pem", "ca-key.pem", "router.pem", "router-key.pem",
                     "worker-decode-0.pem", "worker-decode-0-key.pem", "events.key",
                     "redis-router.pass", "redis-worker.pass", "worker-decode-0.evkey"}
    assert stat.S_IMODE((tmp_path / "router-key.pem").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "ca-key.pem").stat().st_mode) == 0o600
    ca_before = (tmp_path / "ca.pem").read_bytes()
    again = write_mesh_certs(tmp_path, ["router", "admin"])
    assert {p.name for p in again} == {"admin.pem", "admin-key.pem", "redis-admin.pass"}
    assert (tmp_path / "ca.pem").read_bytes() == ca_before
    tls = MeshTls.load(tmp_path, "worker-decode-0")
    assert tls.identity == Identity("worker", "decode-0")
    verify_signed_by((tmp_path / "admin.pem").read_bytes(), ca_before)


def test_load_names_the_missing_file(tmp_path: Path) -> None:
    write_mesh_certs(tmp_path, ["router"])
    with pytest.raises(CertError, match=r"missing .*indexer\.pem"):
        MeshTls.load(tmp_path, "indexer")


def test_config_tls_dir_insecure_and_tls_for(tmp_path: Path) -> None:
    assert tls_for(load_config(BaseConfig, [], {}), "router") is None
    with pytest.raises(ConfigError, match="tls_dir: .* has no ca.pem"):
        load_config(BaseConfig, ["--tls-dir", str(tmp_path)], {})
    write_mesh_certs(tmp_path, ["router"])
    cfg = load_config(BaseConfig, [], {"KVMESH_TLS_DIR": str(tmp_path)})
    tls = tls_for(cfg, "router")
    assert tls is not None and tls.identity.role == "router"
    insecure = load_config(BaseConfig, ["--insecure"], {"KVMESH_TLS_DIR": str(tmp_path)})
    assert tls_for(insecure, "router") is None


def test_kvmesh_certs_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["certs", "--out", str(tmp_path), "--roles", "frontend,admin"]) == 0
    assert "frontend.pem" in capsys.readouterr().out
    assert identity_of((tmp_path / "admin.pem").read_bytes()).role == "admin"
    assert cli.main(["certs", "--out", str(tmp_path), "--roles", "nobody"]) == 2
    assert "--roles: role: unknown 'nobody'" in capsys.readouterr().err
    assert cli.main(["certs", "--out", str(tmp_path / "all")]) == 0
    assert {p.name for p in (tmp_path / "all").glob("*-key.pem")} == {
        f"{r}-key.pem" for r in ("ca", *ROLES)}


def _who(role: str) -> Identity:
    return Identity(role, role)


def test_every_mesh_method_has_an_entry() -> None:
    for mod, service in ((worker_pb2, "Worker"), (router_pb2, "Router"),
                         (indexer_pb2, "Indexer"), (store_pb2, "StoreMaster"),
                         (frontend_pb2, "Frontend")):
        desc = mod.DESCRIPTOR.services_by_name[service]
        for m in desc.methods:
            method = f"/{desc.full_name}/{m.name}"
            assert method in POLICY, method
            assert POLICY[method], method


def test_a_certificate_names_its_role_as_a_server_and_old_ones_are_reissued(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_mesh_certs(tmp_path, ["router"])
    cert = x509.load_pem_x509_certificate((tmp_path / "router.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert names[:2] == ["router.kvmesh.mesh", "kvmesh.mesh"]
    assert channel_options("router") == [("grpc.ssl_target_name_override",
                                          "router.kvmesh.mesh")]
    assert channel_options() == [("grpc.ssl_target_name_override", "kvmesh.mesh")]
    assert write_mesh_certs(tmp_path, ["router"]) == []  # kept
    # a certificate issued before role server names existed is reissued
    with monkeypatch.context() as m:
        m.setattr(tls, "server_name", lambda role: "old.invalid")
        write_mesh_certs(tmp_path, ["indexer"])
    assert {p.name for p in write_mesh_certs(tmp_path, ["indexer"])} == {
        "indexer.pem", "indexer-key.pem"}


@pytest.mark.parametrize("role,name", [("worker", "router"), ("frontend", "admin"),
                                       ("worker", "root"), ("store_client", "etcd")])
def test_an_instance_cannot_take_a_reserved_name(role: str, name: str) -> None:
    ca, ca_key = make_ca()
    with pytest.raises(CertError, match=f"name: '{name}' is reserved"):
        issue(ca, ca_key, role, name)


def test_an_identity_folder_holds_only_its_own_files(tmp_path: Path) -> None:
    root, mine = tmp_path / "root", tmp_path / "w0"
    write_mesh_certs(root, ["worker:w0", "worker:w1", "indexer"])
    export_identity(root, mine, "worker-w0")
    assert {p.name for p in mine.iterdir()} == {
        "ca.pem", "worker-w0.pem", "worker-w0-key.pem", "worker-w0.evkey",
        "redis-worker.pass"}
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    assert stat.S_IMODE((mine / "worker-w0-key.pem").stat().st_mode) == 0o600
    assert stat.S_IMODE((mine / "ca.pem").stat().st_mode) == 0o644
    assert MeshTls.load(mine, "worker-w0").identity == Identity("worker", "w0")
    export_identity(root, tmp_path / "ix", "indexer")
    assert (tmp_path / "ix" / "events.key").read_bytes() == (root / "events.key").read_bytes()
    with pytest.raises(CertError, match="lacks worker-w9.pem"):
        export_identity(root, tmp_path / "x", "worker-w9")


def test_a_rewritten_key_file_is_private_whatever_its_old_mode(tmp_path: Path) -> None:
    write_mesh_certs(tmp_path, ["router"])
    key = tmp_path / "router-key.pem"
    key.chmod(0o644)
    write_mesh_certs(tmp_path, ["router"], force=True)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600


def test_the_frontend_api_is_public_everything_else_needs_a_certificate() -> None:
    assert decide("/kvmesh.frontend.Frontend/Generate", None) is None
    assert decide("/kvmesh.frontend.Frontend/ListModels", _who("worker")) is None
    for method in ("/grpc.health.v1.Health/Check", "/kvmesh.router.Router/Route"):
        verdict = decide(method, None)
        assert verdict is not None and verdict[0] == grpc.StatusCode.UNAUTHENTICATED
    # a user-facing port (no client certificates asked): health is public, the rest is not
    assert decide("/grpc.health.v1.Health/Check", None, user_facing=True) is None
    verdict = decide("/kvmesh.router.Router/Route", None, user_facing=True)
    assert verdict is not None and verdict[0] == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("method,allowed", [
    ("/kvmesh.worker.Worker/Generate", {"frontend"}),
    ("/kvmesh.worker.Worker/Abort", {"frontend"}),
    ("/kvmesh.router.Router/Route", {"frontend"}),
    ("/kvmesh.router.Router/Release", {"frontend"}),
    ("/kvmesh.router.Router/PrefillDone", {"frontend"}),
    ("/kvmesh.router.Router/ReportFailure", {"frontend"}),
    ("/kvmesh.worker.Worker/GetKvState", {"router", "indexer", "admin"}),
    ("/kvmesh.indexer.Indexer/FindMatches", {"router"}),
    ("/kvmesh.indexer.Indexer/Dump", {"admin"}),
    ("/kvmesh.store.StoreMaster/Remove", {"admin"}),
    ("/kvmesh.store.StoreMaster/RemoveAll", {"admin"}),
    ("/kvmesh.store.StoreMaster/MountSegment", {"worker", "store_client"}),
    ("/kvmesh.store.StoreMaster/UnmountSegment", {"worker", "store_client"}),
    ("/kvmesh.store.StoreMaster/PutStart", {"worker", "store_client"}),
    ("/grpc.health.v1.Health/Check", set(ROLES)),
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", set(ROLES)),
    ("/kvmesh.worker.Worker/NoSuchMethod", set()),
])
def test_the_table(method: str, allowed: set[str]) -> None:
    for role in ROLES:
        verdict = decide(method, _who(role))
        if role in allowed:
            assert verdict is None, (method, role)
        else:
            assert verdict is not None, (method, role)
            code, message = verdict
            assert code == grpc.StatusCode.PERMISSION_DENIED
            assert method in message and repr(role) in message


def test_no_certificate_is_unauthenticated() -> None:
    code, message = decide("/grpc.health.v1.Health/Check", None) or (None, "")
    assert code == grpc.StatusCode.UNAUTHENTICATED and "Health/Check" in message
    assert authz.identity_from_auth_context({}) is None
    assert authz.identity_from_auth_context({"x509_pem_cert": [b"junk"]}) is None
    assert authz.caller() is None  # outside an RPC


def test_the_vllm_store_connector_gets_the_workers_certificate(tmp_path: Path) -> None:
    from workers.config import WorkerConfig
    from workers.kv.configs import worker_kv_transfer
    from workers.kv.store.planner import StoreSettings

    write_mesh_certs(tmp_path, ["worker"])
    cfg = WorkerConfig(engine="vllm", model_path="/m", nixl_port=5999, worker_id="w1",
                       store_master="h:1", tls_dir=str(tmp_path))
    setup = worker_kv_transfer(cfg)
    assert setup.config is not None
    extra = setup.config["kv_connector_extra_config"]
    assert extra["tls_dir"] == str(tmp_path) and extra["tls_cert"] == "worker"
    tls = tls_for(StoreSettings.from_extra(extra), "worker")
    assert tls is not None and tls.identity.role == "worker"
    insecure = WorkerConfig(engine="vllm", model_path="/m", nixl_port=5999, worker_id="w1",
                            store_master="h:1", tls_dir=str(tmp_path), insecure=True)
    plain = worker_kv_transfer(insecure).config
    assert plain is not None and "tls_dir" not in plain["kv_connector_extra_config"]
