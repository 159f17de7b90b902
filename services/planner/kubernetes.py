"""Planner actuator for Kubernetes: one Deployment per pool, scaled through its scale subresource.

Contract of :class:`KubernetesActuator` (an :class:`~services.planner.actuators.Actuator`):

- ``deployments`` maps pool → Deployment name (``--k8s-deployments
  prefill=kvmesh-prefill,decode=kvmesh-decode``), all in one ``namespace``. Only those
  Deployments are ever read or written, and only their ``scale`` subresource; a pool of a
  decision that has no entry is left alone (the planner's config refuses a mode whose pools
  are not all mapped, and pools the planner does not have, such as ``encoder``).
- ``async apply(decision)``: for every mapped pool of ``decision.desired``, in pool-name
  order, reads the scale (``GET /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale``)
  and, only when ``spec.replicas`` differs from the desired count N, sends ``PATCH`` on the
  same path with ``Content-Type: application/merge-patch+json``, the query
  ``fieldManager=kvmesh-planner`` (the cluster's managedFields name the planner as the
  writer of ``spec.replicas``) and the body ``{"spec": {"replicas": N}}`` (the patch
  ``kubectl scale`` sends). Counts are absolute:
  applying a decision twice patches nothing the second time. The patch carries no
  ``resourceVersion`` precondition: the planner's count wins over a concurrent change, as
  ``kubectl scale`` without ``--current-replicas`` does.
- Every patch that succeeded is appended to ``changes`` as a :class:`ScaleChange`
  (pool, deployment, namespace, from, to) and logged.
- Errors (each a :class:`KubernetesScaleError` naming pool, Deployment and namespace):
  409 Conflict → the scale is read again and, when it still differs, patched again, at
  most ``conflict_retries`` more times, then :class:`ScaleConflict`; 403 →
  :class:`ScaleForbidden`, naming the verb, the resource, the Deployment, the namespace and
  the Role rule the planner's service account lacks; 404 → :class:`DeploymentMissing`; no
  answer (connection refused, timeout, TLS failure) → :class:`ApiUnreachable`, naming the
  API server; any other status → :class:`KubernetesScaleError` with the status and the
  server's message. A failing pool does not stop the others: every mapped pool is tried,
  each failure is logged, and ``apply`` then raises the first one (the planner logs it
  and applies again on its next tick).
- The client's calls block; they run in :func:`asyncio.to_thread`, never on the event
  loop, and one ``apply`` runs at a time.
- ``async close()`` closes the API client (its connection pool). Idempotent.

Configuration (:func:`load_client_configuration`): in-cluster by default
(``load_incluster_config``: the pod's service account token, refreshed when the kubelet
rotates it, its CA, ``KUBERNETES_SERVICE_HOST``/``_PORT``), or a kubeconfig file and
optionally one of its contexts. :func:`resolve_namespace` picks the namespace when none is
given: the pod's own (in cluster), the kubeconfig context's, else ``default``.

RBAC: the planner's service account needs exactly this Role (namespace of the
Deployments), bound to it by a RoleBinding, and nothing else — no access to the
Deployments themselves, to pods or to other namespaces (:func:`required_rules` returns
the rule for a given map)::

    apiVersion: rbac.authorization.k8s.io/v1
    kind: Role
    metadata: {name: kvmesh-planner, namespace: kvmesh}
    rules:
      - apiGroups: ["apps"]
        resources: ["deployments/scale"]
        resourceNames: ["kvmesh-prefill", "kvmesh-decode"]   # the --k8s-deployments names
        verbs: ["get", "patch"]
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from services.planner.core import ScalingDecision

log = logging.getLogger(__name__)

PATCH_CONTENT_TYPE = "application/merge-patch+json"
FIELD_MANAGER = "kvmesh-planner"
IN_CLUSTER_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
SCALE_PATH = "/apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale"


def required_rules(deployment_names: list[str] | tuple[str, ...]) -> list[dict[str, Any]]:
    """The RBAC Role rules the actuator needs to scale ``deployment_names`` (module
    docstring): ``get`` and ``patch`` on ``apps`` ``deployments/scale``, those names only."""
    return [{"apiGroups": ["apps"], "resources": ["deployments/scale"],
             "resourceNames": sorted(set(deployment_names)), "verbs": ["get", "patch"]}]


def _rule_text(name: str) -> str:
    return ('{apiGroups: ["apps"], resources: ["deployments/scale"], '
            f'resourceNames: ["{name}"], verbs: ["get", "patch"]}}')


@dataclasses.dataclass(frozen=True)
class ScaleChange:
    """One patch the actuator made: ``deployment`` in ``namespace`` (pool ``pool``) went
    from ``from_replicas`` to ``to_replicas``."""

    pool: str
    deployment: str
    namespace: str
    from_replicas: int
    to_replicas: int


class KubernetesScaleError(RuntimeError):
    """Scaling ``deployment`` (pool ``pool``) in ``namespace`` failed; ``status`` is the
    API's HTTP status (0: no answer)."""

    def __init__(self, message: str, pool: str, deployment: str, namespace: str,
                 status: int = 0) -> None:
        super().__init__(message)
        self.pool = pool
        self.deployment = deployment
        self.namespace = namespace
        self.status = status


