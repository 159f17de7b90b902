"""OpenAI's Responses API (``POST /v1/responses``) served by the chat completions path.

The request and response shapes follow vLLM's server (non-Harmony models, the simple
path): vLLM's ``ResponsesRequest`` / ``ResponsesResponse`` and its streaming events.
The stream's state machine is vLLM's own ``SimpleStreamingEventProcessor``. Contract:

- :func:`parse_responses` checks a body and maps it to a chat completions body
  (:class:`ResponsesParts`). It is pure. The mapping:
  - ``instructions`` becomes a first system message. ``input`` is a string (one user
    message) or a list of items. A message item (``role`` user / system / developer /
    assistant; ``content`` a string or ``input_text`` / ``output_text`` /
    ``input_image`` parts, where the image is an ``image_url`` string) becomes a chat
    message. A ``function_call`` becomes an assistant ``tool_calls`` entry, joined to
    the assistant message before it, as vLLM does. A ``function_call_output`` becomes a
    ``tool`` message.
  - ``max_output_tokens`` becomes ``max_completion_tokens``. ``temperature``, ``top_p``,
    ``top_k``, ``seed``, ``stop``, the penalties, ``user`` and ``cache_salt`` pass
    through.
  - ``text.format`` (``text``, ``json_object``, ``json_schema`` with ``name`` and
    ``schema``) becomes ``response_format``, that is, structured outputs.
  - Function ``tools`` (``{"type": "function", "name", "description", "parameters",
    "strict"}``) become chat tools. ``tool_choice`` (``none``, ``auto``, ``required``,
    ``{"type": "function", "name"}``) and ``parallel_tool_calls`` pass through.
  - ``stream`` becomes a chat stream with ``include_usage``.
  ``store`` (a boolean) and ``previous_response_id`` (a non-empty string) are kept in
  :class:`ResponsesParts` for :func:`with_history`. What is not served is a 400 that
  names the field: ``background: true`` (no background mode: no queued responses, no
  event replay), ``conversation``, ``reasoning``, ``include``, ``prompt``, ``max_tool_calls``,
  ``top_logprobs``, ``truncation: "auto"``, ``stream_options``, ``text.verbosity``,
  built-in tools (``tools[i].type``: web_search, file_search, mcp, ...), reasoning and
  other input items (``input[i].type``), and unknown fields. ``metadata``, ``user``,
  ``safety_identifier``, ``prompt_cache_key`` and ``service_tier`` (auto / default) are
  accepted. The first two are echoed back.
- :func:`response_object` builds vLLM's response object (``object: "response"``, id
  ``resp_<hex>``, or the body's ``request_id``). The request's settings are echoed.
  ``status`` is ``completed``, or ``incomplete`` with ``incomplete_details.reason:
  "max_output_tokens"`` when the chat finished with ``length``. ``usage`` is
  ``input_tokens``, ``input_tokens_details.cached_tokens`` and ``cache_write_tokens``
  (the chat usage's, 0 when it has none: kvmesh does not measure it), ``output_tokens``,
  ``output_tokens_details.reasoning_tokens`` (0) and ``total_tokens``.
  :func:`full_response` builds it from a chat completion: a ``message`` item ``msg_<hex>``
  with one ``output_text`` part when there is content, and then one ``function_call``
  item ``fc_<hex>`` per tool call (``call_id`` = the chat tool call's id, ``arguments``
  a JSON string).
- :class:`EventStream` (pure, one per stream) turns chat chunk dicts into the Responses
  event stream. ``start()`` gives ``response.created`` and ``response.in_progress``.
  ``chunk(c)`` gives ``response.output_item.added``, ``response.content_part.added``,
  ``response.output_text.delta``, ``..._text.done``, ``content_part.done``,
  ``output_item.done``, and for tool calls ``response.function_call_arguments.delta`` /
  ``.done``. ``finish()`` closes the open item and ends with ``response.completed``,
  whose output is the streamed items with the same ids. A chunk ``{"error": {...}}`` gives
  an ``error`` event and ends the stream. ``sequence_number`` counts from 0.
  :func:`stream_events` drives it over an async iterator. :func:`sse` frames an event as
  ``event: <type>\\ndata: <json>\\n\\n``, as vLLM does, with no ``[DONE]``. A streamed
  request first waits for :data:`~.tool_chat.WARMUP` (vLLM is not imported from two
  threads at once).
- Storage (:mod:`.responses_store`, bounded by ``--responses-store-size`` entries,
  ``--responses-store-mib`` and ``--responses-store-ttl-s``, per tenant). As OpenAI, a
  response is stored unless the body says ``store: false`` (vLLM stores only with
  ``VLLM_ENABLE_RESPONSES_API_STORE``; kvmesh stores by default and
  ``--responses-store-size 0`` turns storage off, and then ``store: true`` is a 400
  naming ``store`` rather than vLLM's silent no-op). What is stored is the final response
  object, streamed or not (a stream's ``response.completed`` object, stored before that
  event is sent; a stream that fails or is abandoned stores nothing), with the chat
  messages it was generated from. :func:`with_history`: ``previous_response_id`` of a
  response the caller's tenant has stored makes the chat messages the new instructions'
  system message, then the stored conversation (:func:`~.responses_store.conversation`:
  the earlier messages without system messages, then the stored output as an assistant
  message with its function calls), then the new input; it is echoed in the response.
  Unknown, expired, evicted, deleted or another tenant's: 404 ``{"message": "Previous
  response with id '<id>' not found.", "param": "previous_response_id", "code":
  "previous_response_not_found"}``; with storage off a 400 naming it.
  ``GET /v1/responses/{id}`` answers the stored object; ``DELETE /v1/responses/{id}``
  removes it and answers ``{"id", "object": "response", "deleted": true}``; ``POST
  /v1/responses/{id}/cancel`` is vLLM's 400 "Cannot cancel a synchronous response."
  (``param: response_id``) for a stored one (none is in the background). All three
  answer an id the caller's tenant has not stored with vLLM's 404 ``Response with id
  '<id>' not found.`` (``param: response_id``), whoever else stored it. A query
  parameter other than ``stream=false`` (``stream=true``, ``starting_after``: vLLM's
  background event replay) is a 400 naming it.
- :func:`add_routes` adds the routes. It needs a :data:`RunChat` callable. Given a chat
  body (as from :func:`with_history`) and the HTTP request (for the tenant), it runs
  it exactly as ``POST /v1/chat/completions`` would, tool parsing included. For
  ``stream: false`` it returns the chat completion dict. Otherwise it returns an async
  iterator of ``chat.completion.chunk`` dicts (the SSE payloads without ``data:``),
  ending with the usage chunk, or ``{"error": ...}`` when the stream failed part-way.
  An ApiError raised before the first chunk is answered as is, with ``param`` mapped
  back to the Responses field names (``messages...`` → ``input``,
  ``max_completion_tokens`` → ``max_output_tokens``, ``response_format`` →
  ``text.format``).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.frontend import tool_chat
from services.frontend.auth import Tenant
from services.frontend.openai_schema import ApiError
from services.frontend.responses_store import ResponseStore, Stored, continue_messages

log = logging.getLogger(__name__)

SUPPORTED = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "top_k",
    "seed", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty", "text",
    "tools", "tool_choice", "parallel_tool_calls", "stream", "request_id", "cache_salt",
    "store", "previous_response_id",
})
NO_EFFECT = frozenset({"metadata", "user", "safety_identifier", "prompt_cache_key"})
_PASS = ("temperature", "top_p", "top_k", "seed", "stop", "presence_penalty",
         "frequency_penalty", "repetition_penalty", "cache_salt", "user", "request_id",
         "parallel_tool_calls")
NO_OP: dict[str, tuple[Any, ...]] = {
    "background": (None, False),
    "conversation": (None,),
    "reasoning": (None,),
    "include": (None, []),
    "prompt": (None,),
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
    "truncation": (None, "disabled"),
    "service_tier": (None, "auto", "default"),
    "stream_options": (None,),
}
_WHY = {
    "background": "background mode is not served; send background: false or leave it "
                  "out",
    "conversation": "conversations are not stored; send the whole conversation in 'input'",
    "reasoning": "no reasoning parser is served",
}
_ITEM_KEYS = frozenset({"type", "role", "content", "id", "status"})
_ROLES = ("user", "system", "developer", "assistant")
_PARAM_MAP = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
              ("response_format", "text.format"))


def _bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param=param)


def _hex() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class ResponsesParts:
    """A checked /v1/responses body: the chat body to run and what the response echoes."""

    chat_body: dict[str, Any]
    model: str
    response_id: str
    stream: bool = False
    instructions: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)  # Responses format
    tool_choice: Any = "none"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_output_tokens: int | None = None
    text: dict[str, Any] | None = None
    service_tier: str = "auto"
    store: bool | None = None  # the body's (None: absent)
    previous_response_id: str | None = None


def _check_fields(body: dict[str, Any]) -> None:
    for name, value in body.items():
        if name in SUPPORTED or name in NO_EFFECT:
            continue
        if name in NO_OP:
            if any(type(value) is type(a) and value == a for a in NO_OP[name]):
                continue
            why = _WHY.get(name, "send it as null or leave it out")
            raise _bad(f"'{name}' is not supported by kvmesh: {why}", name)
        raise _bad(f"Unrecognized request argument supplied: '{name}'", name)


def _text_part(part: Any, where: str, role: str) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise _bad(f"{where} must be an object", where)
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "input_image" and role != "assistant":
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise _bad(f"{where}.image_url must be a URL string (file_id is not served)",
                       f"{where}.image_url")
        return {"type": "image_url", "image_url": {"url": url}}
    raise _bad(f"{where}.type {kind!r} is not served (input_text, output_text and "
               "input_image are)", f"{where}.type")


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    for key in item:
        if key not in _ITEM_KEYS:
            raise _bad(f"Unrecognized key in {where}: '{key}'", f"{where}.{key}")
    role = item.get("role")
    if role not in _ROLES:
        raise _bad(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}",
                   f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of parts",
                   f"{where}.content")
    parts = [_text_part(p, f"{where}.content[{j}]", role) for j, p in enumerate(content)]
    if all(p["type"] == "text" for p in parts):
        return {"role": role, "content": "".join(p["text"] for p in parts)}
    return {"role": role, "content": parts}


def _string(item: dict[str, Any], key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str) or (key != "arguments" and not v):
        raise _bad(f"{where}.{key} must be a non-empty string", f"{where}.{key}")
    return v


def _input_messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("'input' must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}
            prev = out[-1] if out and out[-1]["role"] == "assistant" else None
            if prev is not None:
                prev.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = "\n".join(_text_part(p, f"{where}.output[{j}]", "tool")["text"]
                                   for j, p in enumerate(output))
            if not isinstance(output, str):
                raise _bad(f"{where}.output must be a string", f"{where}.output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": output})
        else:
            raise _bad(f"{where}.type {kind!r} is not served (message, function_call and "
                       "function_call_output are)", f"{where}.type")
    return out


def _tools(value: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(Responses-format tools, chat-format tools)."""
    if value is None:
        return [], []
    if not isinstance(value, list):
        raise _bad("'tools' must be a list", "tools")
    chat = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(f"{where} must be an object", where)
        if tool.get("type") != "function":
            raise _bad(f"{where}.type {tool.get('type')!r} is not served: only function "
                       "tools are (no built-in tools such as web_search)", f"{where}.type")
        fn = {k: v for k, v in tool.items() if k != "type"}
        chat.append({"type": "function", "function": fn})
    return list(value), chat


