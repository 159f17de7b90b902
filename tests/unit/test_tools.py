"""services.frontend.tools: validation, the tool-choice schema, vLLM's hermes parsing."""

from __future__ import annotations

import json
from typing import Any

import jinja2
import jsonschema
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from services.frontend import tools as T
from services.frontend.openai_schema import ApiError
from workers.model.paths import models_dir
from workers.model.tiny import CHATML_TEMPLATE, CHATML_TEMPLATE_V1, ensure_tiny_model

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

# A Hermes-style template that renders tools and tool calls (as Qwen / Hermes models do).
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}"
    "{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{%- endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ensure_tiny_model()), local_files_only=True)


def _req(**body: Any) -> T.ToolRequest:
    req = T.parse_tools(body)
    assert req is not None
    return req


# --- validation ------------------------------------------------------------------------------

@pytest.mark.parametrize("body", [{}, {"tools": None}, {"tools": []},
                                  {"tools": [], "tool_choice": "none"}])
def test_no_tools_is_none(body: dict[str, Any]) -> None:
    assert T.parse_tools(body) is None


def test_defaults_and_named_choice() -> None:
    req = _req(tools=[WEATHER, TIME])
    assert (req.choice, req.function) == ("auto", None)
    assert [t.name for t in req.tools] == ["get_weather", "get_time"]
    assert req.tool_dicts()[0] == WEATHER
    named = _req(tools=[WEATHER, TIME], tool_choice=NAMED, parallel_tool_calls=False)
    assert (named.choice, named.function, named.parallel_tool_calls) == (
        "function", "get_weather", False)
    assert named.constrained and _req(tools=[WEATHER], tool_choice="required").constrained
    assert not _req(tools=[WEATHER], tool_choice="none").constrained


def _fn(**kw: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", **kw}}


@pytest.mark.parametrize("body,param", [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": ["x"]}, "tools[0]"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]},
     "tools[0].function.name"),
    ({"tools": [TIME, TIME]}, "tools[1].function.name"),
    ({"tools": [_fn(parameters=[1])]}, "tools[0].function.parameters"),
    ({"tools": [_fn(parameters={"type": 5})]}, "tools[0].function.parameters"),
    ({"tools": [_fn(description=3)]}, "tools[0].function.description"),
    ({"tools": [_fn(strict="yes")]}, "tools[0].function.strict"),
    ({"tools": [_fn(extra=1)]}, "tools[0].function.extra"),
    ({"tools": [{**TIME, "x": 1}]}, "tools[0].x"),
    ({"tools": [TIME], "tool_choice": "any"}, "tool_choice"),
    ({"tools": [TIME], "tool_choice": 3}, "tool_choice"),
    ({"tools": [TIME], "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": ""}}},
     "tool_choice.function.name"),
    ({"tools": [TIME], "tool_choice": NAMED}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [TIME], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
])
def test_bad_tools_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as exc:
        T.parse_tools(body)
    assert (exc.value.status, exc.value.param) == (400, param)


def test_response_format_conflicts_with_forced_calls() -> None:
    fmt = {"response_format": {"type": "json_object"}}
    err = T.conflict(_req(tools=[WEATHER], tool_choice="required"), fmt)
    assert err is not None and err.param == "response_format"
    assert T.conflict(_req(tools=[WEATHER], tool_choice=NAMED), fmt) is not None
    assert T.conflict(_req(tools=[WEATHER]), fmt) is None  # auto: both apply
    assert T.conflict(_req(tools=[WEATHER], tool_choice="required"),
                      {"response_format": {"type": "text"}}) is None
    assert T.conflict(None, fmt) is None


# --- the constraint for required / named ----------------------------------------------------

def _schema(req: T.ToolRequest) -> dict[str, Any]:
    so = T.structured_for(req)
    assert so is not None and so.WhichOneof("kind") == "json_schema"
    out: dict[str, Any] = json.loads(so.json_schema)
    return out


