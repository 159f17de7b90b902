"""AFD served through the mesh over NIXL (``--afd-transport nixl``, UCX on loopback):
router + frontend (in this process), one FFN worker shared by two attention worker
processes (2A1F), tiny model, real etcd (see ``test_afd_mesh.py`` for the shm mesh).

- pairing: the FFN's record carries its NIXL endpoint info (base64 label), the attention
  workers connect to it and announce themselves in band, the FFN connects both;
- a greedy completion through the openai client equals the unsplit engine's tokens, and
  each attention worker serves the same tokens when asked directly;
- the FFN worker SIGKILLed mid-stream: the stream ends with an error, the attention
  worker frees the request's KV and leaves etcd; a new FFN worker (a new NIXL endpoint
  under the same id): both attention workers pair again and serve the same tokens.
"""

from __future__ import annotations

import base64
import os
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import openai
import pytest

# imported before any thread does (see test_afd_mesh.py)
import transformers.models.auto.tokenization_auto  # noqa: F401

from protos import common_pb2, discovery_pb2, worker_pb2, worker_pb2_grpc
from services.common.config import load_config
from services.common.procs import Child, spawn
from services.frontend.main import FrontendApp, FrontendConfig, start_frontend
from services.router.main import RouterApp, RouterConfig, start_router
from tests.integration.conftest import base_args
from tests.integration.test_afd_mesh import listed, served, unsplit_greedy, worker_load
from tests.integration.test_afd_mesh import records as afd_records
from tests.integration.test_afd_mesh import worker_argv as afd_worker_argv
from tests.waiting import wait_for
from workers.engines.afd.transport_nixl import EndpointInfo
from workers.engines.afd.worker import NIXL_INFO_LABEL

NS = "afdnixl"
MODEL = "tiny"
PROMPT = [7, 8, 9]


@dataclass
class NixlMesh:
    etcd: str
    router: RouterApp
    frontend: FrontendApp
    ffn_id: str
    attn_ids: list[str]
    log_dir: Path
    ffn: Child | None = None
    attns: list[Child] = field(default_factory=list)

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.frontend.base_url + "/v1", api_key="x",
                                  max_retries=0, timeout=60)

    def start_ffn(self) -> Child:
        self.ffn = spawn(f"ffn-{uuid.uuid4().hex[:6]}", worker_argv(
            self.etcd, "--afd-role", "ffn", "--worker-id", self.ffn_id), self.log_dir)
        return self.ffn

    def logs(self) -> str:
        return "\n".join(c.log_tail() for c in [*self.attns, self.ffn] if c is not None)


def worker_argv(etcd: str, *args: str) -> list[str]:
    return afd_worker_argv(etcd, "--afd-transport", "nixl", "--afd-attention-workers", "2",
                           *args, ns=NS, metrics_port="-1")


async def records(etcd: str) -> dict[str, discovery_pb2.InstanceRecord]:
    return await afd_records(etcd, NS)


async def all_listed(mesh: NixlMesh) -> bool:
    for child in [*mesh.attns, mesh.ffn]:
        if child is not None and not child.alive():
            raise AssertionError(f"{child.name} exited: {child.log_tail()}")
    return await listed(mesh) == sorted(mesh.attn_ids)  # type: ignore[arg-type]  # duck


@pytest.fixture(scope="module")
async def nixl_mesh(etcd: Child, tmp_path_factory: pytest.TempPathFactory,
                    tiny_model: str) -> AsyncIterator[NixlMesh]:
    logs = tmp_path_factory.mktemp("afd-nixl-logs")
    args = base_args(etcd.address, NS)
    router = await start_router(load_config(RouterConfig, [*args, "--load-poll-s", "0.2"], {}))
    frontend = await start_frontend(load_config(FrontendConfig, [*args, "--http-port", "0"],
                                                {}))
    tag = uuid.uuid4().hex[:6]
    mesh = NixlMesh(etcd.address, router, frontend, f"afd-ffn-{tag}",
                    [f"afd-attn{i}-{tag}" for i in range(2)], logs)
    mesh.start_ffn()
    mesh.attns = [spawn(f"attn{i}-{tag}", worker_argv(
        etcd.address, "--afd-role", "attention", "--afd-ffn-id", mesh.ffn_id,
        "--afd-attention-id", str(i), "--worker-id", aid), logs)
        for i, aid in enumerate(mesh.attn_ids)]
    try:
        await wait_for(lambda: all_listed(mesh), 150,
                       lambda: f"both attention workers to register ({logs}: {mesh.logs()})")
        await wait_for(lambda: served(mesh), 30,  # type: ignore[arg-type]
                       "the frontend to list the model")
        yield mesh
    finally:
        for child in [*mesh.attns, mesh.ffn]:
            if child is not None:
                child.stop()
        await frontend.server.stop()
        await router.server.stop()


