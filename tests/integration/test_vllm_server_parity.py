"""The README's "vLLM server" column, checked: vLLM's own OpenAI server runs beside
kvmesh, on the same tiny model (float32, the same engine settings), and every case of
:data:`tests.compat.cases.CASES` (one per row of the README's compatibility table) runs
on both.

- ``vllm_server``: ``python -m vllm.entrypoints.openai.api_server`` as its own process
  (own process group, free loopback port; vLLM-CPU flags as the repo's workers use them:
  block size 32, ``max_model_len`` 512, 0.25 GiB of KV cache, eager, one OMP thread),
  ready when ``/health`` answers (a timeout, or the server exiting, fails); stopped by
  its process group at teardown, which asserts that its EngineCore child died too.
- kvmesh is the session ``mesh`` (tests/integration/conftest.py: router, one in-process
  vLLM worker of the same model and settings, frontend).
- ``test_case_passes_on_both[<key>]``: the case's own assertions hold on vLLM's server
  and on kvmesh, and for deterministic cases (greedy or seeded) kvmesh's normalised
  result equals vLLM server's (tokens, texts, log-probabilities within 5e-4, tool
  calls, usage).
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from services.common.procs import Child, free_port, spawn
from services.frontend.models import Tokenizer
from tests.compat.cases import CASES, KVMESH, VLLM, Target, assert_same
from tests.integration.conftest import Mesh
from tests.waiting import wait_for, wait_for_sync

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

START_TIMEOUT_S = 300  # two shared cores: vLLM's server takes ~50 s to answer /health


def server_argv(model: str, port: int) -> list[str]:
    """vLLM's OpenAI server on the tiny model, configured as the mesh's worker is."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", "tiny", "--dtype", "float32",
            "--enable-prompt-tokens-details", "--enable-auto-tool-choice",
            "--tool-call-parser", "hermes", "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", "512", "--block-size", "32",
            "--kv-cache-memory-bytes", str(1 << 28), "--enforce-eager", "--seed", "0"]


def engine_cores(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True)
            if "EngineCore" in " ".join(p.cmdline())]


def gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="module")
def vllm_child(tiny_model: str, log_dir: Path) -> Iterator[Child]:
    """vLLM's server process, started (not yet ready); stopped by process group."""
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    port = free_port()
    child = spawn("vllm-openai-server", server_argv(tiny_model, port), log_dir, env)
    child.address = f"127.0.0.1:{port}"
    cores: list[psutil.Process] = []
    try:
        yield child
        cores = engine_cores(child.pid)
        assert cores, f"no EngineCore child of vLLM's server:\n{child.log_tail()}"
    finally:
        child.stop(timeout=30)
        wait_for_sync(lambda: all(gone(p) for p in cores), 30,
                      lambda: f"vLLM's EngineCore {[p.pid for p in cores]} to exit")


@pytest.fixture(scope="module")
async def vllm_server(vllm_child: Child, mesh: Mesh) -> AsyncIterator[str]:
    """vLLM server's URL once ``/health`` answers 200 (the mesh starts meanwhile)."""
    url = f"http://{vllm_child.address}"

    async def healthy() -> bool:
        assert vllm_child.alive(), f"vLLM's server exited:\n{vllm_child.log_tail()}"
        try:
            async with httpx.AsyncClient(timeout=5) as http:
                return (await http.get(url + "/health")).status_code == 200
        except httpx.TransportError:
            return False

    await wait_for(healthy, START_TIMEOUT_S,
                   lambda: f"vLLM's server at {url}/health:\n{vllm_child.log_tail()}",
                   interval_s=0.5)
    yield url


@pytest.fixture(scope="module")
def targets(vllm_server: str, mesh: Mesh, tiny_model: str) -> dict[str, Target]:
    tok = Tokenizer(tiny_model)
    return {VLLM: Target(VLLM, vllm_server, "tiny", tok),
            KVMESH: Target(KVMESH, mesh.url, mesh.model, tok)}


@pytest.mark.parametrize("key", list(CASES))
async def test_case_passes_on_both(key: str, targets: dict[str, Target]) -> None:
    case = CASES[key]
    ref = await case.run(targets[VLLM])
    got = await case.run(targets[KVMESH])
    if case.same:
        assert_same(got, ref, f"kvmesh's {key}")
