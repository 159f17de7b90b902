"""32 mock workers in this process on real etcd and Redis, plus the indexer service.

28 aggregated workers and a 2 + 2 prefill/decode split: all register in etcd under their
own leases; a request through a worker's gRPC Generate streams tokens and its blocks reach
the indexer through the worker's in-process KV event relay; a P→D handoff works over gRPC;
stopping the fleet removes every record.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import grpc
import pytest

from protos import (
    common_pb2,
    discovery_pb2,
    indexer_pb2,
    indexer_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.config import load_config
from services.common.discovery import etcd_client, instances_prefix
from services.common.procs import Child
from services.indexer.main import IndexerApp, IndexerConfig, start_indexer
from tests.integration.conftest import base_args
from tests.waiting import wait_for
from workers.fleet import Fleet, FleetConfig, start_fleet
from workers.service import WHOLE_FLUSH_TOKENS

NS = "mockfleet"
BLOCK = 32


async def records(etcd: str) -> dict[str, discovery_pb2.InstanceRecord]:
    client = etcd_client(etcd)
    await client.connect()
    try:
        out = {}
        for kv in await client.get_prefix(instances_prefix(NS, "worker").encode()):
            rec = discovery_pb2.InstanceRecord()
            rec.ParseFromString(kv.value)
            out[rec.instance_id] = rec
        return out
    finally:
        await client.close()


async def generate(address: str, req: worker_pb2.GenerateRequest) -> list[
        worker_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as ch:
        return [r async for r in worker_pb2_grpc.WorkerStub(ch).Generate(req)]


@pytest.fixture(scope="module")
async def fleet(etcd: Child, redis_server: Child) -> AsyncIterator[tuple[Fleet, IndexerApp]]:
    args = [*base_args(etcd.address, NS), "--redis-url", f"redis://{redis_server.address}"]
    cfg = load_config(FleetConfig, [
        *args, "--workers", "28", "--prefill-workers", "2", "--decode-workers", "2",
        "--block-size", str(BLOCK), "--num-blocks", "256", "--max-model-len", "2048",
        "--timing", "poly", "--speedup-ratio", "20", "--worker-id", "fl-"], {})
    indexer = await start_indexer(load_config(IndexerConfig, [*args, "--group", "fl"], {}))
    f = await start_fleet(cfg)
    try:
        yield f, indexer
    finally:
        await f.stop()
        await indexer.server.stop()


async def test_all_workers_register_with_their_roles(fleet: tuple[Fleet, IndexerApp],
                                                     etcd: Child) -> None:
    f, _ = fleet
    assert len(f.workers) == 32
    assert len({w.address for w in f.workers}) == 32
    recs = await records(etcd.address)
    assert set(recs) == {w.worker_id for w in f.workers}
    roles = [recs[w.worker_id].role for w in f.workers]
    assert roles.count(discovery_pb2.WORKER_ROLE_AGG) == 28
    assert roles.count(discovery_pb2.WORKER_ROLE_PREFILL) == 2
    assert roles.count(discovery_pb2.WORKER_ROLE_DECODE) == 2
    assert {r.engine for r in recs.values()} == {"mock"}
    assert recs["fl-p28"].handoff.mode == "mock" and not recs["fl-a0"].handoff.mode
    assert "kv_events" in recs["fl-a0"].capabilities
    # the pid in its typed field (one process: the fleet's), no metrics endpoint here, and
    # labels only for people
    assert {r.pid for r in recs.values()} == {os.getpid()}
    assert {r.metrics_address for r in recs.values()} == {""}
    assert {tuple(r.labels) for r in recs.values()} == {("fleet_index",)}


async def test_generate_streams_and_blocks_reach_the_indexer(
        fleet: tuple[Fleet, IndexerApp]) -> None:
    f, indexer = fleet
    worker = f.workers[5]
    prompt = [(7 * i + 3) % 1000 for i in range(4 * BLOCK + 9)]
    req = worker_pb2.GenerateRequest(request_id="fl-1", token_ids=prompt, model="mock",
                                     sampling=common_pb2.SamplingParams(max_tokens=6))
    chunks = await generate(worker.address, req)
    assert sum(len(c.token_ids) for c in chunks) == 6
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert chunks[-1].usage.prompt_tokens == len(prompt)
    assert {c.worker_id for c in chunks} == {worker.worker_id}

    async with grpc.aio.insecure_channel(indexer.server.address) as ch:
        stub = indexer_pb2_grpc.IndexerStub(ch)

        async def overlap() -> int:
            resp = await stub.FindMatches(indexer_pb2.FindMatchesRequest(
                token_ids=prompt, block_size=BLOCK))
            return next((o.blocks for o in resp.overlaps if o.worker_id == worker.worker_id), 0)

        await wait_for(overlap, 10, "the indexer to see the worker's blocks")
        assert await overlap() == 4
    again = await generate(worker.address, worker_pb2.GenerateRequest(
        request_id="fl-2", token_ids=prompt, model="mock",
        sampling=common_pb2.SamplingParams(max_tokens=2)))
    assert again[-1].usage.cached_tokens == 4 * BLOCK


async def test_prefill_decode_handoff_over_grpc(fleet: tuple[Fleet, IndexerApp]) -> None:
    f, _ = fleet
    p, d = f.by_role("prefill")[0], f.by_role("decode")[0]
    prompt = list(range(1, 3 * BLOCK + 1))
    p_req = worker_pb2.GenerateRequest(
        request_id="fl-pd", token_ids=prompt, model="mock",
        sampling=common_pb2.SamplingParams(max_tokens=1, ignore_eos=True))
    p_req.kv_transfer.do_remote_decode = True
    p_last = (await generate(p.address, p_req))[-1]
    assert p_last.kv_transfer.do_remote_prefill
    assert p_last.kv_transfer.remote_engine_id == p.engine.info.handoff["engine_id"]
    assert len(p_last.kv_transfer.remote_block_ids) == 3
    d_req = worker_pb2.GenerateRequest(request_id="fl-pd", token_ids=prompt, model="mock",
                                       sampling=common_pb2.SamplingParams(max_tokens=4))
    d_req.kv_transfer.CopyFrom(p_last.kv_transfer)
    d_req.kv_transfer.do_remote_decode = False
    chunks = await generate(d.address, d_req)
    assert sum(len(c.token_ids) for c in chunks) == 4
    assert chunks[-1].usage.cached_tokens == len(prompt) - 1
    assert d.engine.counters()["kv_transfers"] == 1


async def test_a_whole_answer_is_its_first_tokens_then_one_message(
        fleet: tuple[Fleet, IndexerApp]) -> None:
    """GenerateRequest.whole: the first token comes alone, the rest in the finishing
    message (or per WHOLE_FLUSH_TOKENS); the tokens and text are the streamed call's."""
    f, _ = fleet
    worker = f.workers[7]
    prompt = [(5 * i + 1) % 900 for i in range(2 * BLOCK)]
    answers = {}
    for whole, n in ((False, 40), (True, 40), (True, WHOLE_FLUSH_TOKENS + 30)):
        req = worker_pb2.GenerateRequest(
            request_id=f"fl-whole-{whole}-{n}", token_ids=prompt, model="mock", whole=whole,
            sampling=common_pb2.SamplingParams(max_tokens=n, ignore_eos=True, seed=3))
        answers[whole, n] = await generate(worker.address, req)
    sizes = {k: [len(c.token_ids) for c in v if c.token_ids] for k, v in answers.items()}
    # the first message holds what the engine had then: one token, or more when the
    # worker's loop lagged behind the engine's steps
    assert len(sizes[True, 40]) == 2 and sum(sizes[True, 40]) == 40, sizes
    big = sizes[True, WHOLE_FLUSH_TOKENS + 30]
    assert len(big) == 3 and sum(big) == WHOLE_FLUSH_TOKENS + 30, sizes
    assert WHOLE_FLUSH_TOKENS <= big[1] < WHOLE_FLUSH_TOKENS + 30, sizes
    streamed, whole_40 = answers[False, 40], answers[True, 40]
    assert [t for c in whole_40 for t in c.token_ids] == \
        [t for c in streamed for t in c.token_ids]
    assert "".join(c.text for c in whole_40) == "".join(c.text for c in streamed)
    assert whole_40[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert whole_40[-1].usage.completion_tokens == 40


async def test_malformed_kv_transfer_is_refused_naming_the_key(
        fleet: tuple[Fleet, IndexerApp]) -> None:
    f, _ = fleet
    d = f.by_role("decode")[0]
    req = worker_pb2.GenerateRequest(request_id="fl-bad", token_ids=[1, 2, 3], model="mock",
                                     sampling=common_pb2.SamplingParams(max_tokens=2))
    req.kv_transfer.do_remote_prefill = True
    req.kv_transfer.extra["future_key"].list_value.values.add()  # a Value with no kind
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(d.address, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "kv_transfer_params['future_key'][0]" in (err.value.details() or "")
    # the worker still serves
    req.ClearField("kv_transfer")
    assert (await generate(d.address, req))[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


async def test_stop_removes_every_record(etcd: Child, redis_server: Child) -> None:
    args = [*base_args(etcd.address, NS), "--redis-url", f"redis://{redis_server.address}"]
    small = await start_fleet(load_config(FleetConfig, [
        *args, "--workers", "3", "--worker-id", "gone-", "--timing", "zero"], {}))
    assert {w.worker_id for w in small.workers} <= set(await records(etcd.address))
    await small.stop()
    await small.stop()  # idempotent
    assert not {w.worker_id for w in small.workers} & set(await records(etcd.address))