def _tool_choice(value: Any, has_tools: bool) -> tuple[Any, Any]:
    """(Responses-format choice to echo, chat-format choice or None)."""
    if value is None:
        value = "auto"
    if isinstance(value, dict):
        if value.get("type") != "function" or set(value) - {"type", "name"}:
            raise _bad("tool_choice as an object must be {'type': 'function', 'name': "
                       "...}", "tool_choice")
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise _bad("tool_choice.name must be a non-empty string", "tool_choice.name")
        return value, {"type": "function", "function": {"name": name}}
    if value not in ("none", "auto", "required"):
        raise _bad(f"tool_choice must be 'none', 'auto', 'required' or a function, got "
                   f"{value!r}", "tool_choice")
    if not has_tools:
        if value == "required":
            raise _bad("tool_choice 'required' needs tools", "tool_choice")
        return "none", None
    return value, value


def _text_format(text: Any) -> dict[str, Any] | None:
    """The chat response_format of ``text`` (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise _bad("'text' must be an object with 'format'", "text")
    if text.get("verbosity") is not None:
        raise _bad("'text.verbosity' is not supported by kvmesh", "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        assert isinstance(fmt, dict)
        for key in fmt:
            if key not in ("type", "name", "schema", "description", "strict"):
                raise _bad(f"Unrecognized key in text.format: '{key}'", f"text.format.{key}")
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:
            raise _bad("text.format.name is required", "text.format.name")
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("text.format.schema must be a JSON schema object",
                       "text.format.schema")
        return {"type": "json_schema",
                "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    raise _bad("text.format.type must be 'text', 'json_object' or 'json_schema'",
               "text.format.type")


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise _bad(f"'{name}' must be an integer > 0, got {v!r}", name)
    return v


def _opt_str(body: dict[str, Any], name: str) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise _bad(f"'{name}' must be a string", name)
    return v


def parse_responses(body: Any) -> ResponsesParts:
    """Checks a /v1/responses body and maps it onto chat (module docstring)."""
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", None)
    _check_fields(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required (a non-empty string)", "model")
    if "input" not in body:
        raise _bad("'input' is required", "input")
    instructions = _opt_str(body, "instructions")
    messages = _input_messages(body["input"])
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise _bad("'metadata' must be an object", "metadata")
    tools, chat_tools = _tools(body.get("tools"))
    echo_choice, chat_choice = _tool_choice(body.get("tool_choice"), bool(tools))
    max_output = _positive_int(body, "max_output_tokens")
    chat: dict[str, Any] = {"model": model, "messages": messages}
    chat.update({k: body[k] for k in _PASS if body.get(k) is not None})
    if max_output is not None:
        chat["max_completion_tokens"] = max_output
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    if chat_tools:
        chat["tools"] = chat_tools
        chat["tool_choice"] = chat_choice
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    rid = body.get("request_id")
    if rid is not None and (not isinstance(rid, str) or not rid):
        raise _bad("'request_id' must be a non-empty string", "request_id")
    parallel = body.get("parallel_tool_calls")
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise _bad("'store' must be a boolean", "store")
    previous = _opt_str(body, "previous_response_id")
    if previous is not None and not previous:
        raise _bad("'previous_response_id' must be a non-empty string",
                   "previous_response_id")
    return ResponsesParts(
        chat_body=chat, model=model, response_id=rid or f"resp_{_hex()}",
        stream=bool(stream), instructions=instructions, metadata=metadata,
        user=_opt_str(body, "user"), tools=tools, tool_choice=echo_choice,
        parallel_tool_calls=True if parallel is None else bool(parallel),
        temperature=body.get("temperature"), top_p=body.get("top_p"),
        presence_penalty=body.get("presence_penalty"),
        frequency_penalty=body.get("frequency_penalty"),
        max_output_tokens=max_output, text=body.get("text"),
        service_tier=body.get("service_tier") or "auto", store=store,
        previous_response_id=previous,
    )


def map_error(err: ApiError) -> ApiError:
    """``err`` with its chat ``param`` renamed to the Responses field (module doc)."""
    if err.param is None:
        return err
    for chat, responses in _PARAM_MAP:
        if err.param == chat or err.param.startswith((chat + ".", chat + "[")):
            return replace(err, param=responses)
    return err


def usage_object(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """The Responses ``usage`` of a chat ``usage`` dict."""
    if chat_usage is None:
        return None
    p = int(chat_usage.get("prompt_tokens", 0))
    c = int(chat_usage.get("completion_tokens", 0))
    details = chat_usage.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or 0)
    written = int(details.get("cache_write_tokens") or 0)
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": cached,
                                                        "cache_write_tokens": written},
            "output_tokens": c, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": p + c}


def response_object(parts: ResponsesParts, *, created_at: int, status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None,
                    model: str | None = None) -> dict[str, Any]:
    """vLLM's response object for ``parts`` (module docstring)."""
    return {
        "id": parts.response_id, "created_at": created_at,
        "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                               else None),
        "instructions": parts.instructions, "metadata": parts.metadata,
        "model": model or parts.model, "object": "response", "output": output,
        "parallel_tool_calls": parts.parallel_tool_calls,
        "temperature": 1.0 if parts.temperature is None else parts.temperature,
        "tool_choice": parts.tool_choice, "tools": parts.tools,
        "top_p": 1.0 if parts.top_p is None else parts.top_p,
        "background": False, "max_output_tokens": parts.max_output_tokens,
        "max_tool_calls": None, "previous_response_id": parts.previous_response_id,
        "prompt": None,
        "reasoning": None, "service_tier": parts.service_tier, "status": status,
        "text": parts.text, "top_logprobs": None, "truncation": "disabled",
        "usage": usage, "user": parts.user,
        "presence_penalty": parts.presence_penalty or 0.0,
        "frequency_penalty": parts.frequency_penalty or 0.0,
    }


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The output items of a chat ``message`` (content, then each tool call)."""
    items: list[dict[str, Any]] = []
    if message.get("content"):
        items.append({"id": f"msg_{_hex()}", "type": "message", "role": "assistant",
                      "status": "completed", "content": [
                          {"type": "output_text", "text": message["content"],
                           "annotations": [], "logprobs": None}]})
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        items.append({"id": f"fc_{_hex()}", "type": "function_call", "call_id": call["id"],
                      "name": fn["name"], "arguments": fn["arguments"],
                      "status": "completed"})
    return items


def full_response(parts: ResponsesParts, completion: dict[str, Any],
                  created_at: int) -> dict[str, Any]:
    """The response object of a finished chat completion dict."""
    choice = completion["choices"][0]
    return response_object(parts, created_at=created_at,
                           status=_status(choice.get("finish_reason")),
                           output=output_items(choice["message"]),
                           usage=usage_object(completion.get("usage")),
                           model=completion.get("model"))


def _dump(event: Any) -> dict[str, Any]:
    out: dict[str, Any] = event.model_dump(mode="json", by_alias=True)
    return out


class EventStream:
    """The Responses events of one chat stream (module docstring); not thread-safe."""

    def __init__(self, parts: ResponsesParts, created_at: int) -> None:
        from vllm.entrypoints.generate.base.protocol import DeltaMessage
        from vllm.entrypoints.openai.responses.streaming_events import (
            SimpleStreamingEventProcessor,
            _StateType,
            split_delta,
        )

        self.parts = parts
        self.created_at = created_at
        self._delta_cls = DeltaMessage
        self._split = split_delta
        self._none = _StateType.NONE
        self._proc = SimpleStreamingEventProcessor(tools=None)
        self._seq = 0
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None
        self._model: str | None = None
        self.failed = False

    def _number(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for e in events:
            e["sequence_number"] = self._seq
            self._seq += 1
        return events

    def _response(self, status: str, output: list[dict[str, Any]],
                  usage: dict[str, Any] | None) -> dict[str, Any]:
        return response_object(self.parts, created_at=self.created_at, status=status,
                               output=output, usage=usage, model=self._model)

    def start(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        r = self._response("in_progress", [], None)
        return self._number([{"type": "response.created", "response": r},
                             {"type": "response.in_progress", "response": r}])

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat chunk dict."""
        if "error" in chunk:
            err = chunk["error"] or {}
            self.failed = True
            return self._number([{"type": "error", "code": err.get("code"),
                                  "message": str(err.get("message", "")),
                                  "param": err.get("param")}])
        self._model = chunk.get("model", self._model)
        if chunk.get("usage"):
            self._usage = usage_object(chunk["usage"])
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
            delta = {k: v for k, v in (choice.get("delta") or {}).items() if k != "role"}
            if not delta:
                continue
            msg = self._delta_cls.model_validate(delta)
            for dm in self._split(msg):
                target, call = self._proc.resolve_target_state(dm)
                if target == self._none:
                    continue
                if self._proc.needs_transition(target, call):
                    events += [_dump(e) for e in self._proc.close_current()]
                    events += [_dump(e) for e in self._proc.open(target, call)]
                # The engine output is only read for logprobs, which are not served.
                events += [_dump(e) for e in self._proc.emit_delta(
                    dm, None, None)]  # type: ignore[arg-type]
        return self._number(events)

    def finish(self) -> list[dict[str, Any]]:
        """Closes the open item; ``response.completed`` (module docstring)."""
        events = [_dump(e) for e in self._proc.close_current()]
        output = [_dump(i) for i in self._proc.output_items]
        done = self._response(_status(self._finish), output, self._usage)
        events.append({"type": "response.completed", "response": done})
        return self._number(events)


