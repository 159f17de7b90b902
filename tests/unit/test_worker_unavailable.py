"""An engine that lives but cannot serve a request now (EngineUnavailableError, e.g. an
AFD attention engine whose FFN peer is gone): the worker answers UNAVAILABLE naming the
cause, logs one warning (no traceback, nothing at ERROR), is not marked dead (the next
request is served); the frontend migrates the request to another worker and reports the
failed one to the router, and with no other worker the client gets a 503, never a hang.

Real Worker servicers over a mock engine on in-process loopback gRPC servers, a real
RouterServicer and Pipeline (the harness of :mod:`tests.unit.test_frontend_release`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
import pytest

from protos import common_pb2, discovery_pb2, worker_pb2, worker_pb2_grpc
from services.frontend.openai_schema import ApiError
from tests.unit.test_frontend_release import PROMPT, Node, counter, mesh, request, serve
from tests.waiting import wait_for
from workers.engines.afd.mesh_engine import AfdUnavailable
from workers.engines.base import EngineOutput, EngineRequest, EngineUnavailableError
from workers.engines.mock import MockEngine, MockEngineConfig
from workers.service import WorkerServicer

CAUSE = "the AFD FFN at afdmesh.ffn-1 was lost"
GONE = 99  # a prompt starting with it fails at once; with GONE + 1, after two outputs


class PeerGoneEngine(MockEngine):
    """The mock engine whose peer is gone for prompts starting with :data:`GONE` (at
    once) or ``GONE + 1`` (mid-stream, after two outputs); ``fails``: a budget of
    mid-stream failures for any prompt (shared by the engines holding the same list:
    one element per failure left, the failing engine's id appended to ``failed``)."""

    wid = ""
    fails: list[None] | None = None
    failed: list[str] | None = None

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        first = request.prompt_token_ids[0]
        if first == GONE:
            raise AfdUnavailable(CAUSE)
        fail = first == GONE + 1
        if self.fails:
            self.fails.pop()
            assert self.failed is not None
            self.failed.append(self.wid)
            fail = True
        n = 0
        async for out in super().generate(request):
            if fail and n == 2:
                raise AfdUnavailable(CAUSE)
            n += 1
            yield out


def _engine(model: str = "m") -> PeerGoneEngine:
    return PeerGoneEngine(MockEngineConfig(model_name=model, block_size=16, num_blocks=256,
                                           max_model_len=4096))


def _gen(rid: str, first: int, max_tokens: int = 6) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id=rid, token_ids=[first, 1, 2, 3],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_afd_unavailable_is_an_engine_unavailable_error() -> None:
    assert issubclass(AfdUnavailable, EngineUnavailableError)


async def test_the_worker_answers_unavailable_naming_the_cause_and_serves_on(
        caplog: pytest.LogCaptureFixture) -> None:
    engine = _engine()
    await engine.start()
    server, address = await serve(worker_pb2_grpc.add_WorkerServicer_to_server,
                                  WorkerServicer(engine, "w"))
    try:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            for rid, first, before in (("at-once", GONE, 0), ("mid", GONE + 1, 2)):
                caplog.clear()
                got: list[worker_pb2.GenerateResponse] = []
                with caplog.at_level(logging.WARNING, logger="workers.service"), \
                        pytest.raises(grpc.aio.AioRpcError) as err:
                    async for resp in stub.Generate(_gen(rid, first)):
                        got.append(resp)
                assert len(got) == before, rid
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
                assert err.value.details() == f"engine unavailable: {CAUSE}"
                assert "dead" not in (err.value.details() or "")
                recs = [r for r in caplog.records if r.name == "workers.service"]
                assert [r.levelno for r in recs] == [logging.WARNING], recs
                assert recs[0].exc_info is None and rid in recs[0].getMessage()
                assert CAUSE in recs[0].getMessage()
            # not marked dead: the next request is served whole
            out = [r async for r in stub.Generate(_gen("next", 5))]
            assert sum(len(r.token_ids) for r in out) == 6
            assert out[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert engine.load().num_running == 0
    finally:
        await server.stop(0)
        await engine.shutdown()


async def _node(wid: str, model: str, fails: list[None], failed: list[str]) -> Node:
    engine = _engine(model)
    engine.wid, engine.fails, engine.failed = wid, fails, failed
    await engine.start()
    server, address = await serve(worker_pb2_grpc.add_WorkerServicer_to_server,
                                  WorkerServicer(engine, wid))
    info = engine.info
    rec = discovery_pb2.InstanceRecord(
        instance_id=wid, component="worker", address=address,
        role=discovery_pb2.WORKER_ROLE_AGG, model=model, block_size=info.block_size,
        max_model_len=info.max_model_len, engine="mock", kv_layout=info.kv_layout)
    return Node(engine, server, rec)


async def test_the_frontend_migrates_and_reports_the_unavailable_worker() -> None:
    """Mid-stream UNAVAILABLE: the stream goes on on the other worker (the client sees
    every token once), and the failed worker is reported (unroutable for a while)."""
    fails: list[None] = [None]  # the first attempt fails, wherever it runs
    failed: list[str] = []
    async with mesh([await _node("u1", "um", fails, failed),
                     await _node("u2", "um", fails, failed)]) as s:
        _, chunks = await s.pipeline.run(request(12, "um"))
        got = [c async for c in chunks]
        assert got[-1].finish_reason == "length" and got[-1].completion_tokens == 12
        assert len([t for c in got for t in c.token_ids]) == 12
        assert len(failed) == 1 and not fails
        assert counter(s.pipeline, "kvmesh_frontend_migrations_total", stage="agg") == 1
        await wait_for(lambda: set(s.core.unroutable()) == set(failed), 10,
                       lambda: f"{failed} reported (marked: {s.core.unroutable()})")
        await s.settled()


async def test_with_no_other_worker_the_client_gets_a_503() -> None:
    fails: list[None] = [None] * 8
    async with mesh([await _node("v1", "vm", fails, [])]) as s:
        _, chunks = await s.pipeline.run(request(12, "vm", prompt=PROMPT))
        n = 0
        with pytest.raises(ApiError) as err:
            async for c in chunks:
                n += len(c.token_ids)
        assert err.value.status == 503, err.value
        assert err.value.type == "service_unavailable", err.value
        assert "no live worker left" in err.value.message, err.value
        assert 0 < n < 12
        await s.settled()
