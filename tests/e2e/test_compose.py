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
        assert env["KVMESH_ETCD_ENDPOINT"] == "etcd:2379"
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


def test_compose_makes_certificates_once_and_every_kvmesh_service_uses_them() -> None:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = doc["services"]
    certs = services["certs"]
    assert certs["command"] == ["kvmesh", "certs", "--out", "/certs"]
    assert certs["volumes"] == ["mesh-certs:/certs"] and "mesh-certs" in doc["volumes"]
    for name in ("indexer", "store-master", "router", "worker", "frontend"):
        svc = services[name]
        assert svc["environment"]["KVMESH_TLS_DIR"] == "/certs"
        assert "mesh-certs:/certs:ro" in svc["volumes"]
        assert svc["depends_on"]["certs"]["condition"] == "service_completed_successfully"


def test_compose_restarts_a_service_that_exits() -> None:
    """A worker whose engine died exits 3 for its supervisor: compose is that supervisor."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    long_running = {n for n in services if n not in ("certs", "jaeger")}
    assert {n for n in long_running
            if services[n].get("restart") != "unless-stopped"} == set()
