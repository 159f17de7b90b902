"""Planner's Kubernetes actuator against a MOCK API server (tests/unit/mock_k8s_api.py: a
real HTTP server on 127.0.0.1 that the official ``kubernetes`` client talks to, since no
API server can run here): the exact PATCH requests, idempotence, only the given
Deployments touched, 409 retried, 403 / 404 / other statuses / no server as clear errors,
the event loop left free, in-cluster (HTTPS, service account token) and kubeconfig
configuration, the planner's config checks, and one planner step that scales through it."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes.config import incluster_config

from services.common.config import ConfigError, load_config
from services.common.perf_model import PolynomialPerfModel
from services.common.procs import free_port
from services.common.tls import issue, make_ca
from services.planner.actuators import make_actuator
from services.planner.core import PlannerCore, ScalingDecision
from services.planner.kubernetes import (
    ApiUnreachable,
    DeploymentMissing,
    KubernetesActuator,
    KubernetesConfigError,
    KubernetesScaleError,
    ScaleChange,
    ScaleConflict,
    ScaleForbidden,
    load_client_configuration,
    required_rules,
    resolve_namespace,
)
from services.planner.main import PlannerConfig, PlannerLoop, build_actuator
from tests.unit.mock_k8s_api import MockKubeApi
from tests.unit.test_planner_service import FakeObserver, snap
from tests.waiting import wait_for

NS = "kvmesh"
SCALE = "/apis/apps/v1/namespaces/{}/deployments/{}/scale"
MAP = {"prefill": "kvmesh-prefill", "decode": "kvmesh-decode"}


def decision(**desired: int) -> ScalingDecision:
    return ScalingDecision(0.0, dict(desired), {}, {})


@pytest.fixture
def api() -> Iterator[MockKubeApi]:
    mock = MockKubeApi({(NS, "kvmesh-prefill"): 1, (NS, "kvmesh-decode"): 1,
                        (NS, "kvmesh-agg"): 5, (NS, "unrelated"): 3,
                        ("elsewhere", "kvmesh-prefill"): 1}).start()
    yield mock
    mock.stop()


def actuator(api: MockKubeApi, deployments: dict[str, str] = MAP,
             **kw: object) -> KubernetesActuator:
    act = make_actuator("kubernetes", deployments=deployments, namespace=NS,
                        configuration=api.configuration(), **kw)
    assert isinstance(act, KubernetesActuator)
    return act


def calls(api: MockKubeApi) -> list[tuple[str, str]]:
    return [(r.method, r.path) for r in api.requests]


async def test_patches_only_the_given_deployments_with_a_merge_patch(api: MockKubeApi) -> None:
    act = actuator(api)
    await act.apply(decision(prefill=3, decode=1, agg=0))
    # decode already has 1: read, not patched; agg has no Deployment given: not even read
    assert calls(api) == [("GET", SCALE.format(NS, "kvmesh-decode")),
                          ("GET", SCALE.format(NS, "kvmesh-prefill")),
                          ("PATCH", SCALE.format(NS, "kvmesh-prefill"))]
    (patch,) = api.patches()
    assert patch.content_type == "application/merge-patch+json"
    assert patch.body == {"spec": {"replicas": 3}}
    assert patch.query == "fieldManager=kvmesh-planner"
    assert act.changes == [ScaleChange("prefill", "kvmesh-prefill", NS, 1, 3)]
    assert api.deployments == {(NS, "kvmesh-prefill"): 3, (NS, "kvmesh-decode"): 1,
                               (NS, "kvmesh-agg"): 5, (NS, "unrelated"): 3,
                               ("elsewhere", "kvmesh-prefill"): 1}
    await act.close()
    await act.close()  # idempotent


async def test_the_same_decision_twice_patches_once(api: MockKubeApi) -> None:
    act = actuator(api)
    await act.apply(decision(prefill=2, decode=0))
    await act.apply(decision(prefill=2, decode=0))
    assert [(p.path, p.body) for p in api.patches()] == [
        (SCALE.format(NS, "kvmesh-decode"), {"spec": {"replicas": 0}}),
        (SCALE.format(NS, "kvmesh-prefill"), {"spec": {"replicas": 2}})]
    assert len(act.changes) == 2
    # someone scaled decode by hand: absolute counts bring it back
    api.deployments[(NS, "kvmesh-decode")] = 4
    await act.apply(decision(prefill=2, decode=0))
    assert act.changes[-1] == ScaleChange("decode", "kvmesh-decode", NS, 4, 0)
    assert len(api.patches()) == 3
    await act.close()


async def test_a_conflict_is_read_again_and_retried(api: MockKubeApi) -> None:
    api.fail("PATCH", NS, "kvmesh-prefill", 409, 409)
    act = actuator(api, {"prefill": "kvmesh-prefill"})
    await act.apply(decision(prefill=4))
    assert calls(api) == [("GET", SCALE.format(NS, "kvmesh-prefill")),
                          ("PATCH", SCALE.format(NS, "kvmesh-prefill"))] * 3
    assert api.deployments[(NS, "kvmesh-prefill")] == 4
    assert act.changes == [ScaleChange("prefill", "kvmesh-prefill", NS, 1, 4)]
    await act.close()


async def test_conflicts_past_the_retry_bound_are_an_error(api: MockKubeApi) -> None:
    api.fail("PATCH", NS, "kvmesh-prefill", 409, 409, 409)
    act = actuator(api, {"prefill": "kvmesh-prefill"}, conflict_retries=2)
    with pytest.raises(ScaleConflict, match="kvmesh-prefill.*3 tries.*modified") as err:
        await act.apply(decision(prefill=4))
    assert err.value.status == 409 and len(api.patches()) == 3
    assert api.deployments[(NS, "kvmesh-prefill")] == 1 and act.changes == []
    await act.close()


@pytest.mark.parametrize("verb", ["get", "patch"])
async def test_forbidden_names_the_verb_resource_deployment_namespace_and_rule(
        api: MockKubeApi, verb: str) -> None:
    api.forbid(verb, NS, "kvmesh-decode")
    act = actuator(api)
    with pytest.raises(ScaleForbidden) as err:
        await act.apply(decision(prefill=2, decode=3))
    msg = str(err.value)
    assert f"forbidden to {verb} deployments/scale of deployment 'kvmesh-decode' in " \
           f"namespace 'kvmesh' (pool decode)" in msg
    assert ('{apiGroups: ["apps"], resources: ["deployments/scale"], resourceNames: '
            '["kvmesh-decode"], verbs: ["get", "patch"]}') in msg
    assert 'cannot ' + verb + ' resource "deployments/scale"' in msg  # the server's words
    assert (err.value.status, err.value.deployment, err.value.namespace) == (
        403, "kvmesh-decode", NS)
    # documented: the other pools are still scaled; the forbidden one is not
    assert api.deployments[(NS, "kvmesh-prefill")] == 2
    assert api.deployments[(NS, "kvmesh-decode")] == 1
    assert act.changes == [ScaleChange("prefill", "kvmesh-prefill", NS, 1, 2)]
    await act.close()


async def test_a_missing_deployment_is_a_clear_error(api: MockKubeApi) -> None:
    act = actuator(api, {"prefill": "kvmesh-prefill", "decode": "no-such-deployment"})
    with pytest.raises(DeploymentMissing, match=r"no deployment 'no-such-deployment' in "
                       r"namespace 'kvmesh' \(pool decode\).*--k8s-deployments.*not found"):
        await act.apply(decision(prefill=1, decode=2))
    assert api.patches() == []
    await act.close()


async def test_another_status_is_an_error_with_the_servers_message(api: MockKubeApi) -> None:
    api.fail("PATCH", NS, "kvmesh-prefill", 500)
    act = actuator(api, {"prefill": "kvmesh-prefill"})
    with pytest.raises(KubernetesScaleError, match="patch deployments/scale of deployment "
                       "'kvmesh-prefill'.*failed with 500: injected failure 500") as err:
        await act.apply(decision(prefill=2))
    assert type(err.value) is KubernetesScaleError and act.changes == []
    await act.close()


async def test_an_unreachable_api_server_is_a_clear_error() -> None:
    port = free_port()  # a port nothing listens on
    host = f"http://127.0.0.1:{port}"
    act = KubernetesActuator(MAP, NS, k8s.Configuration(host=host), timeout_s=5)
    with pytest.raises(ApiUnreachable, match=f"cannot reach the Kubernetes API at {host} to "
                       f"get deployment 'kvmesh-decode'") as err:
        await act.apply(decision(prefill=2, decode=2))
    assert err.value.status == 0
    await act.close()


async def test_the_blocking_calls_leave_the_event_loop_free(api: MockKubeApi) -> None:
    api.hold_gets()
    act = actuator(api, {"prefill": "kvmesh-prefill"})
    task = asyncio.create_task(act.apply(decision(prefill=2)))
    # this coroutine runs while the actuator's GET is in flight
    await wait_for(lambda: api.held == 1, 10, "the actuator's GET to be held by the mock")
    assert not task.done()
    api.release()
    await asyncio.wait_for(task, 10)
    assert api.deployments[(NS, "kvmesh-prefill")] == 2
    await act.close()


def test_required_rules_are_get_and_patch_on_the_named_scales_only() -> None:
    assert required_rules(["kvmesh-decode", "kvmesh-prefill", "kvmesh-decode"]) == [{
        "apiGroups": ["apps"], "resources": ["deployments/scale"],
        "resourceNames": ["kvmesh-decode", "kvmesh-prefill"], "verbs": ["get", "patch"]}]


async def test_in_cluster_config_uses_the_service_account_over_https(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ca_cert, ca_key = make_ca()
    cert, key = issue(ca_cert, ca_key, "planner")
    for name, data in (("ca.crt", ca_cert), ("tls.pem", cert), ("tls-key.pem", key),
                       ("token", b"sa-token"), ("namespace", b"team-a\n")):
        (tmp_path / name).write_bytes(data)
    api = MockKubeApi({("team-a", "kvmesh-prefill"): 0},
                      tls=(tmp_path / "tls.pem", tmp_path / "tls-key.pem")).start()
    try:
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(api.port))
        monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
        monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(tmp_path / "ca.crt"))
        ns = resolve_namespace("", in_cluster_file=tmp_path / "namespace")
        assert ns == "team-a"
        act = KubernetesActuator({"prefill": "kvmesh-prefill"}, ns, load_client_configuration())
        await act.apply(decision(prefill=1))
        assert api.deployments[("team-a", "kvmesh-prefill")] == 1
        assert {r.authorization for r in api.requests} == {"bearer sa-token"}
        await act.close()
    finally:
        api.stop()


def test_without_a_pod_or_kubeconfig_there_is_no_config(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubernetesConfigError, match="not running in a pod.*--k8s-kubeconfig"):
        load_client_configuration()
    bad = tmp_path / "kubeconfig"
    bad.write_text("apiVersion: v1\nkind: Config\ncontexts: []\nclusters: []\nusers: []\n")
    with pytest.raises(KubernetesConfigError, match="cannot load kubeconfig"):
        load_client_configuration(str(bad))
    assert resolve_namespace("", in_cluster_file=tmp_path / "absent") == "default"
    assert resolve_namespace("given", in_cluster_file=tmp_path / "absent") == "given"


def write_kubeconfig(path: Path, host: str, namespace: str) -> None:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "mock",
        "clusters": [{"name": "mock", "cluster": {"server": host}}],
        "users": [{"name": "planner", "user": {"token": "kubeconfig-token"}}],
        "contexts": [{"name": "mock", "context": {"cluster": "mock", "user": "planner",
                                                  "namespace": namespace}},
                     {"name": "other", "context": {"cluster": "mock", "user": "planner"}}]}))


def test_planner_config_checks_the_kubernetes_flags(tmp_path: Path) -> None:
    base = ["--actuator", "kubernetes"]
    cfg = load_config(PlannerConfig, [*base, "--k8s-deployments", "prefill=p, decode=d"], {})
    assert cfg.k8s_map() == {"prefill": "p", "decode": "d"}
    env = {"KVMESH_K8S_DEPLOYMENTS": "agg=a", "KVMESH_K8S_NAMESPACE": "x"}
    cfg = load_config(PlannerConfig, [*base, "--mode", "agg"], env)
    assert cfg.k8s_map() == {"agg": "a"} and cfg.k8s_namespace == "x"
    for argv, problem in (
            (["--k8s-deployments", "prefill=p"], "no Deployment for pool(s) decode"),
            (["--k8s-deployments", "prefill=p,decode=d,encoder=e"], "no pool 'encoder'"),
            (["--k8s-deployments", "prefill"], "bad item 'prefill'"),
            (["--k8s-kubeconfig", str(tmp_path / "absent")], "is not a file"),
            (["--k8s-context", "c"], "k8s_context needs k8s_kubeconfig"),
            (["--k8s-timeout-s", "0"], "k8s_timeout_s must be > 0"),
            (["--k8s-conflict-retries", "-1"], "k8s_conflict_retries >= 0")):
        with pytest.raises(ConfigError, match=re.escape(problem)):
            load_config(PlannerConfig, [*base, *argv], {})
    # the other actuators ignore the k8s map, as they ignore the compose one
    load_config(PlannerConfig, ["--k8s-deployments", "prefill=p"], {})


async def test_a_planner_step_scales_the_deployments_through_a_kubeconfig(
        api: MockKubeApi, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    write_kubeconfig(kubeconfig, api.host, NS)
    cfg = load_config(PlannerConfig, [
        "--actuator", "kubernetes", "--k8s-kubeconfig", str(kubeconfig),
        "--throughput-interval-s", "0", "--load-interval-s", "5", "--min-prefill", "2"], {})
    act = build_actuator(cfg)  # default map; the context's namespace; disagg: no agg
    assert isinstance(act, KubernetesActuator) and act.namespace == NS
    assert act.deployments == MAP
    core = PlannerCore(cfg.settings(), PolynomialPerfModel())
    loop = PlannerLoop(core, FakeObserver([snap(0, 0)]), act, 5.0, clock=lambda: 0.0)
    d = await loop.step()  # no worker yet: desired = the minimums
    assert d.desired == {"prefill": 2, "decode": 1}
    assert [(p.path, p.body) for p in api.patches()] == [
        (SCALE.format(NS, "kvmesh-prefill"), {"spec": {"replicas": 2}})]
    assert {r.authorization for r in api.requests} == {"Bearer kubeconfig-token"}
    assert api.deployments[(NS, "kvmesh-agg")] == 5
    await act.close()
