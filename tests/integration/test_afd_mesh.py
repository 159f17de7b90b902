"""AFD served through the mesh: router + frontend (in this process) + an AFD attention
worker and its FFN worker, each a ``python -m workers --engine afd`` process of its own,
on the tiny model over the shared-memory transport, on real etcd.

- the official openai client, chat and completions, streamed and whole: greedy tokens
  equal the unsplit AFD engine's for the same prompt ids (computed here, in-process);
- the router never routes to the FFN worker (ListWorkers lists only the attention
  worker; the FFN's record is in etcd all along) and the FFN refuses a direct Generate;
- the FFN worker SIGKILLed mid-stream: the stream ends with an error (not a hang), the
  attention worker answers UNAVAILABLE ``engine unavailable: ...`` (a warning in its
  log, no ``engine failed`` traceback), frees the request's KV (GetLoad), counts the
  transport error, leaves etcd (a new request is a 503); a new FFN worker with the same
  id: the attention worker pairs again, registers, and the mesh serves the same greedy
  tokens;
- the ``kvmesh_afd_*`` metrics on both workers' ``/metrics``.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest

# imported before any thread does: the frontend's tokenizer warm-up thread and a request's
# tokenizer thread importing transformers at once can hit its circular-import race
import transformers.models.auto.tokenization_auto  # noqa: F401
from openai.types.chat import ChatCompletionMessageParam

from protos import (
    common_pb2,
    discovery_pb2,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.config import load_config
from services.common.discovery import AFD_ATTENTION, AFD_FFN, read_instance_records
from services.common.procs import Child, spawn
from services.frontend.main import FrontendApp, FrontendConfig, start_frontend
from services.router.main import RouterApp, RouterConfig, start_router
from tests.integration.conftest import base_args
from tests.waiting import wait_for
from workers.engines.afd.engine import AfdEngine, UnsplitExecutor
from workers.engines.afd.kv_cache import KvCache
from workers.engines.afd.model import (
    AttentionSide,
    FfnSide,
    load_attention_side,
    load_ffn_side,
)
from workers.engines.afd.sampling import SamplingParams
from workers.engines.afd.transport_local import shm_path

NS = "afdmesh"
MODEL = "tiny"
REPO = Path(__file__).resolve().parents[2]


@dataclass
class AfdMesh:
    etcd: str
    router: RouterApp
    frontend: FrontendApp
    ffn_id: str
    attn_id: str
    log_dir: Path
    ffn: Child
    attn: Child

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.frontend.base_url + "/v1", api_key="x",
                                  max_retries=0, timeout=60)

    def start_ffn(self) -> Child:
        self.ffn = spawn(f"ffn-{uuid.uuid4().hex[:6]}", worker_argv(
            self.etcd, "--afd-role", "ffn", "--worker-id", self.ffn_id), self.log_dir)
        return self.ffn


def worker_argv(etcd: str, *args: str, ns: str = NS, metrics_port: str = "0") -> list[str]:
    """An AFD worker process on the tiny model in namespace ``ns``."""
    return [sys.executable, "-m", "workers", *base_args(etcd, ns), "--engine", "afd",
            "--model-path", "tiny", "--model-name", MODEL, "--max-model-len", "1024",
            "--kv-cache-gib", "0.05", "--metrics-port", metrics_port,
            "--afd-max-batch-tokens", "256", *args]


async def records(etcd: str, ns: str = NS) -> dict[str, discovery_pb2.InstanceRecord]:
    """Every worker record of namespace ``ns`` in etcd, by instance id."""
    return {r.instance_id: r for r in await read_instance_records(etcd, ns, "worker")}


async def registered(mesh: AfdMesh) -> list[str]:
    """The router's list, failing at once when a worker process exited."""
    for child in (mesh.ffn, mesh.attn):
        if not child.alive():
            raise AssertionError(f"{child.name} exited: {child.log_tail()}")
    return await listed(mesh)


async def served(mesh: AfdMesh) -> bool:
    async with httpx.AsyncClient(base_url=mesh.frontend.base_url, timeout=10) as http:
        models = (await http.get("/v1/models")).json()["data"]
    return any(m["id"] == MODEL for m in models)


async def listed(mesh: AfdMesh) -> list[str]:
    async with grpc.aio.insecure_channel(mesh.router.server.address) as ch:
        resp = await router_pb2_grpc.RouterStub(ch).ListWorkers(
            router_pb2.ListWorkersRequest())
    return sorted(w.instance_id for w in resp.workers)


