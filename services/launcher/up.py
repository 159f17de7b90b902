"""``kvmesh up``: start a whole local mesh as child processes, stop it with Ctrl-C.

Contract: :class:`LocalMesh` starts etcd and redis-server on free loopback ports, then the
indexer (with ``indexer="remote"``), the router (with the spec's admission control), the
worker(s) (publishing KV events to
Redis) and the frontend (each ``python -m ...`` in its own process group,
configured through ``KVMESH_*`` env vars), and waits until the frontend's ``/health``
answers 200 (a worker registered). With ``planner=True`` it then starts
``python -m services.planner`` with the dry-run actuator (it publishes desired counts,
scrapes the frontend's ``/metrics``, changes nothing). ``stop()`` stops everything it
started, in reverse order, by PID. Logs go to ``log_dir/<name>.log``.

:class:`MeshSpec`'s fields are the ``kvmesh up`` flags (those not marked ``flag: False``;
:func:`services.common.config.add_fields` builds them, with ``help`` and ``choices`` from
the field metadata). :meth:`MeshSpec.problems` checks their values at once, each problem
naming the flag and its ``KVMESH_*`` variable; ``LocalMesh`` does not re-check them.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from services.common.config import env_name, flag_name
from services.common.procs import Child, free_port, spawn, start_etcd, start_redis, wait_until
from services.router.admission.core import POLICIES as ADMISSIONS
from services.router.indexer_modes import INDEXER_MODES as INDEXERS

CHILD_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "UCX_NET_DEVICES": "lo",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}

MODES = ("disagg", "agg")
HANDOFFS = ("pull", "push")


def _flag(name: str) -> str:
    return f"{flag_name(name)} ({env_name(name)})"


def _opt(default: Any, text: str, choices: tuple[str, ...] | None = None) -> Any:
    """A ``kvmesh up`` flag's field with help ``text`` (see
    :func:`services.common.config.add_fields`)."""
    meta: dict[str, Any] = {"help": text}
    if choices is not None:
        meta["choices"] = choices
    return field(default=default, metadata=meta)


def _fixed(default: Any) -> Any:
    """A field that is no ``kvmesh up`` flag (nor variable)."""
    return field(default=default, metadata={"flag": False})


@dataclass
class MeshSpec:
    """What to launch; the fields with a flag are ``kvmesh up``'s flags."""

    model: str = _opt("smollm2", "smollm2 | tiny | model folder")
    http_port: int = _opt(8000, "the frontend's HTTP port")
    mode: str = _opt("disagg", "disagg: 1 prefill + 1 decode worker (default); "
                     "agg: 1 aggregated", MODES)
    handoff: str = _opt("pull", "P→D KV handoff: pull (D READs, default) or push "
                        "(P WRITEs)", HANDOFFS)
    workers: int = _opt(1, "workers per role")
    policy: str = _opt("kv", "worker policy or profile (kv, approx, least_loaded, "
                       "round_robin, ...)")
    indexer: str = _opt("remote", "KV overlap source of the router: indexer service, "
                        "embedded, or the router's own request history", INDEXERS)
    admission: str = _opt("none", "router admission control: none, early (Mooncake early "
                          "rejection) or current_load; rejected requests get 503 + "
                          "Retry-After", ADMISSIONS)
    admission_ttft_slo_ms: float = _opt(2000.0, "admission control's TTFT target in ms")
    admission_itl_slo_ms: float = _opt(50.0, "admission control's ITL target in ms")
    planner: bool = _opt(False, "also run the planner (dry-run actuator: publishes desired "
                         "counts)")
    namespace: str = _fixed("kvmesh")
    kv_cache_gib: float = _opt(1.0, "KV cache per worker in GiB")
    max_model_len: int = _opt(2048, "longest sequence (tokens) a worker takes")
    block_size: int = _fixed(32)
    lease_ttl: int = _fixed(5)
    log_dir: Path = field(default_factory=lambda: Path(".kvmesh/logs"),
                          metadata={"help": "folder of the processes' logs"})
    start_timeout_s: float = _fixed(600.0)

    def problems(self) -> list[str]:
        """What is wrong with the ``kvmesh up`` flags' values (empty when valid)."""
        out = []
        for f in fields(self):
            allowed = f.metadata.get("choices")
            if allowed is not None and getattr(self, f.name) not in allowed:
                out.append(f"{_flag(f.name)} must be one of {', '.join(allowed)}, "
                           f"got {getattr(self, f.name)!r}")
        for name in ("model", "policy"):
            if not getattr(self, name):
                out.append(f"{_flag(name)} must not be empty")
        if not 0 <= self.http_port <= 65535:
            out.append(f"{_flag('http_port')} out of range: {self.http_port}")
        for name in ("workers", "max_model_len"):
            if getattr(self, name) < 1:
                out.append(f"{_flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("kv_cache_gib", "admission_ttft_slo_ms", "admission_itl_slo_ms"):
            if not getattr(self, name) > 0:
                out.append(f"{_flag(name)} must be > 0, got {getattr(self, name)}")
        return out


def health(url: str) -> tuple[int, dict[str, object]]:
    """GET url/health → (status, body); (0, {}) when unreachable."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, {}
    except (urllib.error.URLError, OSError, ValueError):
        return 0, {}


class LocalMesh:
    """A mesh of child processes; see the module docstring."""

    def __init__(self, spec: MeshSpec) -> None:
        self.spec = spec
        self.children: list[Child] = []
        self.url = ""
        self.etcd: Child | None = None
        self.redis: Child | None = None
        self._state: Path | None = None

    def _env(self, **extra: str) -> dict[str, str]:
        assert self.etcd is not None and self.redis is not None
        env = {**os.environ, **CHILD_ENV, "KVMESH_ETCD_ENDPOINT": self.etcd.address,
               "KVMESH_REDIS_URL": f"redis://{self.redis.address}",
               "KVMESH_NAMESPACE": self.spec.namespace,
               "KVMESH_LEASE_TTL": str(self.spec.lease_ttl)}
        env.update(extra)
        return env

    def _python(self, name: str, module: str, *args: str, **env: str) -> Child:
        child = spawn(name, [sys.executable, "-m", module, *args], self.spec.log_dir,
                      self._env(**env))
        self.children.append(child)
        return child

    def start(self) -> str:
        """Starts everything; returns the frontend's base URL."""
        s = self.spec
        s.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            s.log_dir.parent.mkdir(parents=True, exist_ok=True)
            self._state = Path(tempfile.mkdtemp(prefix="etcd-", dir=s.log_dir.parent))
            self.etcd = start_etcd(self._state, s.log_dir)
            self.children.append(self.etcd)
            self.redis = start_redis(s.log_dir)
            self.children.append(self.redis)
            if s.indexer == "remote":
                self._python("indexer", "services.indexer")
            self._python("router", "services.router", KVMESH_POLICY=s.policy,
                         KVMESH_INDEXER=s.indexer, **self.admission_env())
            roles = ["agg"] if s.mode == "agg" else ["prefill", "decode"]
            for role in roles:
                for i in range(s.workers):
                    self._python(f"{role}-{i}", "workers", KVMESH_MODEL_PATH=s.model,
                                 KVMESH_ROLE=role, KVMESH_HANDOFF=s.handoff if role != "agg"
                                 else "none", KVMESH_KV_CACHE_GIB=str(s.kv_cache_gib),
                                 KVMESH_MAX_MODEL_LEN=str(s.max_model_len),
                                 KVMESH_BLOCK_SIZE=str(s.block_size))
            port = s.http_port or free_port()
            front = self._python("frontend", "services.frontend", KVMESH_HTTP_PORT=str(port))
            self.url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + s.start_timeout_s

            def ready() -> bool:
                for c in self.children:
                    if not c.alive():
                        raise RuntimeError(f"{c.name} exited ({c.proc.returncode}):\n"
                                           f"{c.log_tail()}")
                code, body = health(self.url)
                return code == 200 and int(str(body.get("workers", 0))) >= s.workers * len(roles)

            wait_until(ready, front, max(deadline - time.monotonic(), 1), "the mesh to serve")
            if s.planner:
                self._python("planner", "services.planner", KVMESH_ACTUATOR="dry_run",
                             KVMESH_MODE="agg" if s.mode == "agg" else "disagg",
                             KVMESH_METRICS_URLS=f"{self.url}/metrics")
        except BaseException:
            self.stop()
            raise
        return self.url

    def admission_env(self) -> dict[str, str]:
        """The router's admission settings as ``KVMESH_*`` env vars."""
        s = self.spec
        return {"KVMESH_ADMISSION": s.admission,
                "KVMESH_ADMISSION_TTFT_SLO_MS": str(s.admission_ttft_slo_ms),
                "KVMESH_ADMISSION_ITL_SLO_MS": str(s.admission_itl_slo_ms)}

    def child(self, name: str) -> Child:
        """The child process named ``name``."""
        return next(c for c in self.children if c.name == name)

    def stop(self) -> None:
        """Stops every child, newest first, by PID."""
        for child in reversed(self.children):
            child.stop()
        self.children.clear()
        if self._state is not None:
            shutil.rmtree(self._state, ignore_errors=True)
            self._state = None
