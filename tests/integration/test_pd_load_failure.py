"""D's kv_load_failure_policy when P dies after prefill, set from the mesh's worker config."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from protos import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.config import load_config
from services.common.discovery import InstanceWatcher
from services.common.procs import Child, spawn
from tests.integration.conftest import Mesh, base_args
from tests.waiting import wait_for
from workers.config import WorkerConfig
from workers.main import build_engine, build_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
NS = "pdfail"
PROMPT = [3 + (i * 71) % 700 for i in range(4 * 32 + 5)]


async def start_d(etcd: str, tiny_model: str, policy: str):  # type: ignore[no-untyped-def]
    cfg = load_config(WorkerConfig, [*base_args(etcd, NS), "--model-path", tiny_model,
                                     "--model-name", f"tiny-{policy}", "--role", "decode",
                                     "--kv-load-failure-policy", policy,
                                     "--kv-cache-gib", "0.25", "--max-model-len", "512"], {})
    engine = build_engine(cfg)
    await engine.start()
    server = build_server(cfg, engine)
    await server.start()
    return server


@pytest.fixture(scope="module")
async def prefill_process(etcd: Child, tiny_model: str,
                          log_dir: Path) -> AsyncIterator[tuple[Child, str]]:
    child = spawn("doomed-prefill", [
        sys.executable, "-m", "workers", *base_args(etcd.address, NS), "--model-path",
        tiny_model, "--model-name", "tiny-p", "--role", "prefill", "--kv-cache-gib", "0.25",
        "--max-model-len", "512"], log_dir, {**os.environ})
    watcher = InstanceWatcher(etcd.address, NS, "worker")
    await watcher.start()

    def registered() -> str:
        assert child.alive(), child.log_tail()
        return next((r.address for r in watcher.instances().values() if r.model == "tiny-p"),
                    "")

    try:
        try:
            address = await wait_for(registered, 180, lambda: "the prefill process in etcd; "
                                     f"log: {child.log_tail()}", interval_s=0.2)
        finally:
            await watcher.close()
        yield child, address
    finally:
        child.stop()


async def prefill_then_kill(child: Child, address: str) -> worker_pb2.KvTransferParams:
    req = worker_pb2.GenerateRequest(request_id="dies-1", token_ids=PROMPT, model="tiny-p",
                                     sampling=common_pb2.SamplingParams(max_tokens=1))
    req.kv_transfer.do_remote_decode = True
    async with grpc.aio.insecure_channel(address) as ch:
        out = [r async for r in worker_pb2_grpc.WorkerStub(ch).Generate(req)]
    child.kill()  # P dies holding the blocks D was about to read
    return out[-1].kv_transfer


async def decode(address: str, model: str,
                 params: worker_pb2.KvTransferParams) -> list[worker_pb2.GenerateResponse]:
    req = worker_pb2.GenerateRequest(request_id="dies-1", token_ids=PROMPT, model=model,
                                     sampling=common_pb2.SamplingParams(
                                         max_tokens=6, temperature=0.0, ignore_eos=True))
    req.kv_transfer.CopyFrom(params)
    req.kv_transfer.do_remote_prefill = True
    req.kv_transfer.do_remote_decode = False
    async with grpc.aio.insecure_channel(address) as ch:
        call = worker_pb2_grpc.WorkerStub(ch).Generate(req)
        return await asyncio.wait_for(_collect(call), 120)


async def _collect(call) -> list[worker_pb2.GenerateResponse]:  # type: ignore[no-untyped-def]
    return [r async for r in call]


async def test_recompute_and_fail_policies_when_p_dies(
    prefill_process: tuple[Child, str], etcd: Child, tiny_model: str, mesh: Mesh
) -> None:
    child, p_address = prefill_process
    recompute = await start_d(etcd.address, tiny_model, "recompute")
    fail = await start_d(etcd.address, tiny_model, "fail")
    try:
        params = await prefill_then_kill(child, p_address)
        # recompute: D computes the prompt itself; the answer is the aggregated one.
        import httpx

        async with httpx.AsyncClient(base_url=mesh.url, timeout=60) as client:
            ref = (await client.post("/v1/completions", json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True})).json()["choices"][0]["text"]
        out = await decode(recompute.address, "tiny-recompute", params)
        assert out[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert "".join(r.text for r in out) == ref
        # fail: the request ends in error instead of a recomputed answer.
        failed: list[worker_pb2.GenerateResponse] | None = None
        try:
            failed = await decode(fail.address, "tiny-fail", params)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() != grpc.StatusCode.OK
        if failed is not None:
            assert failed[-1].finish_reason in (common_pb2.FINISH_REASON_ERROR,
                                                common_pb2.FINISH_REASON_ABORT)
            assert sum(len(r.token_ids) for r in failed) < 6
    finally:
        await fail.stop()
        await recompute.stop()
