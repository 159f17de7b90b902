"""The ``toy`` anchor: vLLM's own P/D path, two plain vLLM OpenAI servers and a minimal proxy.

Our runner after vLLM's ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``
(read, not copied): the proxy sends each completion to P with ``max_tokens`` 1,
``stream`` false, no ``stream_options`` and ``kv_transfer_params`` =
``{"do_remote_decode": true, "do_remote_prefill": false, "remote_*": null}``, takes the
``kv_transfer_params`` of P's answer, and streams the original request, with those
params, from D; both calls carry the same ``X-Request-Id``.

Contracts:

- :class:`ToyPD` ``(model_path, served_name, log_dir, ...)``: ``start()`` spawns P and D
  (``python -m vllm.entrypoints.openai.api_server``, each in its own process group, on
  free loopback ports) with the engine settings of a kvmesh vLLM worker
  (:class:`workers.engines.vllm_engine.VllmEngineConfig` defaults as
  ``services.launcher.up`` runs them: block 32, float32, eager, seed 0, prefix caching,
  ``kv_cache_gib`` of KV cache, ``max_model_len``, ``OMP_NUM_THREADS`` 1, the launcher's
  child environment) and the KV config of kvmesh's pull mode
  (:func:`workers.kv.nixl.nixl_kv_transfer_config` as :func:`workers.kv.configs.
  worker_kv_transfer` builds it: ``NixlConnector`` from :mod:`workers.kv.nixl_quiet`,
  ``kv_both``, policy "recompute", lease 30 s, a fresh engine id, and
  :func:`workers.kv.nixl.nixl_env` on a free side-channel port), waits for both
  ``/health``, then serves the proxy in a thread of this process and returns its URL.
  Raises RuntimeError (with the server's log tail) when a server dies or is not up in
  ``start_timeout_s``. ``stop()`` stops the proxy and both servers by their process
  groups; safe to call twice. ``children`` lists the servers (``Child``).
- The proxy answers ``POST /v1/completions`` (as above; a failing P or D call is
  relayed as HTTP 502 with the upstream status and body), ``GET /v1/models`` (D's),
  ``GET /health`` and ``GET /metrics``: two counters of its own in Prometheus text,
  ``kvmesh_requests_total{path="disagg"}`` (completions sent to D) and
  ``kvmesh_prefill_hit_tokens_total`` (the sum of P's
  ``usage.prompt_tokens_details.cached_tokens``), named as the frontend's so the
  benchmark's cache check reads them the same way. Anything else: 404.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import threading
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from services.common.procs import Child, free_port, spawn, wait_until
from services.launcher.up import CHILD_ENV
from workers.kv.nixl import new_engine_id, nixl_env, nixl_kv_transfer_config

REPO_ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
P_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
            "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
            "remote_port": None}


def server_argv(model_path: str, served_name: str, port: int, kv_config: dict[str, Any],
                *, max_model_len: int, kv_cache_gib: float, block_size: int) -> list[str]:
    """The vLLM OpenAI server command of one toy engine."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model_path, "--served-model-name", served_name,
            "--host", "127.0.0.1", "--port", str(port),
            "--block-size", str(block_size), "--max-model-len", str(max_model_len),
            "--dtype", "float32", "--kv-cache-memory-bytes", str(int(kv_cache_gib * GIB)),
            "--enforce-eager", "--seed", "0", "--enable-prefix-caching",
            "--enable-prompt-tokens-details", "--disable-log-stats",
            "--disable-uvicorn-access-log",
            "--kv-transfer-config", json.dumps(kv_config)]