@pytest.fixture(scope="module")
async def afd_mesh(etcd: Child, tmp_path_factory: pytest.TempPathFactory,
                   tiny_model: str) -> AsyncIterator[AfdMesh]:
    logs = tmp_path_factory.mktemp("afd-logs")
    args = base_args(etcd.address, NS)
    router = await start_router(load_config(RouterConfig, [*args, "--load-poll-s", "0.2"], {}))
    frontend = await start_frontend(load_config(FrontendConfig, [*args, "--http-port", "0"],
                                                {}))
    tag = uuid.uuid4().hex[:6]
    ffn_id, attn_id = f"afd-ffn-{tag}", f"afd-attn-{tag}"
    mesh = AfdMesh(etcd.address, router, frontend, ffn_id, attn_id, logs,
                   None, None)  # type: ignore[arg-type]
    mesh.start_ffn()
    mesh.attn = spawn(f"attn-{tag}", worker_argv(
        etcd.address, "--afd-role", "attention", "--afd-ffn-id", ffn_id,
        "--worker-id", attn_id), logs)
    try:
        await wait_for(lambda: registered(mesh), 120,
                       lambda: f"the attention worker to register (logs in {logs}: "
                               f"{mesh.attn.log_tail()}\n{mesh.ffn.log_tail()})")
        await wait_for(lambda: served(mesh), 30, "the frontend to list the model")
        yield mesh
    finally:
        for child in (mesh.attn, mesh.ffn):
            child.stop()
        # a stopped FFN removes its region; one killed last (an aborted run) cannot
        shm_path(f"{NS}.{ffn_id}").unlink(missing_ok=True)
        await frontend.server.stop()
        await router.server.stop()


@functools.cache
def _sides(model: str) -> tuple[AttentionSide, FfnSide]:
    return load_attention_side(model), load_ffn_side(model)


def _unsplit(model: str, prompt: list[int], max_tokens: int, ignore_eos: bool) -> list[int]:
    attn, ffn = _sides(model)
    engine = AfdEngine(attn, KvCache(attn.config, 4096), UnsplitExecutor(ffn))
    engine.add_request("ref", prompt, SamplingParams(max_tokens=max_tokens,
                                                     ignore_eos=ignore_eos))
    out: list[int] = []
    while engine.has_unfinished():
        out += [o.token for o in engine.step() if o.token is not None]
    return out


async def unsplit_greedy(model: str, prompt: list[int], max_tokens: int,
                         ignore_eos: bool = False) -> list[int]:
    """The reference: the unsplit AFD engine, in this process (off the event loop, which
    keeps the router's and frontend's etcd leases alive)."""
    return await asyncio.to_thread(_unsplit, model, prompt, max_tokens, ignore_eos)


async def tokenize(mesh: AfdMesh, **body: object) -> list[int]:
    async with httpx.AsyncClient(base_url=mesh.frontend.base_url, timeout=30) as http:
        resp = await http.post("/tokenize", json={"model": MODEL, **body})
        assert resp.status_code == 200, resp.text
        return list(resp.json()["tokens"])


async def worker_load(address: str) -> worker_pb2.LoadReport:
    async with grpc.aio.insecure_channel(address) as ch:
        return await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest())


async def test_openai_chat_and_completions_equal_the_unsplit_engine(
        afd_mesh: AfdMesh, tiny_model: str) -> None:
    client = afd_mesh.client()
    extra = {"return_token_ids": True}
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "a b c d"}]
    chat_ids = await tokenize(afd_mesh, messages=messages)
    want = await unsplit_greedy(tiny_model, chat_ids, 12)
    whole = (await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0,
        extra_body=extra)).model_dump()
    assert whole["choices"][0]["token_ids"] == want, whole
    assert whole["usage"]["completion_tokens"] == len(want)
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0,
        stream=True, extra_body=extra)
    ids: list[int] = []
    text = ""
    async for chunk in stream:
        for c in chunk.model_dump()["choices"]:
            ids += c.get("token_ids") or []
            text += c["delta"].get("content") or ""
    assert ids == want and text == whole["choices"][0]["message"]["content"]

    prompt = await tokenize(afd_mesh, prompt="x y z")
    want = await unsplit_greedy(tiny_model, prompt, 10)
    comp = (await client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                            temperature=0, extra_body=extra)).model_dump()
    assert comp["choices"][0]["token_ids"] == want, comp
    got: list[int] = []
    comp_stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True,
        extra_body=extra)
    async for piece in comp_stream:
        for c in piece.model_dump()["choices"]:
            got += c.get("token_ids") or []
    assert got == want


