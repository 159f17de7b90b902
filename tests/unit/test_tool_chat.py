"""services.frontend.tool_chat: the chat path's tool checks, constraint and warm-up, on the
tiny model's tokenizer (its template renders tools) and on a copy with the ChatML template
of format version 1 (which renders none, as SmolLM2's)."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from typing import Any

import pytest

from services.frontend import tool_chat, tools
from services.frontend.models import Tokenizer
from services.frontend.openai_schema import ApiError, parse_chat
from workers.model.tiny import CHATML_TEMPLATE_V1, ensure_tiny_model

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}
USER = [{"role": "user", "content": "weather?"}]
CALL = {"role": "assistant", "content": None, "tool_calls": [{
    "id": "c1", "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer(str(ensure_tiny_model()))


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The tiny tokenizer with the version-1 ChatML template (renders no tools)."""
    src, dest = ensure_tiny_model(), tmp_path_factory.mktemp("plain")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, dest / name)
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHATML_TEMPLATE_V1
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return Tokenizer(str(dest))


def chat(**body: Any) -> Any:
    return parse_chat({"model": "tiny", "messages": USER, **body})


async def test_no_tools_is_untouched(tiny: Tokenizer) -> None:
    req = chat()
    assert await tool_chat.prepare(req, tiny) is req and tool_chat.chat_kwargs(req) == {}
    assert tiny.apply_chat(req.messages, **tool_chat.chat_kwargs(req)) == tiny.apply_chat(
        req.messages)


async def test_auto_on_a_template_with_tools(tiny: Tokenizer) -> None:
    req = chat(tools=[WEATHER])
    out = await tool_chat.prepare(req, tiny)
    assert out.sampling.structured is None and tool_chat.WARMUP.ready
    with_tools = tiny.apply_chat(req.messages, **tool_chat.chat_kwargs(req))
    assert len(with_tools) > len(tiny.apply_chat(req.messages))
    assert "get_weather" in tiny.decode(with_tools)


@pytest.mark.parametrize("choice,kind", [
    ("required", "array"),
    ({"type": "function", "function": {"name": "get_weather"}}, "object")])
async def test_forced_calls_get_the_schema(plain: Tokenizer, choice: Any, kind: str) -> None:
    """Forced calls need no rendering: served on a template without tools, too."""
    out = await tool_chat.prepare(chat(tools=[WEATHER], tool_choice=choice), plain)
    assert out.sampling.structured is not None
    assert out.sampling.structured.kind == "json_schema"
    assert json.loads(out.sampling.structured.value)["type"] == kind


async def test_a_template_without_tools_refuses_auto_and_tool_calls(plain: Tokenizer) -> None:
    with pytest.raises(ApiError) as err:
        await tool_chat.prepare(chat(tools=[WEATHER]), plain)
    assert err.value.status == 400 and err.value.param == "tool_choice"
    conversation = [*USER, CALL, {"role": "tool", "tool_call_id": "c1", "content": "sun"}]
    with pytest.raises(ApiError) as err:
        await tool_chat.prepare(chat(messages=conversation), plain)
    assert err.value.param == "messages[1].tool_calls"


async def test_tool_conversation_renders_the_call(tiny: Tokenizer) -> None:
    req = chat(messages=[*USER, CALL, {"role": "tool", "tool_call_id": "c1",
                                       "content": "sun"}])
    assert await tool_chat.prepare(req, tiny) is req  # no tools: no warm-up, no schema
    text = tiny.decode(tiny.apply_chat(req.messages, **tool_chat.chat_kwargs(req)),
                       skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text


def test_explain_names_tool_choice() -> None:
    refusal = ApiError(400, "worker w refused the request: sampling.structured is not "
                       "served by engine mock")
    out = tool_chat.explain(chat(tools=[WEATHER], tool_choice="required"), refusal)
    assert out.param == "tool_choice" and "structured outputs" in out.message
    assert "engine mock" in out.message
    assert tool_chat.explain(chat(tools=[WEATHER]), refusal) is refusal  # auto: not ours
    other = ApiError(400, "bad", param="max_tokens")
    assert tool_chat.explain(chat(tools=[WEATHER], tool_choice="required"), other) is other


async def test_a_failed_warm_up_is_a_500_naming_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise ImportError("no vllm here")

    monkeypatch.setattr(tools, "warm", broken)
    warm = tool_chat.ToolsWarmup()
    for _ in range(2):  # once failed, every request is told why
        with pytest.raises(ApiError) as err:
            await warm.wait()
        assert err.value.status == 500 and err.value.param == "tools"
        assert "no vllm here" in err.value.message


async def test_requests_wait_for_a_started_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    gate, calls = threading.Event(), []

    def slow() -> None:
        calls.append(1)
        gate.wait(30)

    monkeypatch.setattr(tools, "warm", slow)
    warm = tool_chat.ToolsWarmup()
    warm.start()
    waiter = asyncio.ensure_future(warm.wait())
    await asyncio.sleep(0)
    assert not waiter.done() and not warm.ready
    gate.set()
    await asyncio.wait_for(waiter, 30)
    assert warm.ready and calls == [1]  # imported once
    await warm.wait()
    assert calls == [1]

