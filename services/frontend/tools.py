"""Tool calling for chat completions, as vLLM's OpenAI server does it with
``--enable-auto-tool-choice --tool-call-parser hermes``.

The validation is pure (no vLLM). The output parsing and the tool-call JSON schema come
from vLLM's own classes: its ``DelegatingParser`` around the ``hermes`` tool parser, and
``ToolParser.adjust_request``, which builds the schema. vLLM is imported on first use
(about 10 s), so call :func:`warm` in a thread at startup. Contract:

- :func:`parse_tools` reads ``tools``, ``tool_choice`` and ``parallel_tool_calls`` from a
  chat body. It returns a :class:`ToolRequest`, or None when the body asks for no tools
  (``tools`` absent, null or ``[]``, and ``tool_choice`` absent, null or ``"none"``).
  Bad input is an ApiError 400 that names the field: ``tools[i].type``,
  ``tools[i].function.name`` (``^[a-zA-Z0-9_-]{1,64}$``, unique),
  ``tools[i].function.parameters`` (must be a JSON schema object),
  ``tool_choice`` (``none``, ``auto``, ``required``, or
  ``{"type": "function", "function": {"name": ...}}`` naming one of the tools: otherwise
  ``tool_choice.function.name``; a ``tool_choice`` other than ``none`` with no tools),
  and ``parallel_tool_calls``. With tools and no ``tool_choice``, the choice is ``auto``,
  as in vLLM.
- :func:`structured_for` gives the constraint for ``required`` and for a named function,
  as a ``common.StructuredOutputs`` ``json_schema``; for ``none`` and ``auto`` it gives
  None. vLLM builds the schema (``get_json_schema_from_tools``). For ``required`` it is
  an array (``minItems`` 1, and ``maxItems`` 1 when ``parallel_tool_calls`` is false) of
  ``{"name": <enum of one tool>, "parameters": <its schema>}`` objects, with the tools'
  ``$defs`` merged. For a named function it is that function's ``parameters`` (``{}`` →
  any object). This is vLLM's JSON path (``VLLM_ENFORCE_STRICT_TOOL_CALLING=0``). By
  default vLLM 0.32 constrains hermes to a ``<tool_call>`` structural tag instead, which
  ``common.StructuredOutputs`` cannot carry. :func:`conflict` refuses
  ``response_format`` together with ``required`` or a named function (400 naming
  ``response_format``), where vLLM silently drops ``response_format``.
- :func:`render_kwargs` gives the chat template's keyword arguments: ``{"tools": [...]}``
  (the OpenAI chat tool dicts) whenever the request has tools, ``none`` included, as
  vLLM does by default.
- :func:`message_extras` validates what tool calling adds to ``messages``. An
  assistant's ``tool_calls`` (``id``, ``type: "function"``, ``function.name``,
  ``function.arguments`` as a JSON object string) is handed to the template with
  ``arguments`` parsed into a dict, as vLLM does. vLLM turns malformed arguments into
  ``{}``; kvmesh answers 400 ``messages[i].tool_calls[j].function.arguments``. A tool
  message's ``tool_call_id`` is required. The result maps a message's index to the keys
  to merge into that message's template dict. The template gets ``""`` for a ``null``
  content.
- :func:`template_support` probes a chat template (a ``render(messages, tools) -> str``
  callable) for whether it renders the tool list and an assistant's tool calls.
  :func:`template_problem` then refuses, with a 400, what the template would silently
  drop. That is ``auto`` when the tools are not rendered (param ``tool_choice``: the
  model cannot learn about them), and an assistant ``tool_calls`` message when tool calls
  are not rendered (``messages[i].tool_calls``). ``required`` and named functions need
  no rendering, because the grammar carries the name and schema. SmolLM2's template
  renders neither, so there only ``none``, ``required`` and named functions are served
  (vLLM renders it silently without the tools); the tiny model's (format version 2,
  :data:`workers.model.tiny.CHATML_TEMPLATE`) renders both, hermes-style.
- :class:`ToolCallParser` (one per request and choice, stateful when streaming) turns
  the model's text into OpenAI output with vLLM's parser. ``finish(text, reason)``
  returns :class:`ToolOutput`: ``content``, ``tool_calls`` as
  ``[{"id": "chatcmpl-tool-<hex>", "type": "function", "function": {"name",
  "arguments": <JSON string>}}]``, and ``finish_reason``. The reason is ``tool_calls``
  for ``auto`` when a call was found, and for ``required`` when the engine stopped;
  otherwise it is the engine's. ``delta(text, finished)`` returns the chat chunk's
  ``delta`` dict, as vLLM serialises it (``content`` and/or ``tool_calls`` entries with
  ``index``, then ``id``/``type``/``function.name``, then ``function.arguments``
  pieces), or None when there is nothing to send yet. ``stream_finish_reason(reason)``
  gives the last chunk's reason (``tool_calls`` when calls were streamed, the choice is
  not a named function, and the engine stopped). ``parallel_tool_calls: false`` keeps
  the first call only, as vLLM does.

The hermes parser asks for ``skip_special_tokens=false``. That does not matter for the
served models, where ``<tool_call>`` is plain text.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from protos import common_pb2
from services.frontend.openai_schema import ApiError

NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
CHOICES = ("none", "auto", "required")
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
_CALL_KEYS = frozenset({"id", "type", "function"})
_PROBE = "kvmesh_probe_tool"


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass(frozen=True)
class FunctionTool:
    """One function tool of a request."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_dict(self) -> dict[str, Any]:
        """The OpenAI chat tool dict (what the template and vLLM receive), as vLLM's
        server renders it (its ``model_dump()``): ``description`` and ``parameters``
        always, null when the request leaves them out, so the prompt is vLLM's token for
        token; ``strict`` only when set."""
        fn: dict[str, Any] = {"name": self.name, "description": self.description,
                              "parameters": self.parameters}
        if self.strict is not None:
            fn["strict"] = self.strict
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolRequest:
    """A validated tool request: ``choice`` is none/auto/required/function."""

    tools: tuple[FunctionTool, ...]
    choice: str
    function: str | None = None  # the named function (choice "function")
    parallel_tool_calls: bool | None = None

    @property
    def constrained(self) -> bool:
        """Whether the output is constrained (required or a named function)."""
        return self.choice in ("required", "function")

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.chat_dict() for t in self.tools]

    def vllm_tool_choice(self) -> Any:
        if self.choice == "function":
            return {"type": "function", "function": {"name": self.function}}
        return self.choice