async def stream_events(parts: ResponsesParts, chunks: AsyncIterator[dict[str, Any]],
                        created_at: int) -> AsyncIterator[dict[str, Any]]:
    """The Responses events of a chat chunk stream (see :class:`EventStream`)."""
    stream = EventStream(parts, created_at)
    for e in stream.start():
        yield e
    async for chunk in chunks:
        for e in stream.chunk(chunk):
            yield e
        if stream.failed:
            return
    for e in stream.finish():
        yield e


def sse(event: dict[str, Any]) -> bytes:
    """One server-sent event, framed as vLLM frames Responses events."""
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


# What add_routes needs: run a chat body as /v1/chat/completions does (module docstring).
RunChat = Callable[[dict[str, Any], Request],
                   Awaitable[dict[str, Any] | AsyncIterator[dict[str, Any]]]]


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.",
                    param="response_id")


def with_history(parts: ResponsesParts, store: ResponseStore | None,
                 tenant: str) -> ResponsesParts:
    """``parts`` checked against the store (module docstring: ``store: true`` without a
    store is a 400; ``previous_response_id`` is a 400 without a store, a 404 when
    ``tenant`` has no such response) and, with ``previous_response_id``, its chat
    messages continuing the stored conversation."""
    if store is None and parts.store:
        raise _bad("'store' is not served: this frontend stores no responses "
                   "(--responses-store-size 0); send store: false or leave it out",
                   "store")
    prev_id = parts.previous_response_id
    if prev_id is None:
        return parts
    if store is None:
        raise _bad("'previous_response_id' is not served: this frontend stores no "
                   "responses (--responses-store-size 0); send the whole conversation in "
                   "'input'", "previous_response_id")
    prev = store.get(tenant, prev_id)
    if prev is None:
        raise ApiError(404, f"Previous response with id '{prev_id}' not found.",
                       param="previous_response_id", code="previous_response_not_found")
    head = 1 if parts.instructions else 0
    messages = continue_messages(parts.chat_body["messages"], prev, head)
    return replace(parts, chat_body={**parts.chat_body, "messages": messages})