def test_required_schema_is_an_array_of_name_parameters() -> None:
    schema = _schema(_req(tools=[WEATHER, TIME], tool_choice="required"))
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert "maxItems" not in schema
    names = [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    ok = [{"name": "get_weather", "parameters": {"city": "Paris"}},
          {"name": "get_time", "parameters": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "nope", "parameters": {}}],
                [{"name": "get_weather", "parameters": {}}], [{"name": "get_time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = _schema(_req(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    assert single["maxItems"] == 1


def test_required_schema_merges_defs() -> None:
    tool = _fn(parameters={"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
                           "$defs": {"P": {"type": "integer"}}})
    schema = _schema(_req(tools=[tool], tool_choice="required"))
    assert schema["$defs"] == {"P": {"type": "integer"}}
    jsonschema.validate([{"name": "f", "parameters": {"p": 3}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"p": "x"}}], schema)


def test_named_schema_is_the_functions_parameters() -> None:
    assert _schema(_req(tools=[WEATHER, TIME], tool_choice=NAMED)) == (
        WEATHER["function"]["parameters"])
    no_params = _schema(_req(tools=[TIME], tool_choice={
        "type": "function", "function": {"name": "get_time"}}))
    jsonschema.validate({}, no_params)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([1], no_params)


def test_auto_and_none_are_unconstrained() -> None:
    assert T.structured_for(_req(tools=[WEATHER])) is None
    assert T.structured_for(_req(tools=[WEATHER], tool_choice="none")) is None
    assert T.structured_for(None) is None


# --- messages and templates -----------------------------------------------------------------

def test_render_kwargs() -> None:
    assert T.render_kwargs(None) == {}
    assert T.render_kwargs(_req(tools=[WEATHER], tool_choice="none")) == {"tools": [WEATHER]}


def test_message_extras_parse_arguments() -> None:
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert T.message_extras(msgs) == {
        1: {"tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        2: {"tool_call_id": "call_1"}}


def _call(args: Any = "{}", **kw: Any) -> dict[str, Any]:
    return {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}, **kw}


@pytest.mark.parametrize("msg,param", [
    ({"role": "assistant", "tool_calls": [_call("{nope")]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [_call("[1]")]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{**_call(), "id": ""}]},
     "messages[0].tool_calls[0].id"),
    ({"role": "assistant", "tool_calls": [_call(x=1)]}, "messages[0].tool_calls[0].x"),
    ({"role": "assistant", "tool_calls": {"a": 1}}, "messages[0].tool_calls"),
    ({"role": "user", "tool_calls": [_call()]}, "messages[0].tool_calls"),
    ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
    ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[0].tool_call_id"),
])
def test_bad_tool_messages_name_the_field(msg: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as exc:
        T.message_extras([msg])
    assert exc.value.param == param


def _jinja(template: str) -> T.Render:
    env = jinja2.Environment()
    env.filters["tojson"] = json.dumps
    tpl = env.from_string(template)
    return lambda messages, tools: tpl.render(messages=messages, tools=tools,
                                              add_generation_prompt=True)


def test_template_support_probe() -> None:
    assert T.template_support(_jinja(CHATML_TEMPLATE_V1)) == T.TemplateSupport(False, False)
    assert T.template_support(_jinja(TOOLS_TEMPLATE)) == T.TemplateSupport(True, True)
    assert T.template_support(_jinja(CHATML_TEMPLATE)) == T.TemplateSupport(True, True)


def test_served_templates_tiny_renders_tools_smollm2_does_not(tokenizer: Any) -> None:
    """The tiny model's template (format version 2) renders tools and tool calls, so
    ``auto`` is served there; SmolLM2's renders neither (``auto`` refused)."""
    def render(tok: Any) -> T.Render:
        return lambda m, t: str(tok.apply_chat_template(
            m, tools=t, tokenize=False, add_generation_prompt=True))

    assert T.template_support(render(tokenizer)) == T.TemplateSupport(True, True)
    smol = models_dir() / "SmolLM2-135M-Instruct"
    if (smol / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(smol), local_files_only=True)
        assert T.template_support(render(tok)) == T.TemplateSupport(False, False)


def test_template_problem() -> None:
    none = T.TemplateSupport(False, False)
    err = T.template_problem(_req(tools=[WEATHER]), [], none, "tiny")
    assert err is not None and err.param == "tool_choice" and "tiny" in err.message
    for ok in ("required", NAMED, "none"):
        assert T.template_problem(_req(tools=[WEATHER], tool_choice=ok), [], none,
                                  "tiny") is None
    assert T.template_problem(_req(tools=[WEATHER]), [], T.TemplateSupport(True, False),
                              "m") is None
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [_call()]}]
    err = T.template_problem(None, msgs, T.TemplateSupport(True, False), "m")
    assert err is not None and err.param == "messages[1].tool_calls"
    assert T.template_problem(None, msgs, T.TemplateSupport(True, True), "m") is None


# --- vLLM's hermes parsing ------------------------------------------------------------------

def _completion(out: T.ToolOutput) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": out.message(), "logprobs": None,
                         "finish_reason": out.finish_reason}]}


def test_auto_finish_parses_hermes_calls(tokenizer: Any) -> None:
    p = T.ToolCallParser(tokenizer, _req(tools=[WEATHER, TIME]))
    out = p.finish("Let me check. " + CALL + '<tool_call>{"name": "get_time", '
                   '"arguments": {}}</tool_call>', "stop")
    assert out.content == "Let me check. " and out.finish_reason == "tool_calls"
    assert [c["function"]["name"] for c in out.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(out.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function"
               for c in out.tool_calls)
    assert len({c["id"] for c in out.tool_calls}) == 2
    ChatCompletion.model_validate(_completion(out))


def test_auto_finish_without_call_and_parallel_off(tokenizer: Any) -> None:
    plain = T.ToolCallParser(tokenizer, _req(tools=[WEATHER])).finish("Hello.", "length")
    assert (plain.content, plain.tool_calls, plain.finish_reason) == ("Hello.", [], "length")
    assert "tool_calls" not in plain.message()
    one = T.ToolCallParser(tokenizer, _req(tools=[WEATHER], parallel_tool_calls=False))
    assert len(one.finish(CALL + CALL, "stop").tool_calls) == 1


def test_required_and_named_finish(tokenizer: Any) -> None:
    req = T.ToolCallParser(tokenizer, _req(tools=[WEATHER, TIME], tool_choice="required"))
    out = req.finish('[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
                     '{"name": "get_time", "parameters": {}}]', "stop")
    assert (out.content, out.finish_reason) == ("", "tool_calls")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in out.tool_calls] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert req.finish("[", "length").finish_reason == "length"
    named = T.ToolCallParser(tokenizer, _req(tools=[WEATHER], tool_choice=NAMED))
    out = named.finish('{"city": "Oslo"}', "stop")
    assert out.finish_reason == "stop"  # OpenAI: "stop" for a named function
    assert out.tool_calls[0]["function"] == {"name": "get_weather",
                                             "arguments": '{"city": "Oslo"}'}
    ChatCompletion.model_validate(_completion(out))