def _check_schema(schema: dict[str, Any], param: str) -> None:
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise _bad(f"{param} is not a valid JSON schema: {exc.message}", param) from None


def _function_tool(tool: Any, i: int, seen: set[str]) -> FunctionTool:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise _bad(f"{where} must be an object", where)
    for key in tool:
        if key not in _TOOL_KEYS:
            raise _bad(f"Unrecognized key in {where}: '{key}'", f"{where}.{key}")
    if tool.get("type") != "function":
        raise _bad(f"{where}.type must be 'function' (the only tool type served), got "
                   f"{tool.get('type')!r}", f"{where}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"{where}.function must be an object", f"{where}.function")
    for key in fn:
        if key not in _FUNCTION_KEYS:
            raise _bad(f"Unrecognized key in {where}.function: '{key}'",
                       f"{where}.function.{key}")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise _bad(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', "
                   f"got {name!r}", f"{where}.function.name")
    if name in seen:
        raise _bad(f"{where}.function.name: the name {name!r} is used by another tool",
                   f"{where}.function.name")
    seen.add(name)
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise _bad(f"{where}.function.description must be a string",
                   f"{where}.function.description")
    params = fn.get("parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise _bad(f"{where}.function.parameters must be a JSON schema object",
                       f"{where}.function.parameters")
        _check_schema(params, f"{where}.function.parameters")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(f"{where}.function.strict must be a boolean", f"{where}.function.strict")
    return FunctionTool(name, desc, params, strict)


def _choice(value: Any, names: Sequence[str]) -> tuple[str, str | None]:
    if isinstance(value, str):
        if value not in CHOICES:
            raise _bad("tool_choice must be 'none', 'auto', 'required' or "
                       "{'type': 'function', 'function': {'name': ...}}, got "
                       f"{value!r}", "tool_choice")
        return value, None
    if not isinstance(value, dict):
        raise _bad("tool_choice must be a string or an object", "tool_choice")
    if value.get("type") != "function" or set(value) - {"type", "function"}:
        raise _bad("tool_choice as an object must be {'type': 'function', 'function': "
                   "{'name': ...}}", "tool_choice")
    fn = value.get("function")
    if not isinstance(fn, dict) or set(fn) - {"name"}:
        raise _bad("tool_choice.function must be {'name': ...}", "tool_choice.function")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise _bad("tool_choice.function.name must be a non-empty string",
                   "tool_choice.function.name")
    if name not in names:
        raise _bad(f"tool_choice.function.name {name!r} is not one of the tools",
                   "tool_choice.function.name")
    return "function", name


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """The body's tool request, or None (see the module docstring)."""
    raw = body.get("tools")
    choice_raw = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if raw is not None and not isinstance(raw, list):
        raise _bad("tools must be a list of function tools", "tools")
    seen: set[str] = set()
    tools = tuple(_function_tool(t, i, seen) for i, t in enumerate(raw or []))
    if not tools:
        if choice_raw is None or choice_raw == "none":
            return None
        raise _bad("tool_choice needs tools: 'tools' is missing or empty", "tool_choice")
    choice, function = ("auto", None) if choice_raw is None else _choice(
        choice_raw, [t.name for t in tools])
    return ToolRequest(tools, choice, function, parallel)


def conflict(tool_req: ToolRequest | None, body: dict[str, Any]) -> ApiError | None:
    """A 400 when ``response_format`` or ``structured_outputs`` asks for a format a forced
    tool call overrides."""
    if tool_req is None or not tool_req.constrained:
        return None
    if body.get("structured_outputs") is not None:
        return _bad("structured_outputs cannot be combined with tool_choice 'required' or a "
                    "named function (the tool call's schema constrains the output)",
                    "structured_outputs")
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "text":
        return None
    return _bad("response_format cannot be combined with tool_choice 'required' or a named "
                "function (the tool call's schema constrains the output)", "response_format")


def render_kwargs(tool_req: ToolRequest | None) -> dict[str, Any]:
    """The chat template's extra keyword arguments for ``tool_req``."""
    return {} if tool_req is None else {"tools": tool_req.tool_dicts()}


def _arguments(value: Any, param: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if value is None or value == "":
        return {}
    if not isinstance(value, str):
        raise _bad(f"{param} must be a JSON object as a string", param)
    try:
        parsed = json.loads(value)
    except ValueError:
        raise _bad(f"{param} is not valid JSON", param) from None
    if not isinstance(parsed, dict):
        raise _bad(f"{param} must be a JSON object, got {type(parsed).__name__}", param)
    return parsed


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise _bad(f"{where} must be an object", where)
    for key in call:
        if key not in _CALL_KEYS:
            raise _bad(f"Unrecognized key in {where}: '{key}'", f"{where}.{key}")
    if not isinstance(call.get("id"), str) or not call["id"]:
        raise _bad(f"{where}.id must be a non-empty string", f"{where}.id")
    if call.get("type", "function") != "function":
        raise _bad(f"{where}.type must be 'function'", f"{where}.type")
    fn = call.get("function")
    if not isinstance(fn, dict) or set(fn) - {"name", "arguments"}:
        raise _bad(f"{where}.function must be {{'name': ..., 'arguments': ...}}",
                   f"{where}.function")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise _bad(f"{where}.function.name must be a non-empty string",
                   f"{where}.function.name")
    return {"id": call["id"], "type": "function", "function": {
        "name": fn["name"], "arguments": _arguments(fn.get("arguments"),
                                                    f"{where}.function.arguments")}}


def message_extras(messages: Sequence[Any]) -> dict[int, dict[str, Any]]:
    """Per message index, the tool keys for its template dict (module docstring)."""
    extras: dict[int, dict[str, Any]] = {}
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise _bad(f"messages[{i}].tool_calls is only allowed on assistant "
                           "messages", f"messages[{i}].tool_calls")
            if not isinstance(calls, list):
                raise _bad(f"messages[{i}].tool_calls must be a list",
                           f"messages[{i}].tool_calls")
            if calls:
                extras[i] = {"tool_calls": [_tool_call(c, f"messages[{i}].tool_calls[{j}]")
                                            for j, c in enumerate(calls)]}
        call_id = m.get("tool_call_id")
        if role == "tool":
            if not isinstance(call_id, str) or not call_id:
                raise _bad(f"messages[{i}].tool_call_id is required for a tool message",
                           f"messages[{i}].tool_call_id")
            extras[i] = {"tool_call_id": call_id}
        elif call_id is not None:
            raise _bad(f"messages[{i}].tool_call_id is only allowed on tool messages",
                       f"messages[{i}].tool_call_id")
    return extras


@dataclass(frozen=True)
class TemplateSupport:
    """What a chat template renders: the tool list, an assistant's tool calls."""

    tools: bool
    tool_calls: bool


Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]


def template_support(render: Render) -> TemplateSupport:
    """Probes ``render(messages, tools)`` (the template, ``add_generation_prompt``)."""
    user = {"role": "user", "content": "hi"}
    tool = FunctionTool(_PROBE, "probe", {"type": "object", "properties": {}}).chat_dict()

    def shows(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
        try:
            return _PROBE in render(messages, tools)
        except Exception:  # a template that fails on the probe renders nothing of it
            return False

    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function",
         "function": {"name": _PROBE, "arguments": {}}}]}
    return TemplateSupport(tools=shows([user], [tool]), tool_calls=shows([user, call], None))


