"""The sub-identity rule (:mod:`services.common.worker_ids`): which worker ids a worker
certificate may act as; worker instance certificates without a dot; and the mock fleet's
ids under TLS (its instance certificate's sub-ids; the shared certificate refused)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import ConfigError, load_config
from services.common.tls import CertError, issue, make_ca, write_mesh_certs
from services.common.worker_ids import may_act_as, sub_id
from workers.fleet import FleetConfig, fleet_prefix, worker_config


@pytest.mark.parametrize("worker_id", [
    "name", "name.0", "name.1", "name.a12", "name.fleet-a0", "name.x_y", "name.A-B_9"])
def test_accepted_ids(worker_id: str) -> None:
    assert may_act_as("name", worker_id)


@pytest.mark.parametrize("worker_id", [
    "name.",  # empty suffix
    "name.x.y",  # one level only: the owner of an id is the part before its first dot
    "namex", "name-0", "nam", "other.name", "other", "", ".name", "name..x",
    "name.x/y", "name.x y", "name.é", "NAME.0", "name.0\n"])
def test_refused_ids(worker_id: str) -> None:
    assert not may_act_as("name", worker_id)


def test_names_without_sub_ids() -> None:
    # the shared role certificate binds no id: it acts only as "worker"
    assert may_act_as("worker", "worker") and not may_act_as("worker", "worker.0")
    # a dotted name (issued before the rule) acts only as itself
    assert may_act_as("a.b", "a.b") and not may_act_as("a.b", "a.b.c")
    assert not may_act_as("", "") and not may_act_as("", ".0")


def test_sub_id_builds_or_names_the_suffix() -> None:
    assert sub_id("fleet", "a0") == "fleet.a0"
    for suffix in ("", "x.y", "x/y"):
        with pytest.raises(ValueError, match=f"suffix {suffix!r}"):
            sub_id("fleet", suffix)
    with pytest.raises(ValueError, match="shared 'worker'"):
        sub_id("worker", "a0")


def test_a_worker_instance_name_has_no_dot() -> None:
    ca, key = make_ca()
    with pytest.raises(CertError, match="'a.b'.*no '.'"):
        issue(ca, key, "worker", "a.b")
    issue(ca, key, "router", "r.1")  # other roles keep dotted names
    issue(ca, key, "worker", "a-b_0")


def fleet(certs: Path, *extra: str) -> FleetConfig:
    return load_config(FleetConfig, ["--tls-dir", str(certs), "--workers", "2", *extra], {})


def test_a_fleet_under_tls_uses_its_instance_certificates_sub_ids(tmp_path: Path) -> None:
    write_mesh_certs(tmp_path, ["router", "worker", "worker:fl"])
    cfg = fleet(tmp_path, "--tls-cert", "worker-fl")
    prefix = fleet_prefix(cfg)
    assert prefix == "fl."
    ids = [worker_config(cfg, i, r, prefix).worker_id for i, r in enumerate(cfg.roles())]
    assert ids == ["fl.a0", "fl.a1"] and all(may_act_as("fl", w) for w in ids)
    given = fleet(tmp_path, "--tls-cert", "worker-fl", "--worker-id", "m-")
    assert worker_config(given, 0, "agg", fleet_prefix(given)).worker_id == "fl.m-a0"
    for bad in ("fl.", "x.y", "a/b"):
        with pytest.raises(ConfigError, match=f"worker_id {bad!r}: under tls_cert"):
            fleet(tmp_path, "--tls-cert", "worker-fl", "--worker-id", bad)


def test_a_fleet_under_tls_refuses_the_shared_certificate(tmp_path: Path) -> None:
    write_mesh_certs(tmp_path, ["router", "worker"])
    with pytest.raises(ConfigError, match="tls_cert 'worker' is worker/worker: a fleet "
                                          "under TLS needs a worker instance certificate"):
        fleet(tmp_path)
    with pytest.raises(ConfigError, match="tls_cert 'router' is router/router"):
        fleet(tmp_path, "--tls-cert", "router")
    with pytest.raises(ConfigError, match="tls_cert: cannot read .*worker-gone.pem"):
        fleet(tmp_path, "--tls-cert", "worker-gone")


def test_without_tls_fleet_ids_are_unchanged(tmp_path: Path) -> None:
    write_mesh_certs(tmp_path, ["worker"])
    plain = load_config(FleetConfig, ["--worker-id", "x-"], {})
    assert fleet_prefix(plain) == "x-"
    assert worker_config(plain, 1, "agg", fleet_prefix(plain)).worker_id == "x-a1"
    assert fleet_prefix(load_config(FleetConfig, [], {})).startswith("mock-")
    insecure = fleet(tmp_path, "--insecure", "--worker-id", "y-")  # certificates off
    assert fleet_prefix(insecure) == "y-"
