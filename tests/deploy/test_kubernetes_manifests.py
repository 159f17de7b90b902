"""deploy/kubernetes, offline: every overlay renders with ``kubectl kustomize``, every
object validates against the Kubernetes schemas (``kubernetes-validate``, a fixed
version), and the cross-references hold (:func:`check`): Services select pods that exist
and name their ports, probes name real ports, every kvmesh server's readiness is the
kubelet's native ``grpc`` probe on its ``KVMESH_HEALTH_PORT`` (the plaintext health-only
port, its containerPort ``health``; the frontend's is HTTP ``/health``), the same with
security on and off, every Secret / ConfigMap a pod uses is made by the overlay or by the
README's certificate commands (which the test runs, with ``kubectl create`` in client
dry-run), every ``KVMESH_*`` variable is a field of the config class of the service it is
given to, commands are real ``kvmesh`` subcommands or modules, the planner's Role names
exactly the worker Deployments, servers bind and advertise the pod IP. A broken fixture
overlay (``fixtures/broken``, the real ``pd`` overlay with one fault per kind) proves each
check fails. Skipped, with the reason, only without kubectl. No cluster, no network (that
``--health-port`` serves grpc.health.v1 beside an mTLS port is
tests/integration/test_health_port.py's, on a real server).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from services.common.config import BaseConfig, env_name

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if p.is_dir())
BROKEN = Path(__file__).parent / "fixtures" / "broken"
K8S_VERSION = "1.30.0"  # grpc probes GA since 1.27, policy/v1 PDBs since 1.21
KUBECTL = os.environ.get("KVMESH_KUBECTL") or shutil.which("kubectl")  # another kubectl to try
pytestmark = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl is not installed (make system-deps installs Debian's "
                            "kubernetes-client)")

# Custom resources without a bundled schema, each with the fields it must have.
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"): ("selector", "endpoints")}
# The config class of each kvmesh process, by its command.
KVMESH_SUBCOMMANDS = {
    "worker": "workers.config:WorkerConfig", "router": "services.router.main:RouterConfig",
    "indexer": "services.indexer.main:IndexerConfig",
    "store-master": "services.store_master.main:StoreMasterConfig",
    "frontend": "services.frontend.main:FrontendConfig",
    "planner": "services.planner.main:PlannerConfig",
    "store-node": "workers.store_node:StoreNodeConfig",
}
MODULES = {"services.encoder": "services.encoder.main:EncoderConfig"}
# Subcommands of `kvmesh` itself (not services): their flags are argparse's.
KVMESH_TOOLS = ("etcd-auth", "certs")
# Variables that are not kvmesh config fields, and who reads them.
OTHER_ENV = {
    "POD_IP": "the manifests' own $(POD_IP) expansions",
    "POD_NAME": "the manifests' own $(POD_NAME) expansions",
    "UCX_TLS": "UCX", "UCX_NET_DEVICES": "UCX",
    "VLLM_HOST_IP": "vLLM", "VLLM_NIXL_SIDE_CHANNEL_HOST": "vLLM's NIXL connector",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "services/common/telemetry.py",
    "OTEL_EXPORTER_OTLP_INSECURE": "the OTLP exporter",
    "COLLECTOR_OTLP_ENABLED": "Jaeger",
}
WILDCARDS = ("0.0.0.0", "::", "[::]", "*")


def render(path: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize path`` as objects (stderr: kustomize v5's deprecation notes)."""
    assert KUBECTL is not None
    proc = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"kubectl kustomize {path} failed: {proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def schema_problems(objs: list[dict[str, Any]]) -> list[str]:
    out = []
    for obj in objs:
        kind = (obj.get("apiVersion"), obj.get("kind"))
        name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        if kind in CRDS:
            out += [f"{name}: no spec.{f}" for f in CRDS[kind] if f not in obj.get("spec", {})]
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            out.append(f"{name}: schema: {'.'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError:
            out.append(f"{name}: no schema for {kind} in Kubernetes {K8S_VERSION}")
    return out


def _cls(spec: str) -> type[BaseConfig]:
    mod, name = spec.split(":")
    cls: type[BaseConfig] = getattr(importlib.import_module(mod), name)
    return cls


def config_class(command: list[str]) -> tuple[type[BaseConfig] | None, str]:
    """The config class a container command runs, or (None, problem); (None, "") for a
    non-kvmesh image's command or a kvmesh tool."""
    if command[:1] == ["kvmesh"]:
        sub = command[1] if len(command) > 1 else ""
        if sub in KVMESH_SUBCOMMANDS:
            return _cls(KVMESH_SUBCOMMANDS[sub]), ""
        if sub in KVMESH_TOOLS:
            return None, ""
        return None, f"`kvmesh {sub}` is not a kvmesh subcommand"
    if command[:2] == ["python", "-m"]:
        mod = command[2]
        if importlib.util.find_spec(mod + ".__main__") is None:
            return None, f"`python -m {mod}` has no __main__"
        if mod not in MODULES:
            return None, f"`python -m {mod}`: no config class known to this test"
        return _cls(MODULES[mod]), ""
    return None, f"command {command[:3]} is neither `kvmesh <x>` nor `python -m services.<x>`"


def pod_templates(objs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template) of every Deployment, StatefulSet and Job."""
    return [(o, o["spec"]["template"]) for o in objs
            if o["kind"] in ("Deployment", "StatefulSet", "Job")]


def is_kvmesh(container: dict[str, Any]) -> bool:
    """Whether the container runs the kvmesh image (any registry, any tag)."""
    return str(container.get("image", "")).rsplit("/", 1)[-1].split(":")[0] == "kvmesh"


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def env_of(container: dict[str, Any], configmaps: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's environment: its envFrom ConfigMaps, then env (fieldRefs as
    ``<fieldRef:path>``)."""
    out: dict[str, str] = {}
    for src in container.get("envFrom", []):
        if "configMapRef" in src:
            out.update(configmaps.get(src["configMapRef"]["name"], {}))
    for e in container.get("env", []):
        ref = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        out[e["name"]] = f"<fieldRef:{ref}>" if ref else str(e.get("value", ""))
    return out


def _probe_ports(container: dict[str, Any]) -> list[tuple[str, Any, str]]:
    out = []
    for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
        probe = container.get(kind)
        if probe is None:
            continue
        handlers = [h for h in ("exec", "httpGet", "tcpSocket", "grpc") if h in probe]
        if len(handlers) != 1:
            out.append((kind, None, f"has handlers {handlers}, wants exactly one"))
        for h in ("httpGet", "tcpSocket", "grpc"):
            if h in probe:
                out.append((kind, probe[h]["port"], h))
    return out


def check(objs: list[dict[str, Any]], secrets: dict[str, set[str]] | None = None,
          ) -> list[str]:
    """Every cross-reference problem of a rendered overlay (empty: none). ``secrets`` are
    Secrets made outside the overlay (the README's), name → keys."""
    problems: list[str] = []
    secrets = dict(secrets or {})
    for o in objs:
        if o["kind"] == "Secret":
            secrets[o["metadata"]["name"]] = set(o.get("data", {})) | set(o.get("stringData", {}))
    configmaps = {o["metadata"]["name"]: {k: str(v) for k, v in o.get("data", {}).items()}
                  for o in objs if o["kind"] == "ConfigMap"}
    templates = pod_templates(objs)
    problems += [f"{o['kind']}/{o['metadata']['name']}: namespace "
                 f"{o['metadata'].get('namespace')!r}, not kvmesh (README creates kvmesh)"
                 for o in objs if o["metadata"].get("namespace") != "kvmesh"]
    problems += [f"{o['kind']}/{o['metadata']['name']}: no label app.kubernetes.io/part-of"
                 for o in objs if "app.kubernetes.io/part-of" not in o["metadata"].get(
                     "labels", {})]
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}

    # Services: a selector matching some pod, ports that pod has
    for svc in (o for o in objs if o["kind"] == "Service"):
        sel = svc["spec"].get("selector", {})
        pods = [t for _, t in templates if selects(sel, t["metadata"].get("labels", {}))]
        if not pods:
            problems.append(f"Service/{svc['metadata']['name']}: selector {sel} matches no pod")
            continue
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            have = [p for t in pods for c in t["spec"]["containers"]
                    for p in c.get("ports", [])
                    if p.get("name") == target or p["containerPort"] == target]
            if not have:
                problems.append(f"Service/{svc['metadata']['name']}: targetPort {target!r} "
                                f"is no container port of its pods")
    for pdb in (o for o in objs if o["kind"] == "PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        if not any(selects(sel, t["metadata"].get("labels", {})) for _, t in templates):
            problems.append(f"PodDisruptionBudget/{pdb['metadata']['name']}: selects no pod")

    workers = sorted(w["metadata"]["name"] for w, t in templates
                     if t["metadata"].get("labels", {}).get("app.kubernetes.io/component")
                     == "worker")
    for w, t in templates:
        wname = f"{w['kind']}/{w['metadata']['name']}"
        spec = t["spec"]
        sel = w["spec"].get("selector", {}).get("matchLabels")
        if sel is not None and not selects(sel, t["metadata"].get("labels", {})):
            problems.append(f"{wname}: selector {sel} does not match its template")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        volumes.update({v["metadata"]["name"]: {"persistentVolumeClaim": True}
                        for v in w["spec"].get("volumeClaimTemplates", [])})
        sa = spec.get("serviceAccountName")
        if sa and ("ServiceAccount", sa) not in names:
            problems.append(f"{wname}: ServiceAccount {sa} is not in the overlay")
        for v in volumes.values():
            if "secret" in v and v["secret"]["secretName"] not in secrets:
                problems.append(f"{wname}: Secret {v['secret']['secretName']} is made neither "
                                f"by the overlay nor by the README")
            if "configMap" in v and v["configMap"]["name"] not in configmaps:
                problems.append(f"{wname}: ConfigMap {v['configMap']['name']} is not made")
        grace = spec.get("terminationGracePeriodSeconds", 30)
        for c in spec["containers"]:
            cname = f"{wname}/{c['name']}"
            for src in c.get("envFrom", []):
                ref = src.get("configMapRef", {}).get("name")
                if ref and ref not in configmaps:
                    problems.append(f"{cname}: envFrom ConfigMap {ref} is not made")
            env = env_of(c, configmaps)
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            for kind, port, how in _probe_ports(c):
                if port is None:
                    problems.append(f"{cname}: {kind} {how}")
                elif port not in ports and port not in ports.values():
                    problems.append(f"{cname}: {kind} {how} port {port!r} is no container port")
                if how == "grpc" and port is not None:
                    problems += _check_grpc_probe(f"{cname}: {kind}", port, env, ports)
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes:
                    problems.append(f"{cname}: volumeMount {m['name']} has no volume")
            # $(VAR) only of variables defined before
            defined: list[str] = []
            for e in c.get("env", []):
                for ref in re.findall(r"\$\((\w+)\)", str(e.get("value", ""))):
                    if ref not in defined:
                        problems.append(f"{cname}: env {e['name']} uses $({ref}), not defined "
                                        f"before it")
                defined.append(e["name"])
            for arg in [*c.get("command", []), *c.get("args", [])]:
                for ref in re.findall(r"\$\((\w+)\)", str(arg)):
                    if ref not in env:
                        problems.append(f"{cname}: command uses $({ref}), not in its env")
            # files under /certs the container names exist in its Secret
            secret_keys = None
            if "/certs" in mounts and "secret" in volumes.get(mounts["/certs"], {}):
                secret_keys = secrets.get(volumes[mounts["/certs"]]["secret"]["secretName"])
            wanted = set(re.findall(r"/certs/([\w.-]+)", " ".join(
                map(str, [*c.get("command", []), *c.get("args", []),
                          *(c.get("readinessProbe", {}).get("exec", {}).get("command", []))]))))
            command = [str(x) for x in c.get("command", [])]
            cls, problem = config_class(command) if is_kvmesh(c) else (None, "")
            if problem:
                problems.append(f"{cname}: {problem}")
            if cls is not None:
                problems += _check_kvmesh_env(cname, cls, env, mounts, secret_keys, wanted,
                                              grace, c)
            if secret_keys is not None:
                problems += [f"{cname}: /certs/{f} is not in its Secret"
                             for f in sorted(wanted - secret_keys)]
            if not is_kvmesh(c):
                continue
            if not c.get("resources", {}).get("requests"):
                problems.append(f"{cname}: no resource requests")

    # the planner's Role: exactly the worker Deployments, and the planner's own map
    roles = [o for o in objs if o["kind"] == "Role"]
    for role in roles:
        for rule in role["rules"]:
            if sorted(rule.get("resourceNames", [])) != workers:
                problems.append(f"Role/{role['metadata']['name']}: resourceNames "
                                f"{sorted(rule.get('resourceNames', []))} != worker "
                                f"Deployments {workers}")
            if rule.get("resources") != ["deployments/scale"] or sorted(rule["verbs"]) != [
                    "get", "patch"]:
                problems.append(f"Role/{role['metadata']['name']}: more than get/patch on "
                                f"deployments/scale: {rule}")
    for rb in (o for o in objs if o["kind"] == "RoleBinding"):
        if ("Role", rb["roleRef"]["name"]) not in names:
            problems.append(f"RoleBinding/{rb['metadata']['name']}: no Role {rb['roleRef']}")
        for s in rb["subjects"]:
            if ("ServiceAccount", s["name"]) not in names:
                problems.append(f"RoleBinding/{rb['metadata']['name']}: no ServiceAccount "
                                f"{s['name']}")
    for _, t in templates:
        for c in t["spec"]["containers"]:
            env = env_of(c, configmaps)
            if env.get("KVMESH_ACTUATOR") == "kubernetes":
                mapped = sorted(item.partition("=")[2] for item in
                                env.get("KVMESH_K8S_DEPLOYMENTS", "").split(",") if item)
                if mapped != workers:
                    problems.append(f"planner: KVMESH_K8S_DEPLOYMENTS {mapped} != worker "
                                    f"Deployments {workers}")
                if not roles:
                    problems.append("planner: the kubernetes actuator has no Role")
    return problems


def _check_grpc_probe(where: str, port: Any, env: dict[str, str],
                      ports: dict[str | None, int]) -> list[str]:
    """The kubelet's ``grpc`` probe speaks plaintext and presents no client certificate,
    so it must dial the server's health-only port: ``KVMESH_HEALTH_PORT``, which the
    container declares as its containerPort ``health`` (services/common/server.py)."""
    health = env.get("KVMESH_HEALTH_PORT")
    if health is None:
        return [f"{where} grpc port {port!r}, but no KVMESH_HEALTH_PORT: nothing serves "
                f"grpc.health.v1 in plaintext there"]
    out = []
    if not health.isdigit() or int(health) != port:
        mesh = " (the mesh port: mTLS, the kubelet has no certificate)" if str(port) == env.get(
            "KVMESH_PORT") else ""
        out.append(f"{where} grpc port {port!r} is not its KVMESH_HEALTH_PORT {health}{mesh}")
    if ports.get("health") != port:
        out.append(f"{where} grpc port {port!r} is not its containerPort named health "
                   f"({ports.get('health')})")
    return out


def _check_kvmesh_env(cname: str, cls: type[BaseConfig], env: dict[str, str],
                      mounts: dict[str, str], secret_keys: set[str] | None,
                      wanted: set[str], grace: int, c: dict[str, Any]) -> list[str]:
    """A kvmesh process's variables, addresses, identity files and shutdown timing;
    adds the identity's files to ``wanted``."""
    from services.common.tls import ROLE_SECRETS

    out = []
    fields = {env_name(f.name) for f in dataclasses.fields(cls)
              if f.metadata.get("flag", True)}
    for name in env:
        if name.startswith("KVMESH_") and name not in fields:
            out.append(f"{cname}: {name} is no flag of {cls.__name__}")
        elif not name.startswith("KVMESH_") and name not in OTHER_ENV:
            out.append(f"{cname}: {name} is read by nothing this test knows")
    for var in ("KVMESH_HOST", "KVMESH_ADVERTISE_HOST", "KVMESH_HTTP_HOST"):
        value = env.get(var, "")
        if value in WILDCARDS:
            out.append(f"{cname}: {var}={value} binds a wildcard")
    if env.get("KVMESH_HOST") != "$(POD_IP)":
        out.append(f"{cname}: KVMESH_HOST must be $(POD_IP), got {env.get('KVMESH_HOST')!r}")
    if env.get("KVMESH_ADVERTISE_HOST") != "$(POD_IP)":
        out.append(f"{cname}: KVMESH_ADVERTISE_HOST must be $(POD_IP)")
    if env.get("POD_IP") != "<fieldRef:status.podIP>":
        out.append(f"{cname}: POD_IP must come from the downward API status.podIP")
    port = env.get("KVMESH_PORT")
    ports = {p["containerPort"] for p in c.get("ports", [])}
    if port is None or int(port) not in ports:
        out.append(f"{cname}: KVMESH_PORT {port} is no container port")
    for var in ("KVMESH_METRICS_PORT", "KVMESH_NIXL_PORT", "KVMESH_HTTP_PORT",
                "KVMESH_HEALTH_PORT"):
        if var in env and int(env[var]) not in ports:
            out.append(f"{cname}: {var} {env[var]} is no container port")
    ready = set(c.get("readinessProbe", {}))
    if not ready & {"grpc", "httpGet"}:
        out.append(f"{cname}: readiness is neither the kubelet's grpc probe (on "
                   f"KVMESH_HEALTH_PORT) nor HTTP /health: {sorted(ready)}")
    secure = env.get("KVMESH_INSECURE", "") not in ("1", "true") and env.get("KVMESH_TLS_DIR")
    if secure:
        if env["KVMESH_TLS_DIR"] not in mounts:
            out.append(f"{cname}: KVMESH_TLS_DIR {env['KVMESH_TLS_DIR']} is not mounted")
        stem = env.get("KVMESH_TLS_CERT", "")
        if not stem:
            out.append(f"{cname}: no KVMESH_TLS_CERT")
        wanted |= {"ca.pem", f"{stem}.pem", f"{stem}-key.pem"}
        role = stem.split("-")[0] if stem.startswith("worker-") else stem
        wanted |= {s.format(stem=stem) for s in ROLE_SECRETS.get(role, ())}
        if secret_keys is None:
            out.append(f"{cname}: mTLS without a Secret at /certs")
    elif "/certs" in mounts:
        out.append(f"{cname}: security off, yet a Secret is mounted")
    grace_s = float(env.get("KVMESH_GRACE_S", "5"))
    sleep = 0.0
    pre = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    if pre[:1] == ["sleep"]:
        sleep = float(pre[1])
    if grace <= grace_s + sleep + 5:
        out.append(f"{cname}: terminationGracePeriodSeconds {grace} leaves no room for "
                   f"preStop {sleep} s + KVMESH_GRACE_S {grace_s} s + exit")
    return out


@pytest.fixture(scope="module")
def readme_secrets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """Runs the README's certificate block (real `kvmesh certs`; `kubectl create` in
    client dry-run, no cluster) and returns the Secrets it makes, name → keys."""
    block = next(b for b in readme_blocks() if "kvmesh certs" in b)
    work = tmp_path_factory.mktemp("readme-certs")
    out = work / "created.yaml"
    kvmesh = Path(sys.executable).with_name("kvmesh")
    shim = (f'kvmesh() {{ "{kvmesh}" "$@"; }}\n'
            f'kubectl() {{ [ "$1" = create ] || {{ echo "not checked: kubectl $*" >&2; '
            f'return 9; }}; "{KUBECTL}" "$@" --dry-run=client -o yaml >> "{out}" && '
            f'echo --- >> "{out}"; }}\nset -euo pipefail\n')
    proc = subprocess.run(["bash", "-c", shim + block], cwd=work, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "HOME": str(work)})
    assert proc.returncode == 0, proc.stderr
    made = [d for d in yaml.safe_load_all(out.read_text()) if d]
    return {d["metadata"]["name"]: set(d.get("data", {})) for d in made if d["kind"] == "Secret"}