async def _after_warmup() -> None:
    """Returns once :data:`~.tool_chat.WARMUP` has imported vLLM's tool parser, so that
    :class:`EventStream` imports vLLM's streaming classes after it: two threads importing
    vLLM at once can meet a partially initialised module (an ImportError in both, which
    left tool calling unavailable for the process)."""
    try:
        await tool_chat.WARMUP.wait()
    except ApiError:
        pass  # the streaming classes may still import; EventStream raises if not


def _check_query(request: Request) -> None:
    for name, value in request.query_params.multi_items():
        if name == "stream" and value.lower() in ("false", "0"):
            continue
        if name in ("stream", "starting_after"):
            raise _bad(f"'{name}' is not served: replaying a response's events is for "
                       "background responses, which kvmesh does not serve", name)
        raise _bad(f"Unrecognized query parameter: '{name}'", name)


def add_routes(app: FastAPI, run_chat: RunChat, authorize: Callable[[Request], object],
               read_json: Callable[[Request], Awaitable[Any]],
               store: ResponseStore | None = None) -> None:
    """Adds ``POST /v1/responses`` and ``GET`` / ``DELETE /v1/responses/{id}`` and
    ``POST /v1/responses/{id}/cancel`` to ``app``: ``authorize(request)`` raises ApiError
    401 or returns the caller's :class:`~.auth.Tenant` (whose name scopes the stored
    responses; anything else: one shared scope), ``read_json(request)`` reads the body
    within the HTTP limits; ``store`` None: nothing is stored (module docstring)."""

    def scope(request: Request) -> str:
        who = authorize(request)
        return who.name if isinstance(who, Tenant) else ""

    def found(request: Request, response_id: str) -> tuple[str, Stored]:
        """(the caller's tenant, its entry of ``response_id``); 404 when it has none."""
        tenant = scope(request)
        _check_query(request)
        entry = None if store is None else store.get(tenant, response_id)
        if entry is None:
            raise _not_found(response_id)
        return tenant, entry

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        tenant = scope(request)
        parts = with_history(parse_responses(await read_json(request)), store, tenant)
        if parts.stream:
            await _after_warmup()
        created = int(time.time())
        try:
            result = await run_chat(parts.chat_body, request)
        except ApiError as err:
            raise map_error(err) from None

        def keep(obj: dict[str, Any]) -> None:
            if store is None or parts.store is False:
                return
            if not store.put(tenant, obj, parts.chat_body["messages"]):
                log.warning("response %s not stored: larger than the whole store "
                            "(--responses-store-mib)", obj["id"])

        if isinstance(result, dict):
            obj = full_response(parts, result, created)
            keep(obj)
            return JSONResponse(obj)

        async def body() -> AsyncIterator[bytes]:
            try:
                async for event in stream_events(parts, result, created):
                    if event["type"] == "response.completed":
                        keep(event["response"])  # before the client can see it
                    yield sse(event)
            finally:
                close = getattr(result, "aclose", None)
                if close is not None:
                    await close()

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request) -> Response:
        return JSONResponse(found(request, response_id)[1].response)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request) -> Response:
        tenant, _ = found(request, response_id)
        assert store is not None  # found() has an entry
        store.delete(tenant, response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str, request: Request) -> Response:
        found(request, response_id)
        raise _bad("Cannot cancel a synchronous response.", "response_id")
