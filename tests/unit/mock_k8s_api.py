"""MOCK Kubernetes API server: just the apps/v1 Deployment scale subresource, for the
planner's Kubernetes actuator tests (no real API server can run on these machines).

It is a real HTTP server on 127.0.0.1 (``http.server`` in a thread), so the official
``kubernetes`` client talks to it over its own interface — serialisation, headers, status
→ exception mapping — pointed at it by ``kubernetes.client.Configuration(host=...)`` or a
kubeconfig. Contract of :class:`MockKubeApi`:

- ``GET /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale`` answers an
  ``autoscaling/v1`` Scale (``spec.replicas``, ``metadata.resourceVersion``) of a known
  Deployment; ``PATCH`` on the same path takes ``application/merge-patch+json`` or
  ``application/strategic-merge-patch+json`` with ``{"spec": {"replicas": N}}`` (N an int
  >= 0; else 422, another content type 415), sets the count, bumps the resourceVersion
  and answers the new Scale. An unknown Deployment is a 404, any other path a 404, any
  other method a 405 — each with a ``Status`` body shaped like the real server's.
- ``requests`` records every request (method, path, query, content type, parsed body,
  Authorization header) in arrival order.
- ``fail(method, namespace, name, *statuses)`` makes the next requests of that kind
  answer those statuses (409, 403, 404, 500, ...) instead; ``forbid(verb, namespace,
  name)`` answers 403 to that verb (``get``/``patch``) for good, as a missing RBAC rule.
- ``tls=(cert, key)`` serves HTTPS with that certificate (as an in-cluster API server).
- ``hold_gets()`` makes GETs wait until ``release()`` (at most ``hold_timeout_s``, then
  500) so a test can see the caller's event loop stays free while a call is in flight;
  ``held`` counts the GETs waiting.
"""

from __future__ import annotations

import dataclasses
import json
import re
import ssl
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kubernetes import client as k8s

SCALE_RE = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")
PATCH_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json")
REASONS = {403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed", 409: "Conflict",
           415: "UnsupportedMediaType", 422: "Invalid", 500: "InternalError"}


@dataclasses.dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: str
    content_type: str
    body: Any  # parsed JSON, or None
    authorization: str


class MockKubeApi:
    """MOCK API server; see the module docstring. ``deployments``: (namespace, name) →
    replicas."""

    def __init__(self, deployments: Mapping[tuple[str, str], int],
                 hold_timeout_s: float = 10.0, tls: tuple[Path, Path] | None = None) -> None:
        self.deployments = dict(deployments)
        self.versions = {key: 1 for key in self.deployments}
        self.requests: list[Request] = []
        self.hold_timeout_s = hold_timeout_s
        self.held = 0
        self._failures: dict[tuple[str, str, str], list[int]] = {}
        self._forbidden: set[tuple[str, str, str]] = set()
        self._gate = threading.Event()
        self._gate.set()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.scheme = "http"
        if tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(tls[0]), str(tls[1]))
            self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True)
            self.scheme = "https"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def host(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def configuration(self) -> k8s.Configuration:
        """A client configuration pointed at this mock."""
        return k8s.Configuration(host=self.host)

    def start(self) -> MockKubeApi:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._gate.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def fail(self, method: str, namespace: str, name: str, *statuses: int) -> None:
        with self._lock:
            self._failures.setdefault((method.upper(), namespace, name), []).extend(statuses)

    def forbid(self, verb: str, namespace: str, name: str) -> None:
        self._forbidden.add((verb.lower(), namespace, name))

    def hold_gets(self) -> None:
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def patches(self) -> list[Request]:
        return [r for r in self.requests if r.method == "PATCH"]

    # -- the server ----------------------------------------------------------------

    def _status(self, code: int, message: str, name: str = "") -> tuple[int, dict[str, Any]]:
        return code, {"kind": "Status", "apiVersion": "v1", "metadata": {},
                      "status": "Failure", "message": message,
                      "reason": REASONS.get(code, "Unknown"),
                      "details": {"name": name, "group": "apps", "kind": "deployments"},
                      "code": code}

    def _scale(self, ns: str, name: str) -> dict[str, Any]:
        n = self.deployments[(ns, name)]
        return {"kind": "Scale", "apiVersion": "autoscaling/v1",
                "metadata": {"name": name, "namespace": ns,
                             "resourceVersion": str(self.versions[(ns, name)])},
                "spec": {"replicas": n}, "status": {"replicas": n, "selector": f"app={name}"}}

    def _answer(self, req: Request) -> tuple[int, dict[str, Any]]:
        m = SCALE_RE.match(req.path)
        if m is None:
            return self._status(404, f"the server could not find the requested resource "
                                     f"({req.method} {req.path})")
        ns, name = m.groups()
        verb = {"GET": "get", "PATCH": "patch"}.get(req.method)
        if verb is None:
            return self._status(405, f"{req.method} is not allowed", name)
        with self._lock:
            queued = self._failures.get((req.method, ns, name))
            code = queued.pop(0) if queued else 0
        if code == 403 or (verb, ns, name) in self._forbidden:
            return self._status(403, f'deployments.apps "{name}" is forbidden: User '
                                     f'"system:serviceaccount:{ns}:kvmesh-planner" cannot '
                                     f'{verb} resource "deployments/scale" in API group '
                                     f'"apps" in the namespace "{ns}"', name)
        if code == 409:
            return self._status(409, f'Operation cannot be fulfilled on deployments.apps '
                                     f'"{name}": the object has been modified; please apply '
                                     f'your changes to the latest version and try again', name)
        if code:
            return self._status(code, f"injected failure {code}", name)
        if (ns, name) not in self.deployments:
            return self._status(404, f'deployments.apps "{name}" not found', name)
        if verb == "get":
            if not self._gate.is_set():
                with self._lock:
                    self.held += 1
                released = self._gate.wait(self.hold_timeout_s)
                with self._lock:
                    self.held -= 1
                if not released:
                    return self._status(500, "mock: held GET never released", name)
            return 200, self._scale(ns, name)
        if req.content_type not in PATCH_TYPES:
            return self._status(415, f"the body of the request was in an unknown format - "
                                     f"accepted media types include: {', '.join(PATCH_TYPES)}",
                                name)
        replicas = (req.body or {}).get("spec", {}).get("replicas") \
            if isinstance(req.body, dict) else None
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            return self._status(422, f"spec.replicas: Invalid value: {replicas!r}", name)
        with self._lock:
            self.deployments[(ns, name)] = replicas
            self.versions[(ns, name)] += 1
        return 200, self._scale(ns, name)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                url = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode(errors="replace")
                req = Request(self.command, url.path, url.query,
                              self.headers.get("Content-Type", ""), body,
                              self.headers.get("Authorization", ""))
                with api._lock:
                    api.requests.append(req)
                code, payload = api._answer(req)
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PATCH = do_PUT = do_POST = do_DELETE = _serve

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                return None

        return Handler