def _stream(parser: T.ToolCallParser, text: str, cuts: list[int]) -> list[dict[str, Any]]:
    bounds = [0, *cuts, len(text)]
    deltas = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        d = parser.delta(text[a:b], finished=i == len(bounds) - 2)
        if d is not None:
            deltas.append(d)
    return deltas


def _assemble(deltas: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    content = "".join(d.get("content") or "" for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"ids": [], "name": None, "args": ""})
            if tc.get("id"):
                call["ids"].append(tc["id"])
            fn = tc.get("function") or {}
            call["name"] = fn.get("name") or call["name"]
            call["args"] += fn.get("arguments") or ""
    return content, [calls[i] for i in sorted(calls)]


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
            "model": "m", "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                       "finish_reason": finish}]}


TEXT = "Sure. " + CALL
AWKWARD = [7, 9, 16, 17, 20, 27, 33, 40, 55, 60, len(TEXT) - 5]  # inside tags and keys


@pytest.mark.parametrize("cuts", [
    list(range(1, len(TEXT))),  # one character at a time
    list(range(3, len(TEXT), 3)),
    list(range(7, len(TEXT), 7)),
    AWKWARD,
    [],  # everything in one delta
], ids=["by1", "by3", "by7", "awkward", "whole"])
def test_auto_streaming_deltas(tokenizer: Any, cuts: list[int]) -> None:
    p = T.ToolCallParser(tokenizer, _req(tools=[WEATHER]))
    deltas = _stream(p, TEXT, cuts)
    content, calls = _assemble(deltas)
    assert content == "Sure. "  # never a piece of "<tool_call>"
    assert len(calls) == 1 and calls[0]["name"] == "get_weather"
    assert len(calls[0]["ids"]) == 1 and calls[0]["ids"][0].startswith("chatcmpl-tool-")
    assert json.loads(calls[0]["args"]) == {"city": "Paris"}
    assert p.stream_finish_reason("stop") == "tool_calls"
    assert p.stream_finish_reason("length") == "length"
    for d in deltas:
        ChatCompletionChunk.model_validate(_chunk(d))


def test_auto_streaming_plain_text(tokenizer: Any) -> None:
    p = T.ToolCallParser(tokenizer, _req(tools=[WEATHER]))
    text = "No tools needed, a < b."
    content, calls = _assemble(_stream(p, text, list(range(1, len(text)))))
    assert (content, calls) == (text, [])
    assert p.stream_finish_reason("stop") == "stop"


@pytest.mark.parametrize("step", [1, 4, 11])
def test_required_streaming(tokenizer: Any, step: int) -> None:
    p = T.ToolCallParser(tokenizer, _req(tools=[WEATHER, TIME], tool_choice="required"))
    text = ('[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
            '{"name": "get_time", "parameters": {}}]')
    deltas = _stream(p, text, list(range(step, len(text), step)))
    _, calls = _assemble(deltas)
    assert [(c["name"], json.loads(c["args"]), len(c["ids"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}, 1), ("get_time", {}, 1)]
    assert p.stream_finish_reason("stop") == "tool_calls"
    for d in deltas:
        ChatCompletionChunk.model_validate(_chunk(d))


def test_named_streaming(tokenizer: Any) -> None:
    p = T.ToolCallParser(tokenizer, _req(tools=[WEATHER], tool_choice=NAMED))
    text = '{"city": "Oslo"}'
    _, calls = _assemble(_stream(p, text, list(range(2, len(text), 2))))
    assert [(c["name"], c["args"], len(c["ids"])) for c in calls] == [
        ("get_weather", text, 1)]
    assert p.stream_finish_reason("stop") == "stop"


def test_none_choice_passes_text_through(tokenizer: Any) -> None:
    p = T.ToolCallParser(tokenizer, _req(tools=[WEATHER], tool_choice="none"))
    assert p.finish(CALL, "stop") == T.ToolOutput(CALL, [], "stop")
    content, calls = _assemble(_stream(p, CALL, list(range(5, len(CALL), 5))))
    assert (content, calls) == (CALL, [])