def template_problem(tool_req: ToolRequest | None, messages: Sequence[Any],
                     support: TemplateSupport, model: str) -> ApiError | None:
    """A 400 for what the model's template would drop silently (module docstring)."""
    if tool_req is not None and tool_req.choice == "auto" and not support.tools:
        return _bad(f"the chat template of model '{model}' does not render tools, so "
                    "tool_choice 'auto' cannot tell the model about them; use "
                    "tool_choice 'required' or a named function", "tool_choice")
    if not support.tool_calls:
        for i, m in enumerate(messages):
            if isinstance(m, dict) and m.get("tool_calls"):
                return _bad(f"the chat template of model '{model}' does not render an "
                            "assistant's tool calls", f"messages[{i}].tool_calls")
    return None


# --- vLLM's parser -------------------------------------------------------------------------

@functools.cache
def _parser_cls() -> Any:
    """vLLM's DelegatingParser over the hermes tool parser, with vLLM's JSON handling of
    required / named choices (module docstring)."""
    from vllm.parser.abstract_parser import DelegatingParser
    from vllm.tool_parsers import ToolParserManager

    hermes = ToolParserManager.get_tool_parser("hermes")
    json_hermes = type("JsonHermesToolParser", (hermes,), {
        "structural_tag_model": None, "supports_required_and_named": True})
    return type("KvmeshHermesParser", (DelegatingParser,), {"tool_parser_cls": json_hermes})