def readme_section() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^## Kubernetes\n(.*?)(?=^## )", text, re.S | re.M)
    assert m, "README.md has no '## Kubernetes' section"
    return m.group(1)


def readme_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", readme_section(), re.S)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay: str) -> None:
    objs = render(DEPLOY / "overlays" / overlay)
    assert objs
    assert schema_problems(objs) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_cross_references(overlay: str, readme_secrets: dict[str, set[str]]) -> None:
    objs = render(DEPLOY / "overlays" / overlay)
    assert check(objs, readme_secrets) == []
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert ("ServiceAccount", "kvmesh-planner") in kinds and ("Role", "kvmesh-planner") in kinds
    for want in ("kvmesh-frontend", "kvmesh-router", "kvmesh-indexer", "kvmesh-store-master"):
        assert ("Deployment", want) in kinds and ("Service", want) in kinds
    assert (("StatefulSet", "etcd") in kinds) == (overlay != "external-etcd")
    # readiness: the kubelet's grpc probe on the health port; the frontend's HTTP /health
    ready = {w["metadata"]["name"]: set(c["readinessProbe"]) & {"grpc", "httpGet", "exec"}
             for w, t in pod_templates(objs) for c in t["spec"]["containers"]
             if is_kvmesh(c) and "readinessProbe" in c}
    assert ready.pop("kvmesh-frontend") == {"httpGet"}
    assert ready and all(r == {"grpc"} for r in ready.values()), ready
    if overlay == "insecure":
        assert not any(v.get("secret") for _, t in pod_templates(objs)
                       for v in t["spec"].get("volumes", []))
        # security off changes no kvmesh probe: mTLS and plaintext use the same
        assert probes(objs) == probes(render(DEPLOY / "overlays" / "pd"))


