"""``kvmesh store-node``: a process that contributes one DRAM segment to the KV store.

KV kept in a store node survives worker restarts (a worker's embedded segment dies with
it). The node's NIXL agent is the *target* of the workers' one-sided READs and WRITEs; it
publishes its agent metadata in the segment endpoint, so nothing else must be served.

Contract:

- :class:`StoreNodeConfig`: ``--store-master host:port`` (empty: the first ``store_master``
  instance found in etcd under ``--namespace``), ``--segment-mib``, ``--client-id``
  (default ``store-node-<pid>``), ``--progress-interval-ms`` (how often UCX is progressed
  while idle; peers need it to connect). Every flag has a ``KVMESH_*`` env var.
- :func:`serve` mounts the segment through :class:`workers.kv.store_client.StoreClient`
  (fresh segment id per launch; pings and remounts), prints one JSON line
  ``{"ready": true, "client_id", "segment_id", "segment_bytes"}`` on stdout once mounted,
  then progresses UCX until SIGTERM/SIGINT; then it unmounts (replicas on it are lost) and
  closes the client.
- :class:`StoreNodeProcess` (tests, benchmarks): spawns ``python -m workers.store_node``,
  waits for its ready line; ``stop()`` sends SIGTERM (clean unmount), ``kill()`` SIGKILL
  (the master learns only when the client TTL runs out), both by the child's own PID.
- :func:`main` always ends the process with ``os._exit`` (NIXL may crash at interpreter
  exit): 0 after a clean stop, 1 on a startup error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.common.config import BaseConfig, ConfigError, load_config
from services.common.tls import tls_for

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StoreNodeConfig(BaseConfig):
    """kvmesh store node: contributes a DRAM segment to the KV store (over NIXL)."""

    store_master: str = dataclasses.field(
        default="", metadata={"help": "store master host:port (empty: discover in etcd)"})
    segment_mib: int = dataclasses.field(
        default=1024, metadata={"help": "segment size contributed to the store (MiB)"})
    client_id: str = dataclasses.field(
        default="", metadata={"help": "store client id (default store-node-<pid>)"})
    progress_interval_ms: float = dataclasses.field(
        default=1.0, metadata={"help": "UCX progress period while idle (ms)"})

    def problems(self) -> list[str]:
        out = super().problems()
        if self.segment_mib < 1:
            out.append("segment_mib must be >= 1")
        if self.progress_interval_ms <= 0:
            out.append("progress_interval_ms must be > 0")
        if self.store_master and ":" not in self.store_master:
            out.append(f"store_master must be host:port, got {self.store_master!r}")
        return out


async def discover_master(cfg: StoreNodeConfig, timeout_s: float = 30.0) -> str:
    """The address of a live ``store_master`` in etcd (the lowest address when several):
    waits for the watcher to report one, up to ``timeout_s``; then ConfigError."""
    from services.common.discovery import InstanceWatcher

    watcher = InstanceWatcher(cfg.etcd_endpoint, cfg.namespace, "store_master",
                              tls=tls_for(cfg, "store_client"))
    changed = asyncio.Event()
    watcher.on_change(lambda _: changed.set())
    await watcher.start()
    try:
        async with asyncio.timeout(timeout_s):
            while not (found := sorted(r.address for r in watcher.instances().values())):
                changed.clear()
                await changed.wait()
        return found[0]
    except TimeoutError:
        raise ConfigError("no store_master registered in etcd") from None
    finally:
        await watcher.close()


def serve(cfg: StoreNodeConfig, stop: threading.Event | None = None) -> int:
    """Mount the segment and progress UCX until ``stop`` (or a signal); return 0."""
    from workers.kv.store_client import StoreClient

    master = cfg.store_master or asyncio.run(discover_master(cfg))
    stop = stop or threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    client = StoreClient(master, segment_bytes=cfg.segment_mib << 20,
                         client_id=cfg.client_id or f"store-node-{os.getpid()}",
                         tls=tls_for(cfg, "store_client"))
    try:
        print(json.dumps({"ready": True, "client_id": client.client_id,
                          "segment_id": client.segment_id,
                          "segment_bytes": cfg.segment_mib << 20}), flush=True)
        period = cfg.progress_interval_ms / 1000.0
        while not stop.wait(period):
            client.progress()
    finally:
        client.close()
    return 0


class StoreNodeProcess:
    """A ``python -m workers.store_node`` child (see the module docstring)."""

    def __init__(self, store_master: str, segment_mib: int = 64, *, client_id: str = "",
                 env: Mapping[str, str] | None = None, start_timeout_s: float = 60.0,
                 extra_args: tuple[str, ...] = ()) -> None:
        argv = [sys.executable, "-m", "workers.store_node", "--store-master", store_master,
                "--segment-mib", str(segment_mib), *extra_args]
        if client_id:
            argv += ["--client-id", client_id]
        ucx = {"UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo"}
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
            cwd=Path(__file__).resolve().parents[1],
            env={**os.environ, **ucx, **(env or {})})
        self.info: dict[str, Any] = {}
        deadline = time.monotonic() + start_timeout_s
        assert self.proc.stdout is not None
        while not self.info:  # NIXL logs on stdout too; the ready line is JSON
            line = self.proc.stdout.readline()  # blocks until a line or exit
            if not line or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"store node did not start (exit {self.proc.poll()})")
            if line.startswith('{"ready"'):
                self.info = json.loads(line)
        # Keep draining its stdout so the child never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        stream = self.proc.stdout
        try:
            while stream is not None and stream.readline():
                pass
        except (OSError, ValueError):  # closed by stop()
            pass

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (unmounts cleanly), then SIGKILL if it lingers."""
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: the segment vanishes without telling the master."""
        if self.alive():
            self.proc.kill()
        self.proc.wait(10)


def main(argv: list[str] | None = None) -> None:
    """Entry point; never returns (``os._exit``)."""
    code = 1
    try:
        cfg = load_config(StoreNodeConfig, argv)
        logging.basicConfig(level=cfg.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        code = serve(cfg)
    except BaseException as exc:  # report, then hard-exit
        print(f"store-node: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
