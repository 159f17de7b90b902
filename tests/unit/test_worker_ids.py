"""The sub-identity rule (:mod:`services.common.worker_ids`): which worker ids a worker
certificate may act as (sub-ids for a fleet certificate ``fleet[-<x>]`` only; a real
worker's certificate acts only as its exact name); worker instance certificates without a
dot; and the mock fleet's ids under TLS (its fleet certificate's sub-ids; the shared
certificate and a non-fleet instance certificate refused)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import ConfigError, load_config
from services.common.tls import CertError, issue, make_ca, write_mesh_certs
from services.common.worker_ids import has_sub_ids, may_act_as, sub_id
from workers.fleet import FleetConfig, fleet_prefix, worker_config


@pytest.mark.parametrize("worker_id", [
    "fleet-n", "fleet-n.0", "fleet-n.1", "fleet-n.a12", "fleet-n.fleet-a0", "fleet-n.x_y",
    "fleet-n.A-B_9"])
def test_accepted_ids(worker_id: str) -> None:
    assert may_act_as("fleet-n", worker_id)


@pytest.mark.parametrize("worker_id", [
    "fleet-n.",  # empty suffix
    "fleet-n.x.y",  # one level only: the owner of an id is the part before its first dot
    "fleet-nx", "fleet-n-0", "fleet-", "other.fleet-n", "other", "", ".fleet-n",
    "fleet-n..x", "fleet-n.x/y", "fleet-n.x y", "fleet-n.é", "FLEET-N.0", "fleet-n.0\n"])
def test_refused_ids(worker_id: str) -> None:
    assert not may_act_as("fleet-n", worker_id)


@pytest.mark.parametrize("name", ["fleet", "fleet-a", "fleet-mt", "fleet-x_1"])
def test_fleet_certificates_have_sub_ids(name: str) -> None:
    assert has_sub_ids(name) and may_act_as(name, f"{name}.a0")


@pytest.mark.parametrize("name", [
    "prefill-0", "decode-0", "w0", "planner-decode-1", "fl", "fleetx", "fleet-", "xfleet-a",
    "my-fleet-a", "FLEET-a", "fleet.a", "fleet-a.b", "worker", ""])
def test_every_other_worker_certificate_acts_only_as_its_name(name: str) -> None:
    """A real worker's certificate (``kvmesh up``'s ``decode-0``, compose's ``w0``) has
    no sub-ids: it may not register, or sign events for, ``<name>.<anything>``."""
    assert not has_sub_ids(name)
    assert may_act_as(name, name) == bool(name)
    for suffix in ("0", "fake", "a0", "x"):
        assert not may_act_as(name, f"{name}.{suffix}"), suffix


def test_names_without_sub_ids() -> None:
    # the shared role certificate binds no id: it acts only as "worker"
    assert may_act_as("worker", "worker") and not may_act_as("worker", "worker.0")
    # a dotted name (issued before the rule) acts only as itself
    assert may_act_as("fleet.b", "fleet.b") and not may_act_as("fleet.b", "fleet.b.c")
    assert not may_act_as("", "") and not may_act_as("", ".0")


def test_sub_id_builds_or_names_the_suffix() -> None:
    assert sub_id("fleet", "a0") == "fleet.a0"
    assert sub_id("fleet-a", "d3") == "fleet-a.d3"
    for suffix in ("", "x.y", "x/y"):
        with pytest.raises(ValueError, match=f"suffix {suffix!r}"):
            sub_id("fleet", suffix)
    for name in ("worker", "prefill-0"):
        with pytest.raises(ValueError, match="only a fleet certificate .*has sub-ids"):
            sub_id(name, "a0")


def test_a_worker_instance_name_has_no_dot() -> None:
    ca, key = make_ca()
    with pytest.raises(CertError, match="'a.b'.*no '.'"):
        issue(ca, key, "worker", "a.b")
    issue(ca, key, "router", "r.1")  # other roles keep dotted names
    issue(ca, key, "worker", "a-b_0")


def fleet(certs: Path, *extra: str) -> FleetConfig:
    return load_config(FleetConfig, ["--tls-dir", str(certs), "--workers", "2", *extra], {})


def test_a_fleet_under_tls_uses_its_fleet_certificates_sub_ids(tmp_path: Path) -> None:
    write_mesh_certs(tmp_path, ["router", "worker", "worker:fleet-fl"])
    cfg = fleet(tmp_path, "--tls-cert", "worker-fleet-fl")
    prefix = fleet_prefix(cfg)
    assert prefix == "fleet-fl."
    ids = [worker_config(cfg, i, r, prefix).worker_id for i, r in enumerate(cfg.roles())]
    assert ids == ["fleet-fl.a0", "fleet-fl.a1"]
    assert all(may_act_as("fleet-fl", w) for w in ids)
    given = fleet(tmp_path, "--tls-cert", "worker-fleet-fl", "--worker-id", "m-")
    assert worker_config(given, 0, "agg", fleet_prefix(given)).worker_id == "fleet-fl.m-a0"
    for bad in ("fl.", "x.y", "a/b"):
        with pytest.raises(ConfigError, match=f"worker_id {bad!r}: under tls_cert"):
            fleet(tmp_path, "--tls-cert", "worker-fleet-fl", "--worker-id", bad)


def test_a_fleet_under_tls_refuses_a_real_workers_certificate(tmp_path: Path) -> None:
    """``worker:prefill-0`` acts only as ``prefill-0``: no fleet may run on it."""
    write_mesh_certs(tmp_path, ["worker:prefill-0", "worker:fl"])
    for name in ("prefill-0", "fl"):
        with pytest.raises(ConfigError, match=(
                f"tls_cert 'worker-{name}' is worker/{name}, no fleet certificate: it acts "
                f"only as '{name}'.*issue a fleet certificate worker:fleet-<x> .*"
                f"kvmesh certs --roles worker:fleet-a")):
            fleet(tmp_path, "--tls-cert", f"worker-{name}")


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