def warm() -> None:
    """Imports vLLM's parser classes now (seconds; call from a thread at startup)."""
    _parser_cls()


def _vllm_request(tool_req: ToolRequest) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate({
        "model": "kvmesh", "messages": [{"role": "user", "content": ""}],
        "tools": tool_req.tool_dicts(), "tool_choice": tool_req.vllm_tool_choice(),
        "parallel_tool_calls": tool_req.parallel_tool_calls})


def structured_for(tool_req: ToolRequest | None) -> common_pb2.StructuredOutputs | None:
    """The constraint for ``required`` / a named function, else None (module doc)."""
    if tool_req is None or not tool_req.constrained:
        return None
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    req = _vllm_request(tool_req)  # vLLM's typed tools, as adjust_request passes them
    schema = get_json_schema_from_tools(tool_choice=req.tool_choice, tools=req.tools,
                                        parallel_tool_calls=req.parallel_tool_calls)
    return common_pb2.StructuredOutputs(
        json_schema=schema if isinstance(schema, str) else json.dumps(schema))


@dataclass(frozen=True)
class ToolOutput:
    """A finished output: content (None: no text), tool calls, finish reason."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str | None

    def message(self) -> dict[str, Any]:
        """The chat completion's ``message``."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


class ToolCallParser:
    """vLLM's hermes parsing of one request's output (module docstring).

    ``tokenizer``: the model's tokenizer (the Hugging Face one, or any truthy object: the
    hermes parser only checks that it is not Mistral's)."""

    def __init__(self, tokenizer: Any, tool_req: ToolRequest) -> None:
        from vllm.entrypoints.serve.utils.tool_calls_utils import (
            maybe_filter_parallel_tool_calls,
        )
        from vllm.renderers.chat_utils import make_tool_call_id

        self.tool_req = tool_req
        self._filter = maybe_filter_parallel_tool_calls
        self._make_id = make_tool_call_id
        self._request = _vllm_request(tool_req)
        self._parser = _parser_cls()(tokenizer, self._request.tools)
        self._request = self._parser.adjust_request(self._request)
        self.tools_streamed = False

    def finish(self, text: str, finish_reason: str | None) -> ToolOutput:
        """Content and tool calls of the whole output ``text``; see the module doc."""
        _, content, calls = self._parser.parse(text, self._request, enable_auto_tools=True)
        calls = self._filter(list(calls or []), self._request)
        tool_calls = [{"id": c.id or self._make_id(), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}}
                      for c in calls]
        reason = finish_reason
        if self.tool_req.constrained:
            content = content or ""
            if self.tool_req.choice == "required" and finish_reason == "stop":
                reason = "tool_calls"
        elif self.tool_req.choice == "auto" and tool_calls:
            reason = "tool_calls"
        return ToolOutput(content, tool_calls, reason)

    def delta(self, text: str, finished: bool = False) -> dict[str, Any] | None:
        """The chat chunk ``delta`` for ``text`` (the next piece), or None."""
        msg = self._parser.parse_delta(text, [], self._request, prompt_token_ids=[],
                                       finished=finished)
        if msg is None:
            return None
        msg = self._filter(msg, self._request)
        if msg.tool_calls:
            self.tools_streamed = True
        out: dict[str, Any] = msg.model_dump(mode="json", exclude_unset=True)
        return out

    def stream_finish_reason(self, finish_reason: str | None) -> str | None:
        """The reason on the last chunk of a stream; see the module docstring."""
        if self.tools_streamed and self.tool_req.choice != "function" and (
                finish_reason == "stop"):
            return "tool_calls"
        return finish_reason
