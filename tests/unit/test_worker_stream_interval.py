"""vLLM's stream_interval: a streamed answer's first tokens go at once, later tokens in
messages of at least the interval (the last one excepted), the interval being the
request's (GenerateRequest.stream_interval, from the OpenAI body's ``stream_interval``)
or, when larger, the worker's ``--stream-interval``. The tokens and text are the same
whatever the interval.

Real Worker servicers over the mock engine on loopback gRPC servers; the pipeline case
runs a real RouterServicer and Pipeline over them (:mod:`tests.unit.test_frontend_release`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import grpc
import pytest

from protos import common_pb2, discovery_pb2, worker_pb2, worker_pb2_grpc
from services.frontend.jobs import Chunk
from tests.unit.test_frontend_release import MODEL, consume, mesh, node, request, serve
from workers.config import WorkerConfig
from workers.engines.base import EngineOutput, EngineRequest
from workers.engines.mock import MockEngine, MockEngineConfig
from workers.service import WHOLE_FLUSH_TOKENS, WorkerServicer

TOKENS = 23


class _Spy(MockEngine):
    """The mock engine, noting each request's output_interval."""

    intervals: list[int]

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        self.intervals.append(request.output_interval)
        return super().generate(request)


async def _messages(servicer_interval: int, request_interval: int, whole: bool = False,
                    tokens: int = TOKENS, intervals: list[int] | None = None
                    ) -> list[worker_pb2.GenerateResponse]:
    engine = _Spy(MockEngineConfig(model_name="m", block_size=16, num_blocks=256,
                                   max_model_len=4096, timing="zero"))
    engine.intervals = intervals if intervals is not None else []
    await engine.start()
    server, address = await serve(worker_pb2_grpc.add_WorkerServicer_to_server,
                                  WorkerServicer(engine, "w",
                                                 stream_interval=servicer_interval))
    try:
        async with grpc.aio.insecure_channel(address) as ch:
            return [m async for m in worker_pb2_grpc.WorkerStub(ch).Generate(
                worker_pb2.GenerateRequest(
                    request_id="r", token_ids=list(range(5, 40)), whole=whole,
                    stream_interval=request_interval,
                    sampling=common_pb2.SamplingParams(max_tokens=tokens, ignore_eos=True,
                                                       seed=3)))]
    finally:
        await server.stop(None)
        await engine.shutdown()


def _check(msgs: list[worker_pb2.GenerateResponse], interval: int) -> None:
    with_tokens = [m for m in msgs if m.token_ids]
    assert with_tokens[0].token_ids  # the first tokens, at once (however few)
    for m in with_tokens[1:-1]:
        assert len(m.token_ids) >= interval, [len(x.token_ids) for x in msgs]
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert msgs[-1].usage.completion_tokens == TOKENS


@pytest.mark.parametrize(("servicer", "requested", "interval"),
                         [(1, 4, 4), (4, 0, 4), (4, 2, 4), (2, 5, 5)])
async def test_the_larger_interval_holds_tokens_and_changes_nothing_else(
        servicer: int, requested: int, interval: int) -> None:
    plain = await _messages(1, 0)
    msgs = await _messages(servicer, requested)
    _check(msgs, interval)
    assert len(msgs) <= 2 + (TOKENS - 1) // interval
    assert [t for m in msgs for t in m.token_ids] == [t for m in plain for t in m.token_ids]
    assert "".join(m.text for m in msgs) == "".join(m.text for m in plain)
    assert len([t for m in plain for t in m.token_ids]) == TOKENS


async def test_a_whole_answer_is_held_whole_whatever_the_interval() -> None:
    msgs = await _messages(1, 3, whole=True)
    assert [len(m.token_ids) for m in msgs if m.token_ids] == [1, TOKENS - 1]


async def test_no_interval_holds_more_than_a_whole_answer_would() -> None:
    """A request's interval is at most WHOLE_FLUSH_TOKENS: a huge one still streams."""
    n = 2 * WHOLE_FLUSH_TOKENS + 40
    msgs = await _messages(1, 2 ** 32 - 1, tokens=n)
    sizes = [len(m.token_ids) for m in msgs if m.token_ids]
    assert sum(sizes) == n and len(sizes) >= 4, sizes
    assert all(WHOLE_FLUSH_TOKENS <= s < WHOLE_FLUSH_TOKENS + 64 for s in sizes[1:-1]), sizes


@pytest.mark.parametrize(("servicer", "requested", "whole", "hint"),
                         [(1, 0, False, 1), (1, 5, False, 5), (6, 2, False, 6),
                          (1, 3, True, WHOLE_FLUSH_TOKENS)])
async def test_the_engine_is_told_how_many_tokens_the_worker_holds(
        servicer: int, requested: int, whole: bool, hint: int) -> None:
    """EngineRequest.output_interval is the holder's flush size (1: no holder), so the
    engine need not wake the worker for tokens it would hold anyway."""
    intervals: list[int] = []
    msgs = await _messages(servicer, requested, whole=whole, intervals=intervals)
    assert intervals == [hint]
    assert sum(len(m.token_ids) for m in msgs) == TOKENS


def test_the_worker_option_is_checked() -> None:
    assert "stream_interval must be >= 1, got 0" in WorkerConfig(
        stream_interval=0).problems()
    assert not [p for p in WorkerConfig(stream_interval=8).problems() if "stream" in p]


async def test_the_pipeline_sends_the_requests_interval_to_the_worker() -> None:
    async with mesh([await node("s1", discovery_pb2.WORKER_ROLE_AGG, MODEL)]) as setup:
        got: list[Chunk] = []
        await consume(setup.pipeline, dataclasses.replace(request(TOKENS),
                                                          stream_interval=6), got)
        _check_chunks(got, 6)


def _check_chunks(chunks: list[Chunk], interval: int) -> None:
    sizes = [len(c.token_ids) for c in chunks if c.token_ids]
    assert sum(sizes) == TOKENS, sizes
    assert all(s >= interval for s in sizes[1:-1]), sizes
    assert chunks[-1].finish_reason == "length"
