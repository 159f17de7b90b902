"""A throwaway mesh of child processes for benchmarks (etcd, Redis, kvmesh services).

Contract of :class:`BenchMesh` (a context manager): on enter it starts etcd and Redis on
free loopback ports in a fresh temporary folder; ``py(name, module, *args, **env)`` starts
``python -m module args`` as a child with the mesh's ``KVMESH_*`` environment (plus
``env``); ``frontend(workers)`` starts the frontend on a free port and returns its URL
once ``/health`` counts ``workers`` live workers; on exit every child is stopped by PID,
newest first, and the folder is removed. :func:`warm_up` sends one small completion.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from services.common.discovery import read_instance_records
from services.common.procs import (
    Child,
    free_port,
    spawn,
    start_etcd,
    start_redis,
    wait_until,
)
from services.launcher.up import CHILD_ENV, health


def embedded_router_args(policy: str, replica_sync: bool = False) -> list[str]:
    """The frontend's flags for a router and KV index inside it (Dynamo's deployment);
    ``replica_sync``: one of several frontend replicas, its router in sync with theirs."""
    sync = " --replica-sync" if replica_sync else ""
    return ["--router", "embedded", "--router-args",
            f"--policy {policy} --indexer embedded{sync}"]


class BenchMesh:
    """See the module docstring."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.children: list[Child] = []
        self.tmp = Path(tempfile.mkdtemp(prefix=f"kvmesh-{namespace}-"))
        self.logs = self.tmp / "logs"
        self.env: dict[str, str] = {}

    def __enter__(self) -> BenchMesh:
        try:
            etcd = self._add(start_etcd(self.tmp / "etcd", self.logs))
            redis = self._add(start_redis(self.logs))
        except BaseException:
            self.close()
            raise
        self.env = {**os.environ, **CHILD_ENV, "KVMESH_ETCD_ENDPOINT": etcd.address,
                    "KVMESH_REDIS_URL": f"redis://{redis.address}",
                    "KVMESH_NAMESPACE": self.namespace, "KVMESH_LOG_LEVEL": "WARNING"}
        return self

    def _add(self, child: Child) -> Child:
        self.children.append(child)
        return child

    def py(self, name: str, module: str, *args: str, **env: str) -> Child:
        """Starts ``python -m module args`` in the mesh."""
        return self._add(spawn(name, [sys.executable, "-m", module, *args], self.logs,
                               {**self.env, **env}))

    def frontend(self, workers: int, timeout_s: float = 180.0, *args: str,
                 replicas: int = 1) -> str:
        """Starts the frontend (with ``args``) on a free port; its base URL once
        ``workers`` workers serve and it is in etcd (it serves HTTP a moment before it
        registers). ``replicas`` > 1: that many frontends ``frontend``,
        ``frontend-1`` ... on that one port (``args`` must hold ``--reuse-port``); waits
        until all are in etcd and each serves on its own port (its record's
        ``http_address``)."""
        port = free_port()
        for i in range(1, replicas):
            self.py(f"frontend-{i}", "services.frontend", "--http-port", str(port), *args)
        front = self.py("frontend", "services.frontend", "--http-port", str(port), *args)
        url = f"http://127.0.0.1:{port}"
        wait_until(self.serving(url, workers, replicas), front, timeout_s,
                   "the mesh to serve")
        return url

    def serving(self, url: str, workers: int, replicas: int = 1) -> Callable[[], bool]:
        """Whether ``replicas`` frontends are in etcd and the one at ``url`` serves
        ``workers`` workers; with ``replicas`` > 1, each on its own port."""
        def serves(base: str) -> bool:
            code, body = health(base)
            return code == 200 and int(str(body.get("workers", 0))) >= workers

        def ready() -> bool:
            records = asyncio.run(read_instance_records(
                self.env["KVMESH_ETCD_ENDPOINT"], self.namespace, "frontend"))
            if len(records) != replicas:
                return False
            if replicas == 1:
                return serves(url)
            return all(serves(f"http://{r.http_address}") for r in records)
        return ready

    def close(self) -> None:
        """Stops every child (newest first) and removes the folder. Idempotent."""
        for child in reversed(self.children):
            child.stop()
        self.children.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def warm_up(url: str, model: str) -> None:
    """One small request, so the frontend's tokenizer and connections are ready before a
    measured replay."""
    import httpx

    resp = httpx.post(f"{url}/v1/completions", json={
        "model": model, "prompt": [5, 6, 7], "max_tokens": 1}, timeout=120)
    resp.raise_for_status()
