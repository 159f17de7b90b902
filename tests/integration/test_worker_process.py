"""A worker in its own process: crash and graceful stop as the mesh sees them."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.common.procs import Child, spawn
from tests.integration.conftest import Mesh, base_args
from tests.waiting import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TTL = 2


async def start_worker(mesh: Mesh, name: str, model_path: str, log_dir: Path,
                       ttl: int = TTL) -> Child:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    child = spawn(name, [sys.executable, "-m", "workers", *base_args(mesh.etcd, "itest"),
                         "--lease-ttl", str(ttl), "--model-path", model_path,
                         "--model-name", name, "--kv-cache-gib", "0.25",
                         "--max-model-len", "1024"], log_dir, env)

    def routable() -> bool:
        assert child.alive(), child.log_tail()
        return routable_model(mesh, name)

    await wait_for(routable, 180, lambda: f"worker {name} routable; log: {child.log_tail()}",
                   interval_s=0.1)
    return child


def routable_model(mesh: Mesh, name: str) -> bool:
    return any(r.model == name for r in mesh.router.watcher.instances().values())


async def wait_gone(mesh: Mesh, name: str, deadline: float, why: str) -> None:
    """Until the router no longer lists ``name``; fails at ``deadline`` (monotonic)."""
    await wait_for(lambda: not routable_model(mesh, name), deadline - time.monotonic(),
                   f"{name} to leave routing {why}")


async def test_killed_worker_errors_the_request_and_leaves_routing(
    mesh: Mesh, tiny_model: str, log_dir: Path
) -> None:
    child = await start_worker(mesh, "doomed", tiny_model, log_dir)
    events: list[str] = []
    try:
        async with httpx.AsyncClient(base_url=mesh.url, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json={
                "model": "doomed", "prompt": "a long story", "max_tokens": 900,
                "ignore_eos": True, "temperature": 0, "stream": True}) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    if len(events) == 2:
                        child.kill()
                        killed_at = time.monotonic()
        # only the lease's expiry can remove a killed worker; the slack is for a loaded host
        await wait_gone(mesh, "doomed", killed_at + TTL + 15.0, "15 s after its lease TTL")
    finally:
        child.stop()
    assert events[-1] == "[DONE]"  # after the error event, as vLLM's server ends a stream
    last = json.loads(events[-2])
    assert "error" in last and last["error"]["message"]
    async with httpx.AsyncClient(base_url=mesh.url, timeout=30) as client:
        gone = await client.post("/v1/completions", json={"model": "doomed", "prompt": "x"})
        assert gone.status_code == 404
        ok = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                                         "max_tokens": 2})
        assert ok.status_code == 200


async def test_sigterm_revokes_the_lease_at_once(
    mesh: Mesh, tiny_model: str, log_dir: Path
) -> None:
    # A TTL far beyond the deadline: only a revoke (not expiry) can meet it, even when the
    # CI host is slow to deliver the signal or the watch event.
    child = await start_worker(mesh, "polite", tiny_model, log_dir, ttl=120)
    child.proc.send_signal(15)
    stopped = time.monotonic()
    await wait_gone(mesh, "polite", stopped + 30.0, "30 s after SIGTERM (TTL 120 s)")
    code = await asyncio.to_thread(child.proc.wait, 30)
    assert code == 0, child.log_tail()