class ScaleForbidden(KubernetesScaleError):
    """403: the service account may not get or patch the Deployment's scale."""


class DeploymentMissing(KubernetesScaleError):
    """404: no such Deployment in the namespace."""


class ScaleConflict(KubernetesScaleError):
    """409 on every try: the Deployment kept changing under the actuator."""


class ApiUnreachable(KubernetesScaleError):
    """The API server did not answer (refused, timed out, TLS failed)."""


class KubernetesConfigError(RuntimeError):
    """No usable client configuration (not in a pod, bad kubeconfig)."""


def load_client_configuration(kubeconfig: str = "", context: str = "") -> k8s.Configuration:
    """A client configuration: in-cluster when ``kubeconfig`` is empty, else the file's
    ``context`` (empty: its current context). Raises :class:`KubernetesConfigError` with
    what to do instead. Reads files: call it at start-up or in a thread."""
    cfg = k8s.Configuration()
    try:
        if kubeconfig:
            k8s_config.load_kube_config(config_file=kubeconfig, context=context or None,
                                        client_configuration=cfg)
        else:
            if context:
                raise KubernetesConfigError("--k8s-context needs --k8s-kubeconfig "
                                            "(in-cluster config has no contexts)")
            k8s_config.load_incluster_config(client_configuration=cfg)
    except k8s_config.ConfigException as exc:
        if kubeconfig:
            raise KubernetesConfigError(f"kubernetes actuator: cannot load kubeconfig "
                                        f"{kubeconfig!r}: {exc}") from exc
        raise KubernetesConfigError(
            f"kubernetes actuator: no in-cluster config ({exc}); the planner is not "
            f"running in a pod with a service account token: pass --k8s-kubeconfig PATH"
        ) from exc
    return cfg


def resolve_namespace(namespace: str = "", kubeconfig: str = "", context: str = "",
                      in_cluster_file: Path = IN_CLUSTER_NAMESPACE_FILE) -> str:
    """``namespace`` when given; else the kubeconfig context's namespace (with a
    kubeconfig) or the pod's own namespace (in cluster); else ``default``."""
    if namespace:
        return namespace
    if kubeconfig:
        try:
            contexts, current = k8s_config.list_kube_config_contexts(kubeconfig)
        except (k8s_config.ConfigException, OSError) as exc:
            raise KubernetesConfigError(f"kubernetes actuator: cannot read kubeconfig "
                                        f"{kubeconfig!r}: {exc}") from exc
        chosen = next((c for c in contexts if c.get("name") == context), None) if context \
            else current
        ns = ((chosen or {}).get("context") or {}).get("namespace")
        return str(ns) if ns else "default"
    try:
        return in_cluster_file.read_text().strip() or "default"
    except OSError:
        return "default"


def _api_message(exc: ApiException) -> str:
    """The API server's Status message; a body that is no JSON Status (a proxy's page)
    is reported as it came, after the reason."""
    try:
        body = json.loads(exc.body or "")
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("message"):
        return str(body["message"])
    return str(exc.reason or exc.body or "no message")