async def test_the_router_never_routes_to_the_ffn_worker(afd_mesh: AfdMesh) -> None:
    recs = await records(afd_mesh.etcd)
    ffn, attn = recs[afd_mesh.ffn_id], recs[afd_mesh.attn_id]
    assert list(ffn.capabilities) == [AFD_FFN] and ffn.labels["afd_role"] == AFD_FFN
    assert AFD_ATTENTION in attn.capabilities and attn.labels["afd_ffn"] == afd_mesh.ffn_id
    assert await listed(afd_mesh) == [afd_mesh.attn_id]
    for i in range(4):  # every route lands on the attention worker
        async with grpc.aio.insecure_channel(afd_mesh.router.server.address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            rid = f"afd-route-{i}"
            resp = await stub.Route(router_pb2.RouteRequest(request_id=rid, model=MODEL,
                                                            token_ids=[5, 6, 7, i]))
            assert resp.worker.instance_id == afd_mesh.attn_id
            await stub.Release(router_pb2.ReleaseRequest(request_id=rid))
    async with grpc.aio.insecure_channel(ffn.address) as ch:  # and it refuses a request
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in worker_pb2_grpc.WorkerStub(ch).Generate(worker_pb2.GenerateRequest(
                    request_id="direct", token_ids=[1, 2, 3],
                    sampling=common_pb2.SamplingParams(max_tokens=2))):
                pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "AFD FFN worker" in (err.value.details() or "")


async def metric(address: str, name: str) -> float:
    async with httpx.AsyncClient(timeout=10) as http:
        body = (await http.get(f"http://{address}/metrics")).text
    total = 0.0
    for line in body.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_metrics_on_both_workers(afd_mesh: AfdMesh) -> None:
    client = afd_mesh.client()
    await client.completions.create(model=MODEL, prompt=[3, 4, 5, 6], max_tokens=6,
                                    temperature=0)
    recs = await records(afd_mesh.etcd)
    attn, ffn = recs[afd_mesh.attn_id].metrics_address, recs[afd_mesh.ffn_id].metrics_address
    for name in ("kvmesh_afd_layer_transfer_seconds_count",
                 "kvmesh_afd_layer_round_trip_seconds_count", "kvmesh_afd_tpot_seconds_count",
                 "kvmesh_afd_attention_compute_seconds_total", "kvmesh_afd_idle_seconds_total",
                 "kvmesh_engine_afd_steps_total"):
        assert await metric(attn, name) > 0, name
    for name in ("kvmesh_afd_ffn_queue_seconds_count", "kvmesh_afd_ffn_compute_seconds_total",
                 "kvmesh_afd_layer_transfer_seconds_count", "kvmesh_engine_afd_ffn_messages_total"):
        assert await metric(ffn, name) > 0, name
    ratio = await metric(attn, "kvmesh_afd_overlap_ratio")
    assert 0.0 <= ratio <= 1.0


async def test_ffn_killed_mid_stream_ends_the_request_frees_kv_and_recovers(
        afd_mesh: AfdMesh, tiny_model: str) -> None:
    client = afd_mesh.client()
    recs = await records(afd_mesh.etcd)
    attn_address = recs[afd_mesh.attn_id].address
    attn_metrics = recs[afd_mesh.attn_id].metrics_address
    errors_before = await metric(attn_metrics, "kvmesh_engine_afd_transport_errors_total")
    stream = await client.completions.create(
        model=MODEL, prompt=[7, 8, 9], max_tokens=900, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    chunks = 0
    with pytest.raises(openai.APIError) as err:
        async for _chunk in stream:
            chunks += 1
            if chunks == 3:  # mid-stream: the FFN dies
                os.kill(afd_mesh.ffn.pid, signal.SIGKILL)
    # the attempt failed with the transport error; the frontend's migration found no other
    # worker (the only one failed it), so the client's stream ends with that 503
    message = str(err.value)
    # the FFN's loss, or (the attention worker already out of etcd, so the router has none
    # left for the migration) "no live worker" from the router
    assert "FFN" in message or "no live worker" in message, message
    assert chunks < 900
    assert "AFD FFN at" in afd_mesh.attn.log_tail() and "lost" in afd_mesh.attn.log_tail()
    # UNAVAILABLE (EngineUnavailableError), not an engine bug's INTERNAL with a traceback
    attn_log = afd_mesh.attn.log_path.read_text(errors="replace")
    assert "engine unavailable: " in attn_log and "engine failed" not in attn_log, \
        afd_mesh.attn.log_tail()
    afd_mesh.ffn.proc.wait(10)
    # the attention worker freed the KV, counted the error, and left etcd
    load = await wait_for(lambda: worker_load(attn_address), 10, "GetLoad")
    assert load.num_running == 0 and load.num_waiting == 0 and load.kv_usage == 0.0, load
    assert await metric(attn_metrics, "kvmesh_engine_afd_transport_errors_total") \
        == errors_before + 1
    await wait_for(lambda: _not_listed(afd_mesh), 20,
                   "the unpaired attention worker to leave the router's list")
    with pytest.raises(openai.APIStatusError) as refused:
        await client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=2)
    assert refused.value.status_code == 503, refused.value
    # a new FFN worker: the attention worker pairs again and serves the same tokens
    afd_mesh.start_ffn()
    await wait_for(lambda: registered(afd_mesh), 120,
                   lambda: f"re-pairing (attention log: {afd_mesh.attn.log_tail()})")
    want = await unsplit_greedy(tiny_model, [7, 8, 9], 8)
    again = (await client.completions.create(
        model=MODEL, prompt=[7, 8, 9], max_tokens=8, temperature=0,
        extra_body={"return_token_ids": True})).model_dump()
    assert again["choices"][0]["token_ids"] == want


async def _not_listed(mesh: AfdMesh) -> bool:
    return not await listed(mesh)
