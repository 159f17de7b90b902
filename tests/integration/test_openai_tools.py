"""Issue 15's tool calling and Responses API with the official ``openai`` client through a
live mock mesh: real etcd and Redis, an in-process mock worker (the fleet), a router and
a frontend. The mock serves the tiny model's tokenizer and chat template (which renders
tools, so ``auto`` is served) but no structured outputs, so:

- bad ``tools`` / ``tool_choice`` / tool messages are a 400 naming the field;
- ``tool_choice`` ``required`` and a named function (structured outputs underneath) are a
  400 naming ``tool_choice`` that says the worker refused the constraint;
- ``auto``: the mock's text holds no tool call, so content only, finish ``length``,
  whole and streamed (the same text), with ``n`` = 2 (one parser per choice);
- ``/v1/responses``: the text path whole and streamed (events in order, the same text,
  usage), ``max_output_tokens`` → ``incomplete``; refusals naming the field (stored
  responses: test_openai_responses_store.py);
- the gRPC ``Frontend``: the same validation (INVALID_ARGUMENT naming the proto field),
  the forced-call refusal naming ``tool_choice``, ``auto`` giving the HTTP stream's
  content (no tool calls) per choice, and a tool conversation rendered into the same
  prompt as over HTTP.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from protos import common_pb2, frontend_pb2, frontend_pb2_grpc
from services.common.config import load_config
from services.common.procs import Child
from services.frontend.main import FrontendApp, FrontendConfig, start_frontend
from services.router.main import RouterApp, RouterConfig, start_router
from tests.integration.conftest import base_args, wait_routable
from tests.waiting import wait_for
from workers.fleet import Fleet, FleetConfig, start_fleet

NS = "tools"
MODEL = "mock"
WEATHER: ChatCompletionToolParam = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "weather in Paris?"}]


@dataclass
class ToolMesh:
    fleet: Fleet
    router: RouterApp
    frontend: FrontendApp

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.frontend.base_url + "/v1", api_key="none",
                                  max_retries=0, timeout=60)

    def in_flight(self) -> int:
        return self.router.servicer._core.in_flight_count()  # noqa: SLF001


@pytest.fixture(scope="module")
async def mesh(etcd: Child, redis_server: Child, tiny_model: str) -> AsyncIterator[ToolMesh]:
    args = [*base_args(etcd.address, NS), "--redis-url", f"redis://{redis_server.address}"]
    fleet = await start_fleet(load_config(FleetConfig, [
        *args, "--workers", "1", "--block-size", "16", "--num-blocks", "1024",
        "--max-model-len", "4096", "--worker-id", "tools-", "--model-path", tiny_model,
        "--model-name", MODEL], {}))
    router = await start_router(load_config(RouterConfig, [*args, "--load-poll-s", "0.2"],
                                            {}))
    frontend = await start_frontend(load_config(FrontendConfig, [
        *args, "--http-port", "0", "--router-address", router.server.address], {}))
    try:
        await wait_routable(router, 1, "the mock worker")
        await wait_for(lambda: frontend.pipeline.catalog.get(MODEL) is not None, 30,
                       "the frontend's model")
        yield ToolMesh(fleet, router, frontend)
    finally:
        await frontend.server.stop()
        await router.server.stop()
        await fleet.stop()


async def released(mesh: ToolMesh) -> None:
    await wait_for(lambda: mesh.in_flight() == 0, 10,
                   lambda: f"every router entry released ({mesh.in_flight()} left)")


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "must be 'function'"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name", "letters, digits"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "no-such-type"}}}]}, "tools[0].function.parameters", "not a valid JSON"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be 'none'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                          "function": {"name": "nope"}}},
     "tool_choice.function.name", "not one of the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                    "tool_calls": [{"id": "c1", "type": "function", "function": {
                        "name": "get_weather", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "not valid JSON"),
    ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages[0].tool_call_id",
     "required"),
]


@pytest.mark.parametrize("extra,param,words", BAD)
async def test_bad_tool_requests_are_a_400_naming_the_field(
        mesh: ToolMesh, extra: dict[str, Any], param: str, words: str) -> None:
    body = {"messages": USER, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        await mesh.client().chat.completions.create(model=MODEL, max_tokens=4,
                                                    **body)  # type: ignore[call-overload]
    e = err.value.body
    assert isinstance(e, dict) and e["param"] == param and words in e["message"], e


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("stream", [False, True])
async def test_forced_calls_the_mock_cannot_constrain_are_a_clear_400(
        mesh: ToolMesh, choice: Any, stream: bool) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await mesh.client().chat.completions.create(
            model=MODEL, messages=USER, tools=[WEATHER], tool_choice=choice, max_tokens=8,
            stream=stream)
    e = err.value.body
    assert isinstance(e, dict) and e["param"] == "tool_choice", e
    assert "structured outputs" in e["message"] and "not served by engine mock" in (
        e["message"]), e
    await released(mesh)


async def test_auto_on_the_mock_is_content_only_whole_and_streamed(mesh: ToolMesh) -> None:
    client = mesh.client()
    full = await client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER], max_tokens=10, seed=4, n=2)
    assert [c.index for c in full.choices] == [0, 1]
    for c in full.choices:
        assert c.finish_reason == "length" and not c.message.tool_calls
        assert c.message.content
    assert full.usage is not None and full.usage.completion_tokens == 20
    # the tools are rendered into the prompt: it is longer than without them
    plain = await client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1)
    assert plain.usage is not None and full.usage.prompt_tokens > plain.usage.prompt_tokens
    stream = await client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER], max_tokens=10, seed=4, n=2,
        stream=True, stream_options={"include_usage": True})
    texts, finishes = ["", ""], [None, None]  # type: list[str], list[str | None]
    async for chunk in stream:
        for ch in chunk.choices:
            assert not ch.delta.tool_calls
            texts[ch.index] += ch.delta.content or ""
            finishes[ch.index] = ch.finish_reason or finishes[ch.index]
    assert texts == [c.message.content for c in full.choices]
    assert finishes == ["length", "length"]
    await released(mesh)


async def test_none_with_tools_and_a_tool_conversation(mesh: ToolMesh) -> None:
    """``tool_choice: none`` still renders the tools (as vLLM); an assistant tool call and
    the tool's answer are rendered by the tiny template (content null is accepted)."""
    messages: list[ChatCompletionMessageParam] = [
        *USER, {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    resp = await mesh.client().chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=3)
    assert resp.choices[0].finish_reason == "length" and resp.choices[0].message.content
    assert not resp.choices[0].message.tool_calls
    await released(mesh)


async def test_responses_text_whole_and_streamed(mesh: ToolMesh) -> None:
    client = mesh.client()
    resp = await client.responses.create(model=MODEL, input="hello there",
                                         instructions="Be brief.", max_output_tokens=6,
                                         metadata={"k": "v"}, extra_body={"seed": 1})
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status == "incomplete" and resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.metadata == {"k": "v"} and resp.instructions == "Be brief."
    assert [o.type for o in resp.output] == ["message"] and resp.output_text
    assert resp.usage is not None and resp.usage.output_tokens == 6
    chat = await client.chat.completions.create(
        model=MODEL, max_tokens=6, seed=1, messages=[{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "hello there"}])
    assert chat.usage is not None and resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.output_text == chat.choices[0].message.content  # the mock is seeded
    types, text, done = [], "", None
    stream = await client.responses.create(model=MODEL, input="hello there",
                                           instructions="Be brief.", max_output_tokens=6,
                                           stream=True, extra_body={"seed": 1})
    async for event in stream:
        types.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.completed":
            done = event.response
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed" and "response.output_item.added" in types
    assert "response.output_text.done" in types
    assert text == resp.output_text and done is not None and done.output_text == text
    assert done.usage is not None and done.usage.output_tokens == 6
    assert done.status == "incomplete"
    await released(mesh)


@pytest.mark.parametrize("extra,param", [
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
])
async def test_responses_refusals_name_the_field(mesh: ToolMesh, extra: dict[str, Any],
                                                 param: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as err:
        await mesh.client().post("/responses", body=body, cast_to=dict)
    e = err.value.body
    assert isinstance(e, dict) and e["param"] == param, e


async def test_responses_errors_from_the_chat_path_are_mapped(mesh: ToolMesh) -> None:
    """A chat-path 400 (a forced tool call the mock cannot constrain) names the
    Responses field; an unknown model is a 404."""
    with pytest.raises(openai.BadRequestError) as err:
        await mesh.client().responses.create(
            model=MODEL, input="hi", tool_choice="required", tools=[{
                "type": "function", "name": "get_weather", "strict": False,
                "parameters": WEATHER["function"].get("parameters")}])
    e = err.value.body
    assert isinstance(e, dict) and e["param"] == "tool_choice", e
    with pytest.raises(openai.NotFoundError):
        await mesh.client().responses.create(model="no-such-model", input="hi")
    await released(mesh)


# --- the gRPC Frontend -----------------------------------------------------------------------

G_WEATHER = frontend_pb2.Tool(
    name="get_weather", description="The weather in a city",
    parameters_json='{"type": "object", "properties": {"city": {"type": "string"}}, '
                    '"required": ["city"]}')
G_USER = common_pb2.ChatMessage(role="user", content="weather in Paris?")
MODE = frontend_pb2.ToolChoice


def grpc_chat(*messages: common_pb2.ChatMessage, max_tokens: int = 8,
              **fields: Any) -> frontend_pb2.CompletionRequest:
    return frontend_pb2.CompletionRequest(
        model=MODEL, messages=frontend_pb2.Messages(messages=list(messages or [G_USER])),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, seed=4), **fields)


async def grpc_generate(mesh: ToolMesh, req: frontend_pb2.CompletionRequest
                        ) -> list[frontend_pb2.CompletionChunk]:
    async with grpc.aio.insecure_channel(mesh.frontend.server.address) as ch:
        return [c async for c in frontend_pb2_grpc.FrontendStub(ch).Generate(req)]


@pytest.mark.parametrize("req,words", [
    (grpc_chat(tools=[frontend_pb2.Tool(name="bad name")]), "tools[0].name"),
    (grpc_chat(tools=[frontend_pb2.Tool(name="f", parameters_json="{x")]),
     "tools[0].parameters_json"),
    (grpc_chat(tools=[G_WEATHER], tool_choice=MODE(mode=MODE.MODE_FUNCTION, function="nope")),
     "tool_choice.function"),
    (grpc_chat(tool_choice=MODE(mode=MODE.MODE_REQUIRED)), "tool_choice"),
    (grpc_chat(G_USER, common_pb2.ChatMessage(role="assistant", tool_calls=[
        common_pb2.ToolCall(id="c1", name="get_weather", arguments="{not json")])),
     "messages[1].tool_calls[0].arguments"),
    (grpc_chat(common_pb2.ChatMessage(role="tool", content="sunny")),
     "messages[0].tool_call_id"),
    (frontend_pb2.CompletionRequest(model=MODEL, prompt="x", tools=[G_WEATHER],
                                    sampling=common_pb2.SamplingParams(max_tokens=2)),
     "'tools' is for chat"),
])
async def test_grpc_bad_tool_requests_are_invalid_argument_naming_the_field(
        mesh: ToolMesh, req: frontend_pb2.CompletionRequest, words: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await grpc_generate(mesh, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert words in (err.value.details() or ""), err.value.details()


@pytest.mark.parametrize("choice", [MODE(mode=MODE.MODE_REQUIRED),
                                    MODE(mode=MODE.MODE_FUNCTION, function="get_weather")])
async def test_grpc_forced_calls_the_mock_cannot_constrain_name_tool_choice(
        mesh: ToolMesh, choice: frontend_pb2.ToolChoice) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await grpc_generate(mesh, grpc_chat(tools=[G_WEATHER], tool_choice=choice))
    details = err.value.details() or ""
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert details.startswith("tool_choice ") and "structured outputs" in details, details
    await released(mesh)


async def test_grpc_auto_is_content_only_as_over_http(mesh: ToolMesh) -> None:
    """``auto`` (tool_choice unset) with n = 2: each choice's streamed text is the HTTP
    response's content for the same seeded request, with no tool-call pieces."""
    chunks = await grpc_generate(mesh, grpc_chat(tools=[G_WEATHER], n=2, max_tokens=10))
    http = await mesh.client().chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER], max_tokens=10, seed=4, n=2)
    assert not any(c.tool_calls for c in chunks)
    for i, choice in enumerate(http.choices):
        mine = [c for c in chunks if c.index == i]
        assert "".join(c.text for c in mine) == choice.message.content
        assert sum(len(c.token_ids) for c in mine) == 10
        assert mine[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert http.usage is not None
    assert chunks[-1].usage.prompt_tokens == http.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 20
    await released(mesh)


async def test_grpc_tool_conversation_renders_as_over_http(mesh: ToolMesh) -> None:
    """An assistant's tool call (content empty) and the tool's answer, with tool_choice
    none: the same prompt as the HTTP request's (prompt tokens), longer than without."""
    history = [G_USER, common_pb2.ChatMessage(role="assistant", tool_calls=[
        common_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')]),
        common_pb2.ChatMessage(role="tool", content="sunny", tool_call_id="call_1")]
    chunks = await grpc_generate(mesh, grpc_chat(
        *history, tools=[G_WEATHER], tool_choice=MODE(mode=MODE.MODE_NONE), max_tokens=3))
    messages: list[ChatCompletionMessageParam] = [
        *USER, {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    http = await mesh.client().chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=3,
        seed=4)
    assert http.usage is not None
    assert chunks[-1].usage.prompt_tokens == http.usage.prompt_tokens
    assert "".join(c.text for c in chunks) == http.choices[0].message.content
    plain = await grpc_generate(mesh, grpc_chat(max_tokens=1))
    assert chunks[-1].usage.prompt_tokens > plain[-1].usage.prompt_tokens
    await released(mesh)
