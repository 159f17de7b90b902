"""The optional sampling features on the mock engine, through the worker servicer
(in-process gRPC on port 0): what it does not serve is refused INVALID_ARGUMENT naming the
field, never ignored; ``min_tokens`` suppresses stop tokens; ``min_p`` is served (greedy).
And what P and D of a handoff get (services.frontend.handoff)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from protos import common_pb2, worker_pb2, worker_pb2_grpc
from services.frontend.handoff import (
    D_DROPPED,
    P_DROPPED,
    Request,
    _decode_request,
    _prefill_request,
)
from tests.unit.test_frontend_release import serve
from workers.engines.base import EngineRequest, Sampling
from workers.engines.mock import MockEngine, MockEngineConfig
from workers.service import WorkerServicer

PROMPT = [5, 6, 7, 8]


async def _stub(engine: MockEngine) -> tuple[Any, worker_pb2_grpc.WorkerStub]:
    await engine.start()
    server, address = await serve(worker_pb2_grpc.add_WorkerServicer_to_server,
                                  WorkerServicer(engine, "w"))
    return server, worker_pb2_grpc.WorkerStub(grpc.aio.insecure_channel(address))


def _req(rid: str, **sampling: Any) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id=rid, model="mock", token_ids=PROMPT,
        sampling=common_pb2.SamplingParams(**{"max_tokens": 3, **sampling}))


async def _ids(stub: worker_pb2_grpc.WorkerStub, req: worker_pb2.GenerateRequest
               ) -> tuple[list[int], str]:
    resps = [r async for r in stub.Generate(req)]
    return ([t for r in resps for t in r.token_ids],
            common_pb2.FinishReason.Name(resps[-1].finish_reason))


@pytest.mark.parametrize("field,value", [
    ("logprobs", 0),
    ("prompt_logprobs", 1),
    ("logit_bias", {5: 1.0}),
    ("structured", common_pb2.StructuredOutputs(json_object=True)),
    ("structured", common_pb2.StructuredOutputs(regex="a+")),
])
async def test_mock_refuses_what_it_does_not_serve(field: str, value: Any) -> None:
    engine = MockEngine(MockEngineConfig(model_name="mock", timing="zero"))
    server, stub = await _stub(engine)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _ids(stub, _req("bad", **{field: value}))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"sampling.{field} is not served by engine mock" in info.value.details()
        ids, _ = await _ids(stub, _req("ok"))  # the worker serves on
        assert len(ids) == 3
    finally:
        await server.stop(None)
        await engine.shutdown()


async def test_mock_min_tokens_suppresses_stop_tokens_and_min_p_is_served() -> None:
    engine = MockEngine(MockEngineConfig(model_name="mock", timing="zero"))
    server, stub = await _stub(engine)
    try:
        free, _ = await _ids(stub, _req("free", max_tokens=4))
        first = free[0]
        # its first token as a stop token: it ends at once ...
        stopped, reason = await _ids(stub, _req("stop", max_tokens=4, stop_token_ids=[first]))
        assert (stopped, reason) == ([first], "FINISH_REASON_STOP")
        # ... unless min_tokens forbids it: another token is taken, never the stop token
        held, reason = await _ids(stub, _req("held", max_tokens=4, min_tokens=4,
                                             stop_token_ids=[first]))
        assert len(held) == 4 and first not in held and reason == "FINISH_REASON_LENGTH"
        # the same request again gives the same tokens (deterministic)
        assert (await _ids(stub, _req("again", max_tokens=4, min_tokens=4,
                                      stop_token_ids=[first])))[0] == held
        # greedy: min_p drops only tokens a greedy pick never takes
        assert (await _ids(stub, _req("minp", max_tokens=4, min_p=0.5)))[0] == free
        with pytest.raises(grpc.aio.AioRpcError) as info:  # min_tokens > max_tokens
            await _ids(stub, _req("big", max_tokens=2, min_tokens=3))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.min_tokens" in info.value.details()
    finally:
        await server.stop(None)
        await engine.shutdown()


async def _tokens(sampling: Sampling, **config: Any) -> list[int]:
    engine = MockEngine(MockEngineConfig(model_name="mock", timing="zero", **config))
    await engine.start()
    try:
        return [t async for o in engine.generate(EngineRequest("r", PROMPT, sampling))
                for t in o.token_ids]
    finally:
        await engine.shutdown()


async def test_mock_min_tokens_suppresses_eos() -> None:
    free = await _tokens(Sampling(max_tokens=3))
    eos = free[0]  # an engine whose eos is this prompt's first token
    assert await _tokens(Sampling(max_tokens=3), eos_token_id=eos) == [eos]
    held = await _tokens(Sampling(max_tokens=3, min_tokens=2), eos_token_id=eos)
    assert len(held) >= 2 and eos not in held[:2]


def test_p_gets_no_output_features_and_d_no_prompt_logprobs() -> None:
    sampling = common_pb2.SamplingParams(
        max_tokens=8, temperature=0.0, logprobs=2, prompt_logprobs=1, min_tokens=3,
        min_p=0.1, logit_bias={4: 2.0}, presence_penalty=0.5,
        structured=common_pb2.StructuredOutputs(json_schema='{"type": "object"}'))
    req = Request("r", "tiny", [1, 2, 3], sampling)
    for mode in ("pull", "push"):
        p = _prefill_request(req, mode).sampling
        for name in P_DROPPED:
            assert not (p.HasField(name) if name in ("structured", "logprobs")
                        else getattr(p, name)), name
        assert p.max_tokens == 1 and p.ignore_eos and p.prompt_logprobs == 1
        assert p.min_p == pytest.approx(0.1) and p.presence_penalty == 0.5
    d = _decode_request(req, worker_pb2.KvTransferParams(remote_engine_id="p")).sampling
    assert all(not d.HasField(name) for name in D_DROPPED)
    expected = common_pb2.SamplingParams()
    expected.CopyFrom(sampling)
    expected.ClearField("prompt_logprobs")
    assert d == expected  # everything else, unchanged
    assert req.sampling.HasField("prompt_logprobs")  # the caller's copy is untouched


async def test_worker_names_the_first_negative_prompt_token() -> None:
    engine = MockEngine(MockEngineConfig(model_name="mock", timing="zero"))
    server, stub = await _stub(engine)
    try:
        bad = _req("neg")
        bad.token_ids[:] = [5, -3, 7, -9]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _ids(stub, bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == "token_ids must be >= 0, got -3"
        resps = [r async for r in stub.Generate(_req("ok"))]
        assert "".join(r.text for r in resps) == "".join(
            f" w{t}" for r in resps for t in r.token_ids)
        assert not any(r.logprobs for r in resps)
    finally:
        await server.stop(None)
        await engine.shutdown()