async def direct_greedy(address: str, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of a Generate sent straight to one attention worker."""
    out: list[int] = []
    async with grpc.aio.insecure_channel(address) as ch:
        async for chunk in worker_pb2_grpc.WorkerStub(ch).Generate(worker_pb2.GenerateRequest(
                request_id=f"direct-{uuid.uuid4().hex[:6]}", token_ids=prompt,
                sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens))):
            out += list(chunk.token_ids)
    return out


async def assert_serves(mesh: NixlMesh, want: list[int]) -> None:
    """Through the frontend, and on each attention worker directly: ``want``."""
    got = (await mesh.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=len(want), temperature=0,
        extra_body={"return_token_ids": True})).model_dump()
    assert got["choices"][0]["token_ids"] == want, got
    recs = await records(mesh.etcd)
    for aid in mesh.attn_ids:
        assert await direct_greedy(recs[aid].address, PROMPT, len(want)) == want, aid


async def test_nixl_pairing_and_greedy_tokens_equal_unsplit(nixl_mesh: NixlMesh,
                                                            tiny_model: str) -> None:
    ffn = (await records(nixl_mesh.etcd))[nixl_mesh.ffn_id]
    assert ffn.labels["afd_transport"] == "nixl"
    info = EndpointInfo.from_bytes(base64.b64decode(ffn.labels[NIXL_INFO_LABEL]))
    assert info.role == "ffn" and info.config.attention_workers == 2
    await assert_serves(nixl_mesh, await unsplit_greedy(tiny_model, PROMPT, 8))


async def test_ffn_killed_mid_stream_errors_then_a_new_ffn_serves(
        nixl_mesh: NixlMesh, tiny_model: str) -> None:
    mesh = nixl_mesh
    assert mesh.ffn is not None
    recs = await records(mesh.etcd)
    old_info = recs[mesh.ffn_id].labels[NIXL_INFO_LABEL]
    addresses = [recs[aid].address for aid in mesh.attn_ids]
    stream = await mesh.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=900, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    chunks = 0
    with pytest.raises(openai.APIError) as err:
        async for _chunk in stream:
            chunks += 1
            if chunks == 3:  # mid-stream: the FFN dies
                os.kill(mesh.ffn.pid, signal.SIGKILL)
    assert chunks < 900
    # the attempt failed with the transport error; the frontend's migration found no other
    # paired worker (the idle one may have left etcd already), so the stream ends with a 503
    message = str(err.value)
    assert "FFN" in message or "no live worker" in message, message
    mesh.ffn.proc.wait(10)
    # every attention worker notices (the one streaming, and the idle one), frees the KV
    # and leaves etcd
    await wait_for(lambda: _none_listed(mesh), 30,
                   lambda: f"the unpaired attention workers to leave ({mesh.logs()})")
    assert all("AFD FFN at" in c.log_tail() and "lost" in c.log_tail()
               for c in mesh.attns), mesh.logs()
    for address in addresses:  # unregistered, still answering: nothing running, KV free
        load = await worker_load(address)
        assert load.num_running == 0 and load.num_waiting == 0 and load.kv_usage == 0.0, load
    # a new FFN under the same id: a new endpoint, both attention workers pair again
    mesh.start_ffn()
    await wait_for(lambda: all_listed(mesh), 150,
                   lambda: f"re-pairing ({mesh.logs()})")
    recs = await records(mesh.etcd)
    assert recs[mesh.ffn_id].labels[NIXL_INFO_LABEL] != old_info
    await assert_serves(mesh, await unsplit_greedy(tiny_model, PROMPT, 8))


async def _none_listed(mesh: NixlMesh) -> bool:
    return not await listed(mesh)  # type: ignore[arg-type]
