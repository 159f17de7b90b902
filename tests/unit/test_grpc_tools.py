"""Tool calling over the gRPC Frontend API: parse_proto builds the same tool request and
message extras as the OpenAI parser (errors name the proto field), and Generate streams
each choice's hermes-parsed tool-call deltas (a pipeline stand-in plays the worker's
text: no engine writes a hermes call on demand)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from opentelemetry import trace

from protos import common_pb2, frontend_pb2
from services.frontend.jobs import Chunk, Job
from services.frontend.openai_schema import ApiError, ParsedRequest, parse_chat
from services.frontend.service import FrontendServicer, parse_proto
from workers.model.tiny import ensure_tiny_model

F = frontend_pb2
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = F.Tool(name="get_weather", description="The weather", parameters_json=json.dumps(
    PARAMS))
HTTP_WEATHER = {"type": "function", "function": {"name": "get_weather",
                                                 "description": "The weather",
                                                 "parameters": PARAMS}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def msgs(*messages: common_pb2.ChatMessage) -> F.Messages:
    return F.Messages(messages=list(messages))


USER = common_pb2.ChatMessage(role="user", content="weather?")


def chat(**fields: Any) -> F.CompletionRequest:
    fields.setdefault("messages", msgs(USER))
    fields.setdefault("sampling", common_pb2.SamplingParams(max_tokens=8))
    return F.CompletionRequest(model="m", **fields)


def test_tools_parse_as_over_http() -> None:
    history = msgs(
        USER,
        common_pb2.ChatMessage(role="assistant", tool_calls=[common_pb2.ToolCall(
            id="call_1", name="get_weather", arguments='{"city": "Paris"}')]),
        common_pb2.ChatMessage(role="tool", content="sunny", tool_call_id="call_1"))
    req = parse_proto(chat(
        messages=history, tools=[WEATHER, F.Tool(name="get_time", strict=True)],
        tool_choice=F.ToolChoice(mode=F.ToolChoice.MODE_FUNCTION, function="get_weather"),
        parallel_tool_calls=False))
    http = parse_chat({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}],
        "tools": [HTTP_WEATHER, {"type": "function",
                                 "function": {"name": "get_time", "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False})
    assert req.tools == http.tools and req.tools is not None
    assert (req.tools.choice, req.tools.function) == ("function", "get_weather")
    assert req.message_extras == http.message_extras
    assert req.messages == http.messages
    for mode, want in [(F.ToolChoice.MODE_NONE, "none"), (F.ToolChoice.MODE_AUTO, "auto"),
                       (F.ToolChoice.MODE_REQUIRED, "required")]:
        tr = parse_proto(chat(tools=[WEATHER], tool_choice=F.ToolChoice(mode=mode))).tools
        assert tr is not None and tr.choice == want
    auto = parse_proto(chat(tools=[WEATHER])).tools  # no tool_choice: auto
    assert auto is not None and auto.choice == "auto" and auto.parallel_tool_calls is None
    assert parse_proto(chat()).tools is None
    assert parse_proto(chat(tool_choice=F.ToolChoice(mode=F.ToolChoice.MODE_NONE))).tools is None
    # auto with a json_object structured output is allowed (as response_format over HTTP)
    ok = parse_proto(chat(tools=[WEATHER], sampling=common_pb2.SamplingParams(
        max_tokens=8, structured=common_pb2.StructuredOutputs(json_object=True))))
    assert ok.tools is not None and ok.sampling.structured is not None


def _call(**fields: Any) -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(role="assistant", tool_calls=[common_pb2.ToolCall(**fields)])


BAD: list[tuple[dict[str, Any], str, str]] = [
    (dict(tools=[F.Tool(name="bad name")]), "tools[0].name", "letters, digits"),
    (dict(tools=[WEATHER, WEATHER]), "tools[1].name", "used by another tool"),
    (dict(tools=[F.Tool(name="f", parameters_json="{nope")]), "tools[0].parameters_json",
     "not JSON"),
    (dict(tools=[F.Tool(name="f", parameters_json="[1]")]), "tools[0].parameters_json",
     "must be a JSON schema object"),
    (dict(tools=[F.Tool(name="f", parameters_json='{"type": "no-such-type"}')]),
     "tools[0].parameters_json", "not a valid JSON schema"),
    (dict(tools=[WEATHER], tool_choice=F.ToolChoice()), "tool_choice.mode", "must be"),
    (dict(tools=[WEATHER], tool_choice=F.ToolChoice(mode=F.ToolChoice.MODE_AUTO,
                                                    function="get_weather")),
     "tool_choice.function", "only for MODE_FUNCTION"),
    (dict(tools=[WEATHER], tool_choice=F.ToolChoice(mode=F.ToolChoice.MODE_FUNCTION)),
     "tool_choice.function", "non-empty"),
    (dict(tools=[WEATHER], tool_choice=F.ToolChoice(mode=F.ToolChoice.MODE_FUNCTION,
                                                    function="nope")),
     "tool_choice.function", "not one of the tools"),
    (dict(tool_choice=F.ToolChoice(mode=F.ToolChoice.MODE_REQUIRED)), "tool_choice",
     "needs tools"),
    (dict(tools=[WEATHER], tool_choice=F.ToolChoice(mode=F.ToolChoice.MODE_REQUIRED),
          sampling=common_pb2.SamplingParams(max_tokens=8, structured=(
              common_pb2.StructuredOutputs(json_object=True)))),
     "sampling.structured", "cannot be combined"),
    (dict(messages=msgs(USER, _call(id="c1", name="get_weather", arguments="{no"))),
     "messages[1].tool_calls[0].arguments", "not valid JSON"),
    (dict(messages=msgs(USER, _call(id="c1", name="get_weather", arguments="[1]"))),
     "messages[1].tool_calls[0].arguments", "must be a JSON object"),
    (dict(messages=msgs(USER, _call(id="c1", arguments="{}"))),
     "messages[1].tool_calls[0].name", "non-empty"),
    (dict(messages=msgs(USER, _call(name="f"))), "messages[1].tool_calls[0].id", "non-empty"),
    (dict(messages=msgs(common_pb2.ChatMessage(role="user", content="x", tool_calls=[
        common_pb2.ToolCall(id="c", name="f")]))), "messages[0].tool_calls", "assistant"),
    (dict(messages=msgs(common_pb2.ChatMessage(role="tool", content="sunny"))),
     "messages[0].tool_call_id", "required"),
    (dict(messages=msgs(common_pb2.ChatMessage(role="user", content="x",
                                               tool_call_id="c"))),
     "messages[0].tool_call_id", "only allowed on tool messages"),
    (dict(messages=None, prompt="x", tools=[WEATHER]), "tools", "for chat"),
    (dict(messages=None, prompt="x", tool_choice=F.ToolChoice(mode=F.ToolChoice.MODE_NONE)),
     "tool_choice", "for chat"),
    (dict(messages=None, prompt="x", parallel_tool_calls=True), "parallel_tool_calls",
     "for chat"),
]


@pytest.mark.parametrize("fields,param,words", BAD)
def test_bad_tool_fields_name_the_proto_field(fields: dict[str, Any], param: str,
                                              words: str) -> None:
    if fields.get("messages", ...) is None:
        fields = {k: v for k, v in fields.items() if k != "messages"}
        req = F.CompletionRequest(model="m", sampling=common_pb2.SamplingParams(max_tokens=8),
                                  **fields)
    else:
        req = chat(**fields)
    with pytest.raises(ApiError) as err:
        parse_proto(req)
    e = err.value
    assert e.status == 400 and e.param == param and words in e.message, e
    assert param in e.message  # the gRPC status carries the message alone


# --- Generate: the parser's deltas on the chunks ------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ensure_tiny_model()), local_files_only=True)


@dataclass
class _Catalog:
    tok: Any

    def tokenizer(self, model: Any) -> Any:
        return self.tok


class _Pipeline:
    """What Generate and fanout use of the pipeline; each choice "generates" its text in
    pieces of ``step`` characters, ending with ``finish``."""

    def __init__(self, tok: Any, texts: list[str], step: int, finish: str = "stop") -> None:
        self.catalog = _Catalog(tok)
        self.tracer = trace.get_tracer("test")
        self.texts, self.step, self.finish = texts, step, finish

    async def prepare(self, req: ParsedRequest) -> Job:
        return Job("rid", req, None, [1, 2, 3], 0)  # type: ignore[arg-type]

    async def _chunks(self, index: int) -> AsyncIterator[Chunk]:
        text = self.texts[index]
        pieces = [text[i:i + self.step] for i in range(0, len(text), self.step)]
        for j, piece in enumerate(pieces):
            last = j == len(pieces) - 1
            yield Chunk(piece, [j], finish_reason=self.finish if last else None,
                        prompt_tokens=3, completion_tokens=len(pieces) if last else 0)

    async def run(self, req: ParsedRequest) -> tuple[Job, AsyncIterator[Chunk]]:
        return await self.prepare(req), self._chunks(0)

    def stream(self, job: Job, ctx: Any) -> AsyncIterator[Chunk]:
        return self._chunks(int(job.request_id.rsplit("-", 1)[1]))


class _Context:
    def invocation_metadata(self) -> tuple[()]:
        return ()

    async def abort(self, code: Any, message: str, **_: Any) -> None:
        raise AssertionError(f"aborted: {code} {message}")


async def _generate(pipeline: _Pipeline, req: F.CompletionRequest) -> list[F.CompletionChunk]:
    servicer = FrontendServicer(pipeline)  # type: ignore[arg-type]
    return [c async for c in servicer.Generate(req, _Context())]  # type: ignore[arg-type]


@pytest.mark.parametrize("step", [1, 7, 1000])
async def test_generate_streams_tool_call_deltas_per_choice(tokenizer: Any, step: int) -> None:
    """n = 2 under auto: choice 0 writes a hermes call, choice 1 plain text."""
    chunks = await _generate(_Pipeline(tokenizer, [CALL, "Hello there."], step),
                             chat(tools=[WEATHER], n=2))
    by = {i: [c for c in chunks if c.index == i] for i in (0, 1)}
    deltas = [d for c in by[0] for d in c.tool_calls]
    assert {d.index for d in deltas} == {0}
    assert len({d.id for d in deltas if d.id}) == 1 and next(
        d.id for d in deltas if d.id).startswith("chatcmpl-tool-")
    assert "".join(d.name for d in deltas) == "get_weather"
    assert json.loads("".join(d.arguments for d in deltas)) == {"city": "Paris"}
    assert not "".join(c.text for c in by[0]).strip()
    assert by[0][-1].finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    assert [t for c in by[0] for t in c.token_ids] == list(range(len(by[0])))  # every token
    assert not any(c.tool_calls for c in by[1])
    assert "".join(c.text for c in by[1]) == "Hello there."
    assert by[1][-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert chunks[-1].usage.completion_tokens == len(by[0]) + len(by[1])


async def test_generate_named_and_length(tokenizer: Any) -> None:
    """A named function's output is its arguments object (the constraint's), finish
    stays the engine's; a cut call keeps ``length``."""
    named = chat(tools=[WEATHER], tool_choice=F.ToolChoice(
        mode=F.ToolChoice.MODE_FUNCTION, function="get_weather"))
    chunks = await _generate(_Pipeline(tokenizer, ['{"city": "Rome"}'], 4), named)
    deltas = [d for c in chunks for d in c.tool_calls]
    assert "".join(d.name for d in deltas) == "get_weather"
    assert json.loads("".join(d.arguments for d in deltas)) == {"city": "Rome"}
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    cut = await _generate(_Pipeline(tokenizer, [CALL[:30]], 5, finish="length"),
                          chat(tools=[WEATHER]))
    assert cut[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
