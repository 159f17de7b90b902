"""services.frontend.responses_api: the Responses API mapped onto chat, checked against
OpenAI's and vLLM's own pydantic models of the response and its events."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from vllm.entrypoints.openai.responses.protocol import ResponsesResponse

from services.frontend import responses_api as R
from services.frontend import tools as T
from services.frontend.auth import Tenant
from services.frontend.openai_schema import ApiError, error_body
from services.frontend.responses_store import ResponseStore
from workers.model.tiny import ensure_tiny_model

EVENT = TypeAdapter(ResponseStreamEvent)
FN = {"type": "function", "name": "get_weather", "description": "weather",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                     "required": ["city"]}}
USAGE = {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17,
         "prompt_tokens_details": {"cached_tokens": 8}}


def _check(obj: dict[str, Any]) -> None:
    """Valid for OpenAI's Response and for vLLM's ResponsesResponse."""
    Response.model_validate(obj)
    vllm_obj = copy.deepcopy(obj)
    if vllm_obj["max_output_tokens"] is None:  # vLLM always knows its resolved max_tokens
        vllm_obj["max_output_tokens"] = 16
    ResponsesResponse.model_validate(vllm_obj)


# --- parsing -------------------------------------------------------------------------------

def test_string_input_and_instructions() -> None:
    p = R.parse_responses({"model": "m", "input": "hi", "instructions": "be brief",
                           "max_output_tokens": 20, "temperature": 0, "store": False,
                           "metadata": {"k": "v"}, "user": "u"})
    assert p.chat_body == {"model": "m", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "temperature": 0, "user": "u", "max_completion_tokens": 20}
    assert p.response_id.startswith("resp_") and not p.stream
    assert (p.metadata, p.tool_choice, p.max_output_tokens) == ({"k": "v"}, "none", 20)


def test_items_map_onto_chat_messages() -> None:
    items = [
        {"type": "message", "role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                     {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "let me see"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "rain"}]},
        {"role": "user", "content": [{"type": "input_image",
                                      "image_url": "data:image/png;base64,AAAA"},
                                     {"type": "input_text", "text": "and this?"}]},
    ]
    msgs = R.parse_responses({"model": "m", "input": items}).chat_body["messages"]
    call: dict[str, Any] = {"type": "function", "function": {"name": "get_weather"}}
    assert msgs == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "let me see", "tool_calls": [
            {**call, "id": "call_1", "function": {**call["function"],
                                                  "arguments": '{"city": "Oslo"}'}},
            {**call, "id": "call_2", "function": {**call["function"],
                                                  "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "text", "text": "and this?"}]},
    ]
    # The chat side accepts what the mapping produces for tool calling.
    assert T.message_extras(msgs)[2]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Oslo"}
    lone = R.parse_responses({"model": "m", "input": [items[3]]}).chat_body["messages"]
    assert lone == [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}]


def test_text_format_tools_and_stream() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p = R.parse_responses({
        "model": "m", "input": "x", "stream": True, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "out", "schema": schema,
                            "strict": True}},
        "tools": [FN], "tool_choice": {"type": "function", "name": "get_weather"}})
    body = p.chat_body
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "out", "schema": schema, "strict": True}}
    assert body["tools"] == [{"type": "function", "function": {
        k: v for k, v in FN.items() if k != "type"}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert (body["stream"], body["stream_options"]) == (True, {"include_usage": True})
    assert body["parallel_tool_calls"] is False and p.parallel_tool_calls is False
    assert p.tools == [FN] and p.tool_choice == {"type": "function", "name": "get_weather"}
    # The chat tool validation accepts the mapped tools.
    req = T.parse_tools(body)
    assert req is not None and req.function == "get_weather"
    obj = R.parse_responses({"model": "m", "input": "x",
                             "text": {"format": {"type": "json_object"}}})
    assert obj.chat_body["response_format"] == {"type": "json_object"}
    assert "response_format" not in R.parse_responses(
        {"model": "m", "input": "x", "text": {"format": {"type": "text"}}}).chat_body
    auto = R.parse_responses({"model": "m", "input": "x", "tools": [FN]})
    assert auto.chat_body["tool_choice"] == "auto" and auto.tool_choice == "auto"


@pytest.mark.parametrize("extra,param", [
    ({"store": "yes"}, "store"),
    ({"background": True}, "background"),
    ({"previous_response_id": ""}, "previous_response_id"),
    ({"previous_response_id": 1}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"prompt": {"id": "p"}}, "prompt"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"model": None}, "model"),
    ({"input": []}, "input"),
    ({"input": 3}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": "x", "name": "n"}]}, "input[0].name"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]},
     "input[0].output"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [FN, {"type": "file_search", "vector_store_ids": []}]}, "tools[1].type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [FN], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tools": [FN], "tool_choice": "sometimes"}, "tool_choice"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "n", "schema": 1}}},
     "text.format.schema"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"instructions": 5}, "instructions"),
    ({"metadata": [1]}, "metadata"),
])
def test_refusals_name_the_field(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as exc:
        R.parse_responses({"model": "m", "input": "x", **extra})
    assert (exc.value.status, exc.value.param) == (400, param)


@pytest.mark.parametrize("extra", [{"store": False}, {"store": None}, {"store": True},
                                   {"previous_response_id": "r"}, {"background": False},
                                   {"truncation": "disabled"}, {"service_tier": "auto"},
                                   {"include": []}, {"safety_identifier": "s"},
                                   {"prompt_cache_key": "k"}])
def test_no_op_values_are_accepted(extra: dict[str, Any]) -> None:
    R.parse_responses({"model": "m", "input": "x", **extra})


def test_missing_input_and_request_id() -> None:
    with pytest.raises(ApiError) as exc:
        R.parse_responses({"model": "m"})
    assert exc.value.param == "input"
    p = R.parse_responses({"model": "m", "input": "x", "request_id": "abc"})
    assert p.response_id == "abc" and p.chat_body["request_id"] == "abc"


def test_map_error() -> None:
    cases = [("messages[1].content", "input"), ("max_completion_tokens", "max_output_tokens"),
             ("response_format", "text.format"), ("temperature", "temperature"), (None, None)]
    for chat, responses in cases:
        assert R.map_error(ApiError(400, "x", param=chat)).param == responses


# --- response objects ----------------------------------------------------------------------

def _completion(message: dict[str, Any], finish: str = "stop") -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "tiny",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": USAGE}


def test_full_response_text() -> None:
    p = R.parse_responses({"model": "tiny", "input": "hi", "instructions": "sys",
                           "metadata": {"a": "b"}, "temperature": 0.5})
    obj = R.full_response(p, _completion({"role": "assistant", "content": "Hello"}), 100)
    _check(obj)
    assert (obj["object"], obj["status"], obj["created_at"], obj["id"]) == (
        "response", "completed", 100, p.response_id)
    assert (obj["instructions"], obj["metadata"], obj["temperature"]) == ("sys",
                                                                          {"a": "b"}, 0.5)
    [item] = obj["output"]
    assert item["type"] == "message" and item["id"].startswith("msg_")
    assert item["content"] == [{"type": "output_text", "text": "Hello", "annotations": [],
                                "logprobs": None}]
    assert obj["usage"] == {"input_tokens": 12, "output_tokens": 5, "total_tokens": 17,
                            "input_tokens_details": {"cached_tokens": 8,
                                                     "cache_write_tokens": 0},
                            "output_tokens_details": {"reasoning_tokens": 0}}
    assert Response.model_validate(obj).output_text == "Hello"


def test_full_response_length_is_incomplete() -> None:
    p = R.parse_responses({"model": "tiny", "input": "hi", "max_output_tokens": 5})
    obj = R.full_response(p, _completion({"role": "assistant", "content": "Hel"}, "length"),
                          1)
    _check(obj)
    assert obj["status"] == "incomplete"
    assert obj["incomplete_details"] == {"reason": "max_output_tokens"}
    assert obj["max_output_tokens"] == 5


def test_full_response_tool_calls() -> None:
    p = R.parse_responses({"model": "tiny", "input": "weather?", "tools": [FN]})
    tokenizer = _tokenizer()
    out = T.ToolCallParser(tokenizer, T.parse_tools(p.chat_body)).finish(  # type: ignore[arg-type]
        'ok <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
        "stop")
    obj = R.full_response(p, _completion(out.message(), out.finish_reason or "stop"), 1)
    _check(obj)
    msg, call = obj["output"]
    assert msg["content"][0]["text"] == "ok "
    assert call["type"] == "function_call" and call["id"].startswith("fc_")
    assert call["call_id"] == out.tool_calls[0]["id"]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Oslo"})
    assert obj["tools"] == [FN] and obj["tool_choice"] == "auto"


_TOKENIZER: list[Any] = []


def _tokenizer() -> Any:
    if not _TOKENIZER:
        from transformers import AutoTokenizer

        _TOKENIZER.append(AutoTokenizer.from_pretrained(str(ensure_tiny_model()),
                                                        local_files_only=True))
    return _TOKENIZER[0]


# --- the event stream ----------------------------------------------------------------------

def _chunk(delta: dict[str, Any] | None, finish: str | None = None,
           usage: dict[str, Any] | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk",
                         "created": 1, "model": "tiny",
                         "choices": [] if delta is None else [
                             {"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        c["usage"] = usage
    return c


def _events(parts: R.ResponsesParts, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    s = R.EventStream(parts, 7)
    events = s.start()
    for c in chunks:
        events += s.chunk(c)
    return events + s.finish()


def test_text_event_sequence() -> None:
    p = R.parse_responses({"model": "tiny", "input": "hi", "stream": True})
    chunks = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Hel"}),
              _chunk({"content": "lo"}), _chunk({}, "stop"), _chunk(None, usage=USAGE)]
    events = _events(p, chunks)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        EVENT.validate_python(e)
    assert events[0]["response"]["status"] == "in_progress"
    assert events[0]["response"]["output"] == [] and events[0]["response"]["usage"] is None
    item_id = events[2]["item"]["id"]
    assert item_id.startswith("msg_")
    assert {e["item_id"] for e in events[3:8]} == {item_id}
    assert "".join(e["delta"] for e in events if e["type"].endswith("text.delta")) == "Hello"
    assert events[6]["text"] == "Hello"
    done = events[-1]["response"]
    _check(done)
    assert done["status"] == "completed" and done["usage"]["input_tokens"] == 12
    assert [i["id"] for i in done["output"]] == [item_id]
    assert done["output"][0]["content"][0]["text"] == "Hello"


def test_tool_call_events_from_the_hermes_parser() -> None:
    p = R.parse_responses({"model": "tiny", "input": "weather?", "tools": [FN],
                           "stream": True})
    parser = T.ToolCallParser(_tokenizer(), T.parse_tools(p.chat_body))  # type: ignore[arg-type]
    text = 'On it. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    chunks = [_chunk({"role": "assistant", "content": ""})]
    for i in range(0, len(text), 4):
        d = parser.delta(text[i:i + 4], finished=i + 4 >= len(text))
        if d is not None:
            chunks.append(_chunk(d))
    chunks += [_chunk({}, parser.stream_finish_reason("stop")), _chunk(None, usage=USAGE)]
    events = _events(p, chunks)
    for e in events:
        EVENT.validate_python(e)
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    call_at = types.index("response.function_call_arguments.delta") - 1
    assert types[call_at - 1:call_at + 1] == ["response.output_item.done",
                                              "response.output_item.added"]
    assert set(types[call_at + 1:-3]) == {"response.function_call_arguments.delta"}
    assert types[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [i["type"] for i in added] == ["message", "function_call"]
    assert added[1]["call_id"].startswith("chatcmpl-tool-") and added[1]["name"] == (
        "get_weather")
    args_done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert json.loads(args_done["arguments"]) == {"city": "Oslo"}
    done = events[-1]["response"]
    _check(done)
    assert [i["id"] for i in done["output"]] == [i["id"] for i in added]
    assert done["output"][0]["content"][0]["text"] == "On it. "
    assert json.loads(done["output"][1]["arguments"]) == {"city": "Oslo"}


def test_length_and_error_streams() -> None:
    p = R.parse_responses({"model": "tiny", "input": "hi", "stream": True,
                           "max_output_tokens": 1})
    events = _events(p, [_chunk({"content": "H"}, "length"), _chunk(None, usage=USAGE)])
    assert events[-1]["response"]["status"] == "incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    s = R.EventStream(p, 1)
    s.start()
    s.chunk(_chunk({"content": "H"}))
    [err] = s.chunk(error_body(ApiError(502, "worker died", type="upstream_error")))
    assert s.failed and err["type"] == "error" and err["message"] == "worker died"
    EVENT.validate_python(err)


def test_sse_framing() -> None:
    raw = R.sse({"type": "response.output_text.delta", "delta": "é"}).decode()
    head, data, end = raw.split("\n", 2)
    assert head == "event: response.output_text.delta" and end == "\n"
    assert json.loads(data.removeprefix("data: "))["delta"] == "é"


# --- the route -----------------------------------------------------------------------------

def _app(result: Any, seen: list[dict[str, Any]], store: ResponseStore | None = None
         ) -> TestClient:
    app = FastAPI()

    @app.exception_handler(ApiError)
    async def _err(_: Request, err: ApiError) -> Any:
        from fastapi.responses import JSONResponse

        return JSONResponse(error_body(err), status_code=err.status)

    async def run_chat(body: dict[str, Any], request: Any) -> Any:
        seen.append(body)
        if isinstance(result, ApiError):
            raise result
        if isinstance(result, list):
            async def chunks() -> AsyncIterator[dict[str, Any]]:
                for c in result:
                    yield c
            return chunks()
        return result

    async def read_json(request: Request) -> Any:
        return await request.json()

    def tenant(request: Request) -> Tenant:  # the bearer token is the tenant's name
        return Tenant(request.headers.get("authorization", "open"), "")

    R.add_routes(app, run_chat, tenant, read_json, store)
    return TestClient(app)


def test_route_non_streamed_and_errors() -> None:
    seen: list[dict[str, Any]] = []
    client = _app(_completion({"role": "assistant", "content": "Hi"}), seen)
    r = client.post("/v1/responses", json={"model": "tiny", "input": "hello"})
    assert r.status_code == 200
    _check(r.json())
    assert seen[0]["messages"] == [{"role": "user", "content": "hello"}]
    r = client.post("/v1/responses", json={"model": "tiny", "input": "x", "store": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "store"
    client = _app(ApiError(400, "too long", param="max_completion_tokens"), [])
    r = client.post("/v1/responses", json={"model": "tiny", "input": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"


def test_route_streamed() -> None:
    chunks = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Yo"}),
              _chunk({}, "stop"), _chunk(None, usage=USAGE)]
    client = _app(chunks, [])
    with client.stream("POST", "/v1/responses",
                       json={"model": "tiny", "input": "x", "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    frames = [f for f in raw.split("\n\n") if f]
    types = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    last = json.loads(frames[-1].split("\n")[1].removeprefix("data: "))
    assert last["response"]["output"][0]["content"][0]["text"] == "Yo"
    assert "[DONE]" not in raw


def _store() -> ResponseStore:
    return ResponseStore(10, 1 << 20, 60.0, lambda: 0.0)


def test_route_store_retrieve_continue_and_delete() -> None:
    seen: list[dict[str, Any]] = []
    store = _store()
    client = _app(_completion({"role": "assistant", "content": "Hi"}), seen, store)
    first = client.post("/v1/responses", json={"model": "tiny", "input": "hello",
                                               "instructions": "sys"}).json()
    assert len(store) == 1
    got = client.get(f"/v1/responses/{first['id']}")
    assert got.status_code == 200 and got.json() == first
    assert client.get(f"/v1/responses/{first['id']}?stream=false").status_code == 200
    nxt = client.post("/v1/responses", json={
        "model": "tiny", "input": "again", "instructions": "new",
        "previous_response_id": first["id"], "store": False})
    assert nxt.status_code == 200 and nxt.json()["previous_response_id"] == first["id"]
    _check(nxt.json())
    assert seen[1]["messages"] == [  # the new instructions, the old turn, the new input
        {"role": "system", "content": "new"}, {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "again"}]
    assert len(store) == 1  # store: false
    assert client.get(f"/v1/responses/{nxt.json()['id']}").status_code == 404
    r = client.post(f"/v1/responses/{first['id']}/cancel")
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_id"
    r = client.delete(f"/v1/responses/{first['id']}")
    assert r.json() == {"id": first["id"], "object": "response", "deleted": True}
    for method in ("GET", "DELETE"):
        r = client.request(method, f"/v1/responses/{first['id']}")
        assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
    r = client.post("/v1/responses", json={"model": "tiny", "input": "x",
                                           "previous_response_id": first["id"]})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "previous_response_id"
    assert r.json()["error"]["code"] == "previous_response_not_found"


def test_route_tenants_and_query_refusals() -> None:
    store = _store()
    client = _app(_completion({"role": "assistant", "content": "Hi"}), [], store)
    rid = client.post("/v1/responses", json={"model": "tiny", "input": "x"},
                      headers={"authorization": "alice"}).json()["id"]
    assert client.get(f"/v1/responses/{rid}",
                      headers={"authorization": "alice"}).status_code == 200
    for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/cancel")):
        r = client.request(method, f"/v1/responses/{rid}{path}",
                           headers={"authorization": "bob"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
    r = client.post("/v1/responses", json={"model": "tiny", "input": "x",
                                           "previous_response_id": rid},
                    headers={"authorization": "bob"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    assert len(store) == 1  # bob's delete did nothing
    for query, param in (("stream=true", "stream"), ("starting_after=3", "starting_after"),
                         ("include=x", "include")):
        r = client.get(f"/v1/responses/{rid}?{query}", headers={"authorization": "alice"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_route_without_a_store_refuses_store_and_previous() -> None:
    client = _app(_completion({"role": "assistant", "content": "Hi"}), [])
    for extra, param in (({"store": True}, "store"),
                         ({"previous_response_id": "resp_1"}, "previous_response_id")):
        r = client.post("/v1/responses", json={"model": "tiny", "input": "x", **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert client.post("/v1/responses", json={"model": "tiny", "input": "x"}
                       ).status_code == 200  # store absent: fine, nothing is stored
    assert client.get("/v1/responses/resp_1").status_code == 404


def test_route_streamed_stores_the_completed_object() -> None:
    store = _store()
    chunks = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Yo"}),
              _chunk({}, "stop"), _chunk(None, usage=USAGE)]
    client = _app(chunks, [], store)
    with client.stream("POST", "/v1/responses",
                       json={"model": "tiny", "input": "x", "stream": True}) as r:
        raw = "".join(r.iter_text())
    last = json.loads([f for f in raw.split("\n\n") if f][-1].split("\n")[1]
                      .removeprefix("data: "))
    done = last["response"]
    assert client.get(f"/v1/responses/{done['id']}").json() == done
    assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == "Yo"
    failed = [_chunk({"role": "assistant", "content": ""}), {"error": {"message": "boom"}}]
    client = _app(failed, [], store)
    with client.stream("POST", "/v1/responses",
                       json={"model": "tiny", "input": "x", "stream": True}) as r:
        assert "error" in "".join(r.iter_text())
    assert len(store) == 1  # a failed stream stores nothing
