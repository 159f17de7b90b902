"""A whole mesh as separate processes, for the fault suite: each part can be killed,
stopped, restarted or wiped on its own.

Contract of :class:`FaultMesh`:

- ``start()`` starts etcd and redis-server on fixed loopback ports (so a restart keeps the
  address), then the indexer, the router, the frontend and mock workers, each
  ``python -m ...`` in its own process group with a fixed gRPC port, and returns once the
  frontend's ``/health`` counts every worker. Workers serve the mock engine with the tiny
  model's tokenizer, publish KV events to Redis, and register under ``lease_ttl``.
- ``kill(name)`` (SIGKILL), ``pause(name)`` / ``resume(name)`` (SIGSTOP / SIGCONT) and
  ``restart(name)`` (stop, then start again with the same argv and ports) act on one
  child by name; ``restart_etcd(wipe)`` restarts etcd with its data kept or wiped;
  ``restart_redis(keep)`` restarts Redis (it runs with an append-only file), with that
  file kept or deleted.
- Checks: ``router_metric(name)`` (a sample of the router's /metrics), ``routable()``
  (worker ids from the router's ListWorkers), ``load(name)`` (a worker's GetLoad),
  ``idle(names)`` (the workers still holding a request or a KV block),
  ``index_mismatch(names)`` (the workers whose blocks in the indexer's Dump differ from
  their GetKvState),
  ``completion()`` / ``stream()`` (one OpenAI request through the frontend).
- ``stop()`` stops every child, newest first, by PID; nothing else is signalled.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

from protos import (
    indexer_pb2,
    indexer_pb2_grpc,
    kv_events_pb2,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.procs import Child, free_port, spawn, start_etcd, start_redis, wait_until
from services.launcher.up import CHILD_ENV, health

NS = "faults"
BLOCK = 32
MODEL = "tiny"


@dataclass
class Part:
    """One mesh process: how to (re)start it and the running child."""

    name: str
    argv: list[str]
    port: int
    child: Child | None = None


@dataclass
class FaultMesh:
    """A mesh of child processes; see the module docstring."""

    work: Path
    model_path: str
    roles: tuple[str, ...] = ("prefill", "prefill", "decode", "decode")
    lease_ttl: int = 2
    extra: dict[str, list[str]] = field(default_factory=dict)
    parts: dict[str, Part] = field(default_factory=dict)
    etcd: Child | None = None
    redis: Child | None = None
    http_port: int = 0
    _ports: dict[str, int] = field(default_factory=dict)

    @property
    def logs(self) -> Path:
        return self.work / "logs"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def etcd_address(self) -> str:
        return f"127.0.0.1:{self._ports['etcd']}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self._ports['redis']}"

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.parts[name].port}"

    def _base(self) -> list[str]:
        return ["--etcd-endpoint", self.etcd_address, "--namespace", NS,
                "--redis-url", self.redis_url, "--lease-ttl", str(self.lease_ttl),
                "--grace-s", "0.5"]

    def _env(self) -> dict[str, str]:
        return {**os.environ, **CHILD_ENV}

    def _add(self, name: str, module: str, *args: str) -> None:
        port = free_port()
        argv = [sys.executable, "-m", module, *self._base(), "--port", str(port), *args,
                *self.extra.get(name, [])]
        self.parts[name] = Part(name, argv, port)
        self._spawn(name)

    def _spawn(self, name: str) -> None:
        part = self.parts[name]  # a restart appends to the log of the first start
        part.child = spawn(name, part.argv, self.logs, self._env(),
                           append=part.child is not None)

    def start(self) -> str:
        """Starts everything; returns the frontend's base URL."""
        self._ports = {"etcd": free_port(), "etcd_peer": free_port(), "redis": free_port()}
        self.logs.mkdir(parents=True, exist_ok=True)
        try:
            self._start_etcd()
            self._start_redis()
            self._add("indexer", "services.indexer", "--group", "faults")
            self._ports["router_metrics"] = free_port()
            self._add("router", "services.router", "--indexer", "remote",
                      "--load-poll-s", "0.2", "--metrics-port",
                      str(self._ports["router_metrics"]))
            counts: dict[str, int] = {}
            for role in self.roles:
                i = counts[role] = counts.get(role, -1) + 1
                name = f"{role}-{i}"
                self._add(name, "workers", "--engine", "mock", "--role", role,
                          "--model-path", self.model_path, "--model-name", MODEL,
                          "--worker-id", name, "--block-size", str(BLOCK),
                          "--max-model-len", "2048", "--metrics-port", "-1")
            self.http_port = free_port()
            self._add("frontend", "services.frontend", "--http-port", str(self.http_port))
            self.wait_serving(120)
        except BaseException:
            self.stop()
            raise
        return self.url

    def _start_etcd(self) -> None:
        self.etcd = start_etcd(self.work / "etcd", self.logs, self._ports["etcd"],
                               self._ports["etcd_peer"])

    def _start_redis(self) -> None:
        self.redis = start_redis(self.logs, self._ports["redis"], self.work / "redis")

    def child(self, name: str) -> Child:
        child = self.parts[name].child
        assert child is not None, f"{name} is not running"
        return child

    def wait_serving(self, timeout_s: float) -> None:
        """Until the frontend's /health counts every worker (raises on timeout or when a
        child died)."""
        front = self.child("frontend")

        def ready() -> bool:
            for part in self.parts.values():
                if part.child is not None and not part.child.alive():
                    raise RuntimeError(f"{part.name} exited ({part.child.proc.returncode}):\n"
                                       f"{part.child.log_tail()}")
            code, body = health(self.url)
            return code == 200 and int(str(body.get("workers", 0))) >= len(self.roles)

        wait_until(ready, front, timeout_s, "the fault mesh to serve")

    # -- faults -------------------------------------------------------------------------

    def kill(self, name: str) -> None:
        """SIGKILL, as a crash would."""
        self.child(name).kill()

    def pause(self, name: str) -> None:
        os.killpg(self.child(name).pid, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        os.killpg(self.child(name).pid, signal.SIGCONT)

    def restart(self, name: str) -> None:
        """Stops ``name`` (if running) and starts it again with the same argv and port."""
        child = self.parts[name].child
        if child is not None:
            child.stop()
        self._spawn(name)

    def restart_etcd(self, wipe: bool) -> None:
        """Stops etcd and starts it on the same ports, with its data kept or wiped."""
        assert self.etcd is not None
        self.etcd.stop()
        if wipe:
            shutil.rmtree(self.work / "etcd" / "etcd-data", ignore_errors=True)
        self._start_etcd()

    def restart_redis(self, keep: bool) -> None:
        """Stops Redis and starts it on the same port, with its append-only file kept
        (what it had fsynced comes back) or deleted (it comes back empty)."""
        assert self.redis is not None
        self.redis.stop()
        if not keep:
            shutil.rmtree(self.work / "redis", ignore_errors=True)
        self._start_redis()

    def stop(self) -> None:
        """Stops every child, newest first, by PID."""
        for part in reversed(list(self.parts.values())):
            if part.child is not None:
                if part.child.alive():
                    os.killpg(part.child.pid, signal.SIGCONT)
                part.child.stop()
        for infra in (self.redis, self.etcd):
            if infra is not None:
                infra.stop()

    # -- observations ---------------------------------------------------------------------

    def workers(self) -> list[str]:
        return [n for n in self.parts if n.split("-")[0] in ("agg", "prefill", "decode")]

    async def routable(self) -> set[str]:
        """Worker ids the router lists now (none while it cannot answer)."""
        try:
            async with grpc.aio.insecure_channel(self.address("router")) as ch:
                resp = await router_pb2_grpc.RouterStub(ch).ListWorkers(
                    router_pb2.ListWorkersRequest(), timeout=5)
        except grpc.aio.AioRpcError:
            return set()
        return {w.instance_id for w in resp.workers}

    async def router_metric(self, name: str) -> float:
        """One unlabelled sample of the router's /metrics."""
        async with httpx.AsyncClient(timeout=5) as client:
            text = (await client.get(
                f"http://127.0.0.1:{self._ports['router_metrics']}/metrics")).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"the router exports no {name}")

    async def load(self, name: str) -> worker_pb2.LoadReport:
        async with grpc.aio.insecure_channel(self.address(name)) as ch:
            return await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(),
                                                                timeout=5)

    async def idle(self, names: list[str]) -> dict[str, tuple[int, int, int, float] | str]:
        """(running, waiting, active API requests, fraction of KV blocks held) of every
        worker in ``names`` that is not all zero: empty means no request and no KV block
        is held anywhere (cached blocks no request holds are free)."""
        busy: dict[str, tuple[int, int, int, float] | str] = {}
        for name in names:
            try:
                rep = await self.load(name)
            except grpc.aio.AioRpcError as exc:  # e.g. restarting: not settled yet
                busy[name] = f"unreachable: {exc.code().name}"
                continue
            if rep.num_running or rep.num_waiting or rep.active_requests or rep.kv_usage:
                busy[name] = (rep.num_running, rep.num_waiting, rep.active_requests,
                              rep.kv_usage)
        return busy

    async def index_mismatch(self, names: list[str]) -> dict[str, str]:
        """Workers whose blocks in the indexer's Dump differ from their own GetKvState
        (empty when the index matches every worker)."""
        try:
            async with grpc.aio.insecure_channel(self.address("indexer")) as ch:
                dump = await indexer_pb2_grpc.IndexerStub(ch).Dump(indexer_pb2.DumpRequest(),
                                                                  timeout=10)
        except grpc.aio.AioRpcError as exc:  # e.g. restarting: not in sync yet
            return {"indexer": f"unreachable: {exc.code().name}"}
        indexed = {s.worker_id: _blocks(s) for s in dump.workers}
        out = {}
        for name in names:
            async with grpc.aio.insecure_channel(self.address(name)) as ch:
                truth = await worker_pb2_grpc.WorkerStub(ch).GetKvState(
                    kv_events_pb2.KvStateRequest(), timeout=10)
            want, got = _blocks(truth), indexed.get(name, set())
            if want != got:
                out[name] = f"worker has {len(want)}, index {len(got)}, " \
                            f"{len(want ^ got)} differ"
        return out

    async def completion(self, prompt: str, max_tokens: int = 8, **extra: Any) -> httpx.Response:
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
            return await client.post("/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, **extra})

    async def stream(self, prompt: str, max_tokens: int,
                     **extra: Any) -> AsyncIterator[dict[str, Any]]:
        """The SSE events of one streamed completion, parsed (``[DONE]`` ends it)."""
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}, **extra}) as resp:
                if resp.status_code != 200:
                    body = await resp.aread()
                    yield {"status": resp.status_code, "error": json.loads(body or b"{}")}
                    return
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        yield json.loads(line[6:])


def _blocks(state: kv_events_pb2.KvState) -> set[tuple[str, int]]:
    return {(t.tier, h) for t in state.tiers for h in t.block_hashes}


def monotonic() -> float:
    """The clock a fault's reaction time is measured with (reported, never asserted)."""
    return time.monotonic()