def probes(objs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Every kvmesh container's probes, by (workload, container)."""
    return {(w["metadata"]["name"], c["name"]): {k: c.get(k) for k in (
                "readinessProbe", "livenessProbe", "startupProbe")}
            for w, t in pod_templates(objs) for c in t["spec"]["containers"]
            if is_kvmesh(c) and "readinessProbe" in c}


def test_worker_pools_and_their_identities(tmp_path: Path) -> None:
    """Each overlay's pools are separate Deployments; a pool's pods act as sub-ids of the
    pool's fleet certificate, which the real WorkerConfig accepts (and the planner's
    required_rules equal the Role)."""
    from services.common.tls import write_mesh_certs
    from workers.config import WorkerConfig

    pools = {"pd": ["kvmesh-decode", "kvmesh-prefill"], "agg": ["kvmesh-agg"],
             "epd": ["kvmesh-decode", "kvmesh-prefill"]}
    write_mesh_certs(tmp_path, ["worker:fleet-prefill", "worker:fleet-decode",
                                "worker:fleet-agg"])
    for overlay, want in pools.items():
        objs = render(DEPLOY / "overlays" / overlay)
        workers = [w for w, t in pod_templates(objs)
                   if t["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"]
        assert sorted(w["metadata"]["name"] for w in workers) == want
        for w in workers:
            env = env_of(w["spec"]["template"]["spec"]["containers"][0], {})
            pod = f"{w['metadata']['name']}-5d8f9c7b6d-x2k4p"
            cfg = WorkerConfig(tls_dir=str(tmp_path), tls_cert=env["KVMESH_TLS_CERT"],
                               worker_id=env["KVMESH_WORKER_ID"].replace("$(POD_NAME)", pod),
                               role=env["KVMESH_ROLE"], model_path="smollm2")
            assert not [p for p in cfg.problems() if "worker_id" in p or "tls_cert" in p]
        role = next(o for o in objs if o["kind"] == "Role")
        planner = pytest.importorskip("services.planner.kubernetes",
                                      reason="the planner's kubernetes actuator is absent")
        assert role["rules"] == planner.required_rules(want)


def test_broken_fixture_is_caught(readme_secrets: dict[str, set[str]]) -> None:
    """The real pd overlay with one fault of each kind: every check fires."""
    objs = render(BROKEN)
    problems = check(objs, readme_secrets) + schema_problems(objs)
    text = "\n".join(problems)
    for expected in (
        "Service/kvmesh-router: selector",                  # selector matches no pod
        "Service/kvmesh-frontend: targetPort 'htttp'",      # a port the pod lacks
        "readinessProbe grpc port 50052 is no container port",  # a probe on no port
        "store-master: readinessProbe grpc port 50051 is not its KVMESH_HEALTH_PORT 8081 "
        "(the mesh port",                                   # a grpc probe on the mTLS port
        "planner: readinessProbe grpc port 8081, but no KVMESH_HEALTH_PORT",  # not served
        "Secret kvmesh-id-nobody is made neither",          # a Secret nobody makes
        "KVMESH_ADVERTISED_HOST is no flag of WorkerConfig",  # a misspelt variable
        "`kvmesh routr` is not a kvmesh subcommand",        # a misspelt subcommand
        "Role/kvmesh-planner: resourceNames",               # RBAC beyond the pools
        "KVMESH_HOST=0.0.0.0 binds a wildcard",             # a wildcard bind
        "Deployment/kvmesh-indexer: schema",                # a schema violation
        "/certs/missing.pem is not in its Secret",           # a file the Secret lacks
        "terminationGracePeriodSeconds 10",                 # no time to drain
    ):
        assert expected in text, f"{expected!r} not caught; problems:\n{text}"


def test_readme_commands_are_rendered_or_checked(readme_secrets: dict[str, set[str]]) -> None:
    """Every command of the README's Kubernetes section: the certificate block ran (the
    fixture); the rest are renders, scales and rollouts of rendered objects, or the image
    the base names."""
    base = yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text())
    image = base["images"][0]
    names = {f"{o['kind']}/{o['metadata']['name']}" for ov in OVERLAYS
             for o in render(DEPLOY / "overlays" / ov)}
    applied, tags = [], []
    for block in readme_blocks():
        if "kvmesh certs" in block:
            continue
        for line in block.splitlines():
            line = line.split("#")[0].strip()
            if not line:
                continue
            if m := re.fullmatch(r"kubectl apply -k (\S+)", line):
                applied.append(m.group(1))
                render(ROOT / m.group(1))
            elif m := re.fullmatch(r"kubectl -n kvmesh (?:scale|rollout status) "
                                   r"deployment/(\S+)(?: --replicas=\d+)?", line):
                assert f"Deployment/{m.group(1)}" in names, line
            elif m := re.fullmatch(r"docker (?:build -t (\S+) \.|push (\S+))", line):
                tags.append(m.group(1) or m.group(2))
            else:
                pytest.fail(f"README command not checked by this test: {line}")
    assert applied and all(Path(ROOT / a).resolve().parent == DEPLOY / "overlays"
                           for a in applied)
    for inline in re.findall(r"`(kubectl apply -k [^`]+)`", readme_section()):
        render(ROOT / inline.split()[-1])  # the prose's install commands render too
    for ov in OVERLAYS:  # each overlay is in the README's table
        assert f"| `{ov}` |" in readme_section(), ov
    assert tags[0] == f"{image['newName']}:{image['newTag']}"
    assert all(t.rsplit(":", 1)[0] == image["newName"] for t in tags)
    assert {"kvmesh-id-etcd-auth", "kvmesh-id-worker-fleet-decode"} <= set(readme_secrets)
    assert "ca-key.pem" not in set().union(*readme_secrets.values())
    assert "Validated offline" in readme_section()


def test_worker_nixl_env_follows_the_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.config import WorkerConfig
    from workers.kv.configs import worker_kv_transfer

    monkeypatch.setenv("UCX_NET_DEVICES", "eth0")
    cfg = WorkerConfig(role="decode", model_path="smollm2", host="10.1.2.3",
                       advertise_host="10.1.2.3", nixl_port=5600)
    env = worker_kv_transfer(cfg).env
    assert env.get("VLLM_NIXL_SIDE_CHANNEL_HOST") == "10.1.2.3"
    assert env.get("UCX_NET_DEVICES", "eth0") == "eth0"
