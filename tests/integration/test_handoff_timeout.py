"""Issue 12 row 1: a well-formed remote-prefill request naming a prefill worker that is not
there no longer parks a vLLM decode worker (before: it waited for ever, holding its KV
blocks, in pull mode with a flat ``remote_block_ids``).

The crafted request points at 127.0.0.1 on a closed port, with a random engine id and
plausible block ids. Two decode workers, one engine start each:

- pull, ``kv_load_failure_policy=recompute``, ``--kv-handoff-timeout-s 2`` (below vLLM's
  fixed 5 s NIXL handshake timeout, so the worker's own bound fires): the client gets the
  tokens of a local run;
- push, ``fail``, ``--kv-handoff-timeout-s 2``: the worker's bound is pull-only (an abort
  would free D's receive blocks while P may still WRITE into them), so it does not fire;
  vLLM's own 5 s handshake failure ends the request with UNAVAILABLE naming the handoff
  and blaming P (trailing metadata ``kvmesh-failed-role: prefill``).

Afterwards each D holds no request and no block (GetLoad) and serves a normal request.
The asyncio timeouts are hang guards, larger than the bound; nothing asserts wall time.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest

from protos import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.config import load_config
from services.common.procs import Child, free_port
from tests.integration.conftest import base_args
from tests.waiting import wait_for
from workers.config import WorkerConfig
from workers.main import build_engine, build_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
NS = "handoff-timeout"
PROMPT = [3 + (i * 53) % 650 for i in range(4 * 32 + 7)]
GUARD_S = 60  # hang guard: well above each bound (2 s, and vLLM's 5 s handshake)


@pytest.fixture
async def decode_worker(etcd: Child, tiny_model: str,
                        request: pytest.FixtureRequest) -> AsyncIterator[str]:
    mode, policy, *extra = request.param
    cfg = load_config(WorkerConfig, [
        *base_args(etcd.address, NS), "--model-path", tiny_model, "--model-name",
        f"tiny-{mode}", "--role", "decode", "--handoff", mode, "--kv-load-failure-policy",
        policy, "--kv-cache-gib", "0.25", "--max-model-len", "512", *extra], {})
    engine = build_engine(cfg)
    await engine.start()
    server = build_server(cfg, engine)
    await server.start()
    try:
        yield server.address
    finally:
        await server.stop()


def crafted(mode: str) -> worker_pb2.GenerateRequest:
    """Well-formed remote prefill from a prefill worker that does not exist."""
    req = worker_pb2.GenerateRequest(
        request_id=f"ghost-{uuid.uuid4().hex[:8]}", token_ids=PROMPT, model=f"tiny-{mode}",
        sampling=common_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    kv = req.kv_transfer
    kv.do_remote_prefill = True
    kv.remote_engine_id = f"ghost-{uuid.uuid4().hex}"
    kv.remote_request_id = f"ghost-req-{uuid.uuid4().hex[:8]}"
    kv.remote_host = "127.0.0.1"
    kv.remote_port = free_port()  # nothing listens there
    kv.tp_size = 1
    if mode == "pull":
        kv.remote_block_ids.extend([11, 12, 13, 14, 15])  # flat, as the issue sent them
    return req


def plain(req: worker_pb2.GenerateRequest) -> worker_pb2.GenerateRequest:
    out = worker_pb2.GenerateRequest()
    out.CopyFrom(req)
    out.ClearField("kv_transfer")
    out.request_id = f"local-{uuid.uuid4().hex[:8]}"
    return out


async def generate(stub: worker_pb2_grpc.WorkerStub,
                   req: worker_pb2.GenerateRequest) -> list[worker_pb2.GenerateResponse]:
    async def collect() -> list[worker_pb2.GenerateResponse]:
        return [r async for r in stub.Generate(req)]

    return await asyncio.wait_for(collect(), GUARD_S)


async def assert_idle(stub: worker_pb2_grpc.WorkerStub) -> worker_pb2.LoadReport:
    """D holds no request and no KV block (the baseline of a fresh engine is 0)."""
    async def idle() -> worker_pb2.LoadReport | None:
        load = await stub.GetLoad(worker_pb2.GetLoadRequest())
        done = (load.num_running, load.num_waiting, load.kv_usage, load.active_requests)
        return load if done == (0, 0, 0.0, 0) else None

    return await wait_for(idle, GUARD_S, "D to hold no request and no KV block")


def tokens(out: list[worker_pb2.GenerateResponse]) -> list[int]:
    return [t for r in out for t in r.token_ids]


@pytest.mark.parametrize("decode_worker", [("pull", "recompute", "--kv-handoff-timeout-s",
                                            "2")], indirect=True)
async def test_pull_times_out_and_recomputes(decode_worker: str) -> None:
    async with grpc.aio.insecure_channel(decode_worker) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        req = crafted("pull")
        out = await generate(stub, req)
        assert out[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        load = await assert_idle(stub)
        assert load.counters["kv_handoff_timeouts"] == 1  # the worker's bound fired
        local = await generate(stub, plain(req))
        assert local[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert tokens(out) == tokens(local) and len(tokens(out)) == 6
        await assert_idle(stub)


@pytest.mark.parametrize("decode_worker", [("push", "fail", "--kv-handoff-timeout-s", "2")],
                         indirect=True)
async def test_push_fails_naming_the_handoff(decode_worker: str) -> None:
    async with grpc.aio.insecure_channel(decode_worker) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        req = crafted("push")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(stub, req)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "KV handoff failed" in (err.value.details() or "")
        assert req.kv_transfer.remote_engine_id in (err.value.details() or "")
        assert ("kvmesh-failed-role", "prefill") in tuple(err.value.trailing_metadata() or ())
        load = await assert_idle(stub)
        assert load.counters["kv_handoff_timeouts"] == 0  # no local bound in push mode
        out = await generate(stub, plain(req))
        assert out[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert len(tokens(out)) == 6
        await assert_idle(stub)