def _post(base: str, path: str, body: dict[str, Any], request_id: str,
          timeout_s: float) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    host, port = base.rsplit(":", 1)
    conn = http.client.HTTPConnection(host.split("//")[-1], int(port), timeout=timeout_s)
    conn.request("POST", path, body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json", "X-Request-Id": request_id})
    return conn, conn.getresponse()


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, p_url: str, d_url: str, timeout_s: float) -> None:
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.p_url, self.d_url, self.timeout_s = p_url, d_url, timeout_s
        self.lock = threading.Lock()
        self.disagg_requests = 0
        self.p_cached_tokens = 0

    def metrics_text(self) -> str:
        with self.lock:
            return ("# TYPE kvmesh_requests counter\n"
                    f'kvmesh_requests_total{{path="disagg"}} {self.disagg_requests}\n'
                    "# TYPE kvmesh_prefill_hit_tokens counter\n"
                    f"kvmesh_prefill_hit_tokens_total {self.p_cached_tokens}\n")


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes
    server: _ProxyServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def _reply(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/metrics":
            self._reply(200, self.server.metrics_text().encode(), "text/plain")
        elif self.path == "/health":
            self._reply(200, b"{}")
        elif self.path == "/v1/models":
            with urllib.request.urlopen(self.server.d_url + "/v1/models", timeout=10) as r:
                self._reply(200, r.read())
        else:
            self._reply(404, b'{"error": "not found"}')

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/v1/completions":
            self._reply(404, b'{"error": "only /v1/completions"}')
            return
        srv = self.server
        req = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        rid = uuid.uuid4().hex
        p_req = {k: v for k, v in req.items() if k not in ("stream_options", "min_tokens")}
        p_req.update(stream=False, max_tokens=1, kv_transfer_params=dict(P_PARAMS))
        conn, resp = _post(srv.p_url, "/v1/completions", p_req, rid, srv.timeout_s)
        try:
            p_body = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            self._reply(502, json.dumps({"error": f"P answered {resp.status}: "
                                                  f"{p_body[:2000]!r}"}).encode())
            return
        p_json = json.loads(p_body)
        params = p_json.get("kv_transfer_params")
        if not params:
            self._reply(502, b'{"error": "P answered without kv_transfer_params"}')
            return
        details = (p_json.get("usage") or {}).get("prompt_tokens_details") or {}
        with srv.lock:
            srv.disagg_requests += 1
            srv.p_cached_tokens += int(details.get("cached_tokens") or 0)
        conn, resp = _post(srv.d_url, "/v1/completions", {**req, "kv_transfer_params": params},
                           rid, srv.timeout_s)
        try:
            if resp.status != 200:
                self._reply(502, json.dumps({"error": f"D answered {resp.status}: "
                                                      f"{resp.read()[:2000]!r}"}).encode())
                return
            self.send_response(200)
            self.send_header("Content-Type", resp.getheader("Content-Type") or
                             "text/event-stream")
            self.end_headers()
            while line := resp.readline():
                self.wfile.write(line)
                self.wfile.flush()
        finally:
            conn.close()


class ToyPD:
    """Two vLLM OpenAI servers (P, D) and the in-process proxy; see the module docstring."""

    def __init__(self, model_path: str, served_name: str, log_dir: Path, *,
                 max_model_len: int = 4096, kv_cache_gib: float = 1.0, block_size: int = 32,
                 start_timeout_s: float = 420.0, request_timeout_s: float = 150.0) -> None:
        self.model_path, self.served_name, self.log_dir = model_path, served_name, log_dir
        self.max_model_len, self.kv_cache_gib = max_model_len, kv_cache_gib
        self.block_size, self.start_timeout_s = block_size, start_timeout_s
        self.request_timeout_s = request_timeout_s
        self.children: list[Child] = []
        self.kv_configs: dict[str, dict[str, Any]] = {}
        self._proxy: _ProxyServer | None = None
        self._thread: threading.Thread | None = None

    def _spawn(self, name: str) -> str:
        port = free_port()
        kv = nixl_kv_transfer_config("pull", new_engine_id(f"toy-{name}"), "kv_both",
                                     "recompute", kv_lease_duration=30,
                                     progress_thread=False)
        self.kv_configs[name] = kv
        env = {**os.environ, **CHILD_ENV, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(
                   [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
               **nixl_env(free_port(), "127.0.0.1")}
        argv = server_argv(self.model_path, self.served_name, port, kv,
                           max_model_len=self.max_model_len, kv_cache_gib=self.kv_cache_gib,
                           block_size=self.block_size)
        self.children.append(spawn(f"toy-{name}", argv, self.log_dir, env))
        return f"http://127.0.0.1:{port}"

    @staticmethod
    def _healthy(url: str) -> bool:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def start(self) -> str:
        """Both servers up, then the proxy; returns the proxy's URL."""
        p_url, d_url = self._spawn("prefill"), self._spawn("decode")
        for child, url in zip(self.children, (p_url, d_url), strict=True):
            wait_until(lambda u=url: self._healthy(u), child, self.start_timeout_s,  # type: ignore[misc]
                       "/health")
        self._proxy = _ProxyServer(p_url, d_url, self.request_timeout_s)
        self._thread = threading.Thread(target=self._proxy.serve_forever,
                                        name="toy-proxy", daemon=True)
        self._thread.start()
        return f"http://127.0.0.1:{self._proxy.server_address[1]}"

    def stop(self) -> None:
        """The proxy, then both servers (their process groups, by PID)."""
        if self._proxy is not None:
            self._proxy.shutdown()
            self._proxy.server_close()
            self._proxy = None
        for child in self.children:
            child.stop(timeout=20)
