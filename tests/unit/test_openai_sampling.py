"""Issue 15's sampling surface, pure parts: parsers, the worker's SamplingParams, fan-out
ids/seeds/usage, and the response shapes (vLLM's order of top tokens, text offsets, echo)
with the real tiny model's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from protos import common_pb2
from services.frontend.fanout import FanJob, Tally, choice_job
from services.frontend.jobs import Chunk, Job, sampling_proto
from services.frontend.models import ModelInfo, Tokenizer
from services.frontend.openai_schema import (
    INT64_MAX,
    INT64_MIN,
    ApiError,
    Structured,
    parse_chat,
    parse_completion,
    split_batch,
)
from services.frontend.shapes import Shapes, ordered
from workers.model import tiny

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_response_format_maps_to_structured_outputs() -> None:
    assert parse_chat({**CHAT, "response_format": {"type": "text"}}).sampling.structured is None
    obj = parse_chat({**CHAT, "response_format": {"type": "json_object"}})
    assert obj.sampling.structured == Structured("json_object")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = parse_completion({"model": "m", "prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}})
    assert req.sampling.structured is not None
    assert json.loads(req.sampling.structured.value) == schema
    p = sampling_proto(_job(req))
    assert json.loads(p.structured.json_schema) == schema
    assert sampling_proto(_job(obj)).structured.json_object


def test_logprobs_echo_bias_min_fields_reach_the_worker_params() -> None:
    req = parse_completion({"model": "m", "prompt": "x", "logprobs": 3, "echo": True,
                            "logit_bias": {"7": 250, "9": -3.5}, "min_tokens": 2,
                            "min_p": 0.05, "max_tokens": 5})
    s = req.sampling
    assert (s.logprobs, s.prompt_logprobs, req.echo) == (3, 3, True)
    assert s.logit_bias == ((7, 100.0), (9, -3.5))  # clamped to [-100, 100] as vLLM
    p = sampling_proto(_job(req))
    assert p.logprobs == 3 and p.prompt_logprobs == 3 and p.min_tokens == 2
    assert dict(p.logit_bias) == {7: 100.0, 9: -3.5} and p.min_p == pytest.approx(0.05)
    plain = sampling_proto(_job(parse_completion({"model": "m", "prompt": "x"})))
    for name in ("logprobs", "prompt_logprobs", "min_p", "structured"):
        assert not plain.HasField(name), name
    chat = parse_chat({**CHAT, "logprobs": True, "top_logprobs": 4})
    assert chat.sampling.logprobs == 4 and chat.sampling.prompt_logprobs is None
    assert parse_chat({**CHAT, "logprobs": True}).sampling.logprobs == 0
    assert parse_chat({**CHAT, "logprobs": False, "top_logprobs": 0}).sampling.logprobs is None


def test_batches_of_strings_and_token_lists() -> None:
    req = parse_completion({"model": "m", "prompt": ["a", "b"], "n": 3})
    assert req.n == 3 and req.batch == ("a", "b")
    assert [r.prompt for r in split_batch(req)] == ["a", "b"]
    ids = parse_completion({"model": "m", "prompt": [[1, 2], [3]]})
    assert [r.prompt_token_ids for r in split_batch(ids)] == [(1, 2), (3,)]
    one = parse_completion({"model": "m", "prompt": [[1, 2]]})
    assert one.batch == () and one.prompt_token_ids == (1, 2)
    with pytest.raises(ApiError) as err:
        parse_completion({"model": "m", "prompt": [[1], [-1]]})
    assert err.value.param == "prompt[1]"


def _job(req, ids=(1, 2, 3)) -> Job:  # type: ignore[no-untyped-def]
    info = ModelInfo("m", "", 512, 16, 1, 0)
    return Job("rid", req, info, list(ids), 0)


def test_choice_ids_and_seeds() -> None:
    job = _job(parse_completion({"model": "m", "prompt": "x", "seed": INT64_MAX, "n": 2}))
    first, second = choice_job(job, "base", 2, 0), choice_job(job, "base", 3, 1)
    assert (first.request_id, second.request_id) == ("base-2", "base-3")
    assert first.req.sampling.seed == INT64_MAX and second.req.sampling.seed == INT64_MIN
    assert first.req.n == second.req.n == 1
    unseeded = choice_job(_job(parse_completion({"model": "m", "prompt": "x"})), "b", 1, 1)
    assert unseeded.req.sampling.seed is None


def test_usage_counts_each_prompt_once() -> None:
    req = parse_completion({"model": "m", "prompt": ["a", "b"], "n": 2})
    prompts = [_job(r) for r in split_batch(req)]
    choices = [choice_job(j, "b", p * 2 + c, c) for p, j in enumerate(prompts) for c in (0, 1)]
    tally = Tally(FanJob("b", req, prompts, choices, 0))
    for index, (prompt, done, cached) in enumerate([(5, 3, 0), (5, 4, 4), (7, 2, 6), (7, 1, 6)]):
        assert not tally.done
        tally.see(index, Chunk("", [], "length", prompt, done, cached))
    assert tally.done and tally.usage() == (12, 10, 6)  # first choices' cached: 0 + 6


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path: Path = tiny.ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")
    return Tokenizer(str(path))


def _pos(token: int, lp: float, *top: tuple[int, float]) -> common_pb2.PositionLogprobs:
    return common_pb2.PositionLogprobs(
        token=common_pb2.TokenLogprob(token_id=token, logprob=lp),
        top=[common_pb2.TokenLogprob(token_id=t, logprob=v, rank=r + 1)
             for r, (t, v) in enumerate(top)])


def _fan(req, ids) -> FanJob:  # type: ignore[no-untyped-def]
    job = _job(req, ids)
    return FanJob("rid", req, [job], [job], 0)


def test_vllm_order_puts_the_sampled_token_first() -> None:
    e = _pos(5, -3.0, (7, -0.1), (5, -3.0), (9, -4.0))
    assert [t.token_id for t in ordered(e)] == [5, 7, 9]


def test_chat_logprobs_shape(tok: Tokenizer) -> None:
    req = parse_chat({**CHAT, "logprobs": True, "top_logprobs": 2})
    ids = tok.encode("hello world")
    shapes = Shapes(_fan(req, [1]), tok)
    a, b = ids[-2], ids[-1]
    delta = shapes.add(0, Chunk("x", [a], logprobs=[_pos(a, -0.5, (a, -0.5), (b, -1.0))]))
    assert delta is not None and delta["index"] == 0 and delta["delta"] == {"content": "x"}
    item = delta["logprobs"]["content"][0]
    text_a, text_b = tok.token_texts([a, b])
    assert item == {"token": text_a, "logprob": -0.5, "bytes": list(text_a.encode()),
                    "top_logprobs": [
                        {"token": text_a, "logprob": -0.5, "bytes": list(text_a.encode())},
                        {"token": text_b, "logprob": -1.0, "bytes": list(text_b.encode())}]}
    assert shapes.add(0, Chunk("", [b], "stop", 1, 1, 0, logprobs=[
        _pos(b, float("-inf"), (a, -0.1))])) is not None
    full = shapes.full((1, 2, 0))
    content = full["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [text_a, text_b]
    assert content[1]["logprob"] == -9999.0  # -inf clamped, as vLLM
    assert full["choices"][0]["finish_reason"] == "stop"


def test_completion_logprobs_offsets_and_echo(tok: Tokenizer) -> None:
    prompt_ids = tok.encode("one two")
    gen = tok.encode(" three four")[-2:]
    req = parse_completion({"model": "m", "prompt": "one two", "logprobs": 1, "echo": True})
    shapes = Shapes(_fan(req, prompt_ids), tok)
    prompt_lps = [_pos(prompt_ids[0], 0.0)] + [_pos(t, -1.5, (t, -1.5)) for t in prompt_ids[1:]]
    first = shapes.add(0, Chunk(" three", gen[:1], logprobs=[_pos(gen[0], -2.0, (9, -0.25))],
                                prompt_logprobs=prompt_lps))
    assert first is not None and first["text"] == "one two three"
    lp = first["logprobs"]
    texts = tok.token_texts([*prompt_ids, gen[0]])
    assert lp["tokens"] == texts
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == [-1.5] * (len(prompt_ids) - 1) + [-2.0]
    # k + 1 entries: the sampled token (not in the top 1) and the top token
    assert lp["top_logprobs"][-1] == {texts[-1]: -2.0, tok.token_texts([9])[0]: -0.25}
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert lp["text_offset"] == offsets
    second = shapes.add(0, Chunk(" four", gen[1:], "length", len(prompt_ids), 2, 0,
                                 logprobs=[_pos(gen[1], -0.3, (gen[1], -0.3))]))
    assert second is not None
    assert second["logprobs"]["text_offset"] == [offsets[-1] + len(texts[-1])]
    full = shapes.full((len(prompt_ids), 2, 0))["choices"][0]
    assert full["text"] == "one two three four"
    assert len(full["logprobs"]["tokens"]) == len(prompt_ids) + 2


def test_no_logprobs_asked_is_null(tok: Tokenizer) -> None:
    shapes = Shapes(_fan(parse_completion({"model": "m", "prompt": "x"}), [1]), None)
    choice = shapes.add(0, Chunk("a", [5], "length", 1, 1, 0))
    assert choice is not None and choice["logprobs"] is None
    assert shapes.full((1, 1, 0))["choices"][0]["logprobs"] is None


def test_grpc_request_options() -> None:
    from protos import frontend_pb2
    from services.frontend.service import parse_proto

    assert parse_proto(frontend_pb2.CompletionRequest(
        model="m", prompt="x", sampling=common_pb2.SamplingParams(max_tokens=2))
    ).stream_interval is None  # 0: the workers'
    assert parse_proto(frontend_pb2.CompletionRequest(
        model="m", stream_interval=6, sampling=common_pb2.SamplingParams(max_tokens=2),
        messages=frontend_pb2.Messages(messages=[common_pb2.ChatMessage(
            role="user", content="x")]))).stream_interval == 6
    req = parse_proto(frontend_pb2.CompletionRequest(
        model="m", prompt="x", n=2, echo=True, sampling=common_pb2.SamplingParams(
            max_tokens=4, logprobs=2, min_tokens=1, min_p=0.5, logit_bias={3: 500.0},
            structured=common_pb2.StructuredOutputs(json_schema='{"type": "object"}'))))
    s = req.sampling
    assert (req.n, req.echo, s.logprobs, s.prompt_logprobs, s.min_tokens) == (2, True, 2, 2, 1)
    assert s.logit_bias == ((3, 100.0),) and s.min_p == 0.5
    assert s.structured == Structured("json_schema", '{"type":"object"}')
    for so, want in ((common_pb2.StructuredOutputs(regex="a+"), Structured("regex", "a+")),
                     (common_pb2.StructuredOutputs(grammar="root ::= \"x\""),
                      Structured("grammar", 'root ::= "x"')),
                     (common_pb2.StructuredOutputs(choice=common_pb2.ChoiceList(
                         choices=["yes", "no"])), Structured("choice", choices=("yes", "no")))):
        got = parse_proto(frontend_pb2.CompletionRequest(
            model="m", prompt="x", sampling=common_pb2.SamplingParams(max_tokens=2,
                                                                      structured=so)))
        assert got.sampling.structured == want
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(n=500, sampling=common_pb2.SamplingParams(max_tokens=2)), "n"),
        (dict(echo=True, sampling=common_pb2.SamplingParams(max_tokens=2),
              messages=frontend_pb2.Messages(messages=[
            common_pb2.ChatMessage(role="user", content="x")])), "echo"),
        (dict(sampling=common_pb2.SamplingParams(max_tokens=2, logprobs=50)), "logprobs"),
        (dict(sampling=common_pb2.SamplingParams(max_tokens=2, prompt_logprobs=1)),
         "prompt_logprobs"),
        (dict(sampling=common_pb2.SamplingParams(max_tokens=2, min_tokens=3)), "min_tokens"),
        (dict(sampling=common_pb2.SamplingParams(
            max_tokens=2, structured=common_pb2.StructuredOutputs())), "structured"),
        (dict(sampling=common_pb2.SamplingParams(max_tokens=2, structured=(
            common_pb2.StructuredOutputs(json_object=True, compact_json=True)))),
         "structured.compact_json"),
        (dict(sampling=common_pb2.SamplingParams(max_tokens=2, structured=(
            common_pb2.StructuredOutputs(choice=common_pb2.ChoiceList())))),
         "structured.choice"),
        (dict(sampling=common_pb2.SamplingParams(max_tokens=2, structured=(
            common_pb2.StructuredOutputs(json_object=False)))), "structured.json_object"),
        (dict(sampling=common_pb2.SamplingParams(
            max_tokens=2, structured=common_pb2.StructuredOutputs(json_schema="["))),
         "structured.json_schema"),
    ]
    for bad, param in cases:
        fields = {"model": "m", "prompt": "x", **bad}
        if "messages" in bad:
            fields.pop("prompt")
        with pytest.raises(ApiError) as err:
            parse_proto(frontend_pb2.CompletionRequest(**fields))
        assert err.value.status == 400 and err.value.param == param, (bad, err.value)