class KubernetesActuator:
    """Scales Deployments through their scale subresource; see the module docstring."""

    def __init__(self, deployments: Mapping[str, str], namespace: str,
                 configuration: k8s.Configuration, timeout_s: float = 10.0,
                 conflict_retries: int = 3) -> None:
        if not deployments:
            raise ValueError("kubernetes actuator: no pool=Deployment given")
        if conflict_retries < 0 or timeout_s <= 0:
            raise ValueError("conflict_retries must be >= 0 and timeout_s > 0")
        self.deployments = dict(deployments)
        self.namespace = namespace
        self.host = str(configuration.host)
        self.timeout_s = timeout_s
        self.conflict_retries = conflict_retries
        self.changes: list[ScaleChange] = []
        self._api_client: k8s.ApiClient | None = k8s.ApiClient(configuration)
        self._apps = k8s.AppsV1Api(self._api_client)
        self._lock = asyncio.Lock()

    async def apply(self, decision: ScalingDecision) -> None:
        async with self._lock:
            failures: list[KubernetesScaleError] = []
            for pool in sorted(decision.desired):
                name = self.deployments.get(pool)
                if name is None:
                    continue
                try:
                    change = await asyncio.to_thread(self._scale, pool, name,
                                                     decision.desired[pool])
                except KubernetesScaleError as exc:
                    log.error("%s", exc)
                    failures.append(exc)
                    continue
                if change is not None:
                    self.changes.append(change)
                    log.info("scaled deployment %s/%s (pool %s): %d → %d", self.namespace,
                             name, pool, change.from_replicas, change.to_replicas)
            if failures:
                raise failures[0]

    async def close(self) -> None:
        api, self._api_client = self._api_client, None
        if api is not None:
            await asyncio.to_thread(api.close)

    # -- blocking part, run in a thread ----------------------------------------------

    def _scale(self, pool: str, name: str, want: int) -> ScaleChange | None:
        """Brings Deployment ``name`` to ``want`` replicas; the change, or None when it
        already had them."""
        last = ""
        for attempt in range(self.conflict_retries + 1):
            have = self._call(pool, name, "get", lambda: self._read(name))
            if have == want:
                return None
            try:
                self._call(pool, name, "patch", lambda: self._patch(name, want),
                           conflict_ok=True)
            except _Conflict as exc:
                log.warning("conflict scaling deployment %s/%s (try %d of %d): %s",
                            self.namespace, name, attempt + 1, self.conflict_retries + 1,
                            exc.message)
                last = exc.message
                continue
            return ScaleChange(pool, name, self.namespace, have, want)
        raise ScaleConflict(
            f"kubernetes actuator: deployment {name!r} in namespace {self.namespace!r} "
            f"(pool {pool}) kept conflicting ({self.conflict_retries + 1} tries): {last}",
            pool, name, self.namespace, 409)

    def _read(self, name: str) -> int:
        scale = self._apps.read_namespaced_deployment_scale(
            name, self.namespace, _request_timeout=self.timeout_s)
        spec = scale.spec
        return int(spec.replicas or 0) if spec is not None else 0

    def _patch(self, name: str, want: int) -> None:
        self._apps.patch_namespaced_deployment_scale(
            name, self.namespace, {"spec": {"replicas": want}},
            field_manager=FIELD_MANAGER, _content_type=PATCH_CONTENT_TYPE,
            _request_timeout=self.timeout_s)

    def _call(self, pool: str, name: str, verb: str, fn: Any, conflict_ok: bool = False) -> Any:
        """Runs one API call, mapping its failures onto the module's errors."""
        where = f"deployment {name!r} in namespace {self.namespace!r} (pool {pool})"
        try:
            return fn()
        except ApiException as exc:
            status = int(exc.status or 0)
            msg = _api_message(exc)
            if status == 409 and conflict_ok:
                raise _Conflict(msg) from exc
            if status == 403:
                raise ScaleForbidden(
                    f"kubernetes actuator: forbidden to {verb} deployments/scale of {where}: "
                    f"the planner's service account needs the Role rule {_rule_text(name)} "
                    f"in namespace {self.namespace!r}, bound by a RoleBinding. API server: "
                    f"{msg}", pool, name, self.namespace, status) from exc
            if status == 404:
                raise DeploymentMissing(
                    f"kubernetes actuator: no {where} (404 on {verb} deployments/scale): "
                    f"check --k8s-deployments and --k8s-namespace. API server: {msg}",
                    pool, name, self.namespace, status) from exc
            if status == 0:
                raise ApiUnreachable(
                    f"kubernetes actuator: cannot reach the Kubernetes API at {self.host} "
                    f"to {verb} {where}: {msg}", pool, name, self.namespace) from exc
            raise KubernetesScaleError(
                f"kubernetes actuator: {verb} deployments/scale of {where} failed with "
                f"{status}: {msg}", pool, name, self.namespace, status) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ApiUnreachable(
                f"kubernetes actuator: cannot reach the Kubernetes API at {self.host} to "
                f"{verb} {where}: {exc}", pool, name, self.namespace) from exc


class _Conflict(Exception):
    """A 409 on a patch (internal: :meth:`KubernetesActuator._scale` retries it)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
