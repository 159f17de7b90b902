"""The compose file is valid against the compose spec (validated offline) and wires the mesh."""

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_compose_file_matches_the_compose_spec() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
         str(ROOT / "docker-compose.yml")], capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_runs_every_service_from_one_image_on_loopback_ports() -> None:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = doc["services"]
    assert {"etcd", "redis", "jaeger", "router", "frontend", "worker"} <= set(services)
    for name in ("router", "frontend", "worker"):
        assert services[name]["image"] == "kvmesh:latest"
        assert services[name]["command"][:2] == ["kvmesh", name]
        env = services[name]["environment"]
        assert env["KVMESH_ETCD_ENDPOINT"] == "https://etcd:2379"
        assert env["KVMESH_REDIS_URL"] == "rediss://redis:6379"
        assert env["KVMESH_ADVERTISE_HOST"] == name
    for svc in services.values():
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), port
    assert (ROOT / "Dockerfile").read_text().count("FROM ") == 1


def test_compose_redis_keeps_an_append_only_file_on_a_volume() -> None:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    redis = doc["services"]["redis"]
    cmd = redis["command"]
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    assert cmd[cmd.index("--appendfsync") + 1] == "everysec"
    data = cmd[cmd.index("--dir") + 1]
    volume = next(v for v in redis["volumes"] if v.endswith(":" + data))
    assert volume.split(":")[0] in doc["volumes"]


def test_compose_makes_certificates_once_and_each_service_mounts_only_its_own() -> None:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = doc["services"]
    certs = services["certs"]
    script = certs["command"][-1]
    assert script.startswith("kvmesh certs --out /certs --identities /ids")
    roles = script.split("--roles ", 1)[1].split()[0].split(",")
    stems = {r.replace(":", "-") for r in roles}
    mounts = dict(v.split(":")[::-1] for v in certs["volumes"])  # target -> volume
    assert mounts["/certs"] == "mesh-certs"
    # only the one-shot jobs see the folder with the CA key
    assert {n for n, svc in services.items()
            if any(str(v).startswith("mesh-certs:") for v in svc.get("volumes", []))} == {
        "certs", "etcd-auth"}
    for name in ("indexer", "store-master", "router", "worker", "frontend", "etcd", "redis"):
        svc = services[name]
        (volume,) = [v for v in svc["volumes"] if v.startswith("id-")]
        source, target, mode = volume.split(":")
        assert (target, mode) == ("/certs", "ro") and source in doc["volumes"]
        stem = next(t for t, v in mounts.items() if v == source).removeprefix("/ids/")
        assert stem in stems, (name, stem)
        if name not in ("etcd", "redis"):
            assert svc["environment"]["KVMESH_TLS_DIR"] == "/certs"
            assert svc["environment"]["KVMESH_TLS_CERT"] == stem
            assert svc["depends_on"]["certs"]["condition"] == "service_completed_successfully"
            assert svc["depends_on"]["etcd-auth"]["condition"] == \
                "service_completed_successfully"
    assert services["worker"]["environment"]["KVMESH_TLS_CERT"].startswith("worker-")


def test_compose_etcd_and_redis_require_the_mesh_certificates() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    etcd = services["etcd"]["command"]
    assert "--client-cert-auth" in etcd and "--trusted-ca-file=/certs/ca.pem" in etcd
    assert "--listen-client-urls=https://0.0.0.0:2379" in etcd
    assert "etcd-data:/etcd-data" in services["etcd"]["volumes"]  # auth state is kept
    auth = services["etcd-auth"]
    assert auth["command"][:2] == ["kvmesh", "etcd-auth"]
    assert auth["depends_on"]["etcd"]["condition"] == "service_healthy"
    redis = services["redis"]["command"]
    for flag, value in (("--port", "0"), ("--tls-port", "6379"), ("--tls-auth-clients", "yes"),
                        ("--aclfile", "/certs/redis-users.acl"),
                        ("--tls-ca-cert-file", "/certs/ca.pem")):
        assert redis[redis.index(flag) + 1] == value


def test_compose_restarts_a_service_that_exits() -> None:
    """A worker whose engine died exits 3 for its supervisor: compose is that supervisor."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    long_running = {n for n in services if n not in ("certs", "etcd-auth", "jaeger")}
    assert {n for n in long_running
            if services[n].get("restart") != "unless-stopped"} == set()
