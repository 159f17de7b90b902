"""The frontend's gRPC API (``kvmesh.frontend.Frontend``): the same pipeline as HTTP.

Contract: ``Generate`` converts the protobuf request to the same validated request the
OpenAI API builds (so the rules are identical), runs it and streams CompletionChunks; the
last one carries ``finish_reason`` and ``usage``. Errors map to status codes:
400 → INVALID_ARGUMENT, 404 → NOT_FOUND, 503 → UNAVAILABLE, other → INTERNAL; an
admission rejection (``overloaded_error``) → RESOURCE_EXHAUSTED with the message and the
``retry-after`` (seconds) and ``kvmesh-admission-reason`` trailing metadata.
``ListModels`` lists the served models.

Issue 15: ``n`` (choices fan out as over HTTP, :mod:`.fanout`; each chunk carries its
``index``, each choice's last one its ``finish_reason``, the stream's last one the
request's usage), ``echo`` (completions), and from ``sampling`` (the same
``common.SamplingParams`` the workers take): ``logprobs`` (the top-k count; chunks carry
``common.PositionLogprobs``, token ids rather than strings), ``structured`` (any kind:
json_schema, json_object, regex, choice, grammar, checked as HTTP's ``structured_outputs``
by :mod:`.structured`; ``compact_json`` is refused), ``logit_bias``,
``min_tokens``, ``min_p``; ``prompt_logprobs`` is set by ``echo`` with ``logprobs`` and
refused when sent. The size limits are the OpenAI parser's (``MAX_CHOICES`` sub-requests,
``MAX_STRUCTURED_BYTES`` of schema, ``MAX_LOGIT_BIAS`` entries), INVALID_ARGUMENT naming
the field.

Tool calling (chat): ``tools`` (``frontend.Tool``: name, description, the parameters'
JSON schema as ``parameters_json`` text, strict), ``tool_choice`` (``frontend.ToolChoice``:
a mode, and the function's name with ``MODE_FUNCTION``; unset is auto with tools) and
``parallel_tool_calls``, and in ``messages`` an assistant's ``tool_calls``
(``common.ToolCall``: id, name, arguments as JSON text) and a tool message's
``tool_call_id``. :func:`parse_proto` turns them into the OpenAI dicts and validates them
with the HTTP parser's :func:`.tools.parse_tools` / :func:`.tools.message_extras`, so the
rules and messages are the same; an error names the proto field (``tools[i].name``,
``tools[i].parameters_json``, ``tool_choice.function``,
``messages[i].tool_calls[j].arguments``; ``sampling.structured`` with ``required`` or
a named function, where HTTP names ``response_format``). Tools with a ``prompt`` are
refused. The rest is the HTTP chat path's (:mod:`.tool_chat`: the template probe,
``required`` / a named function as structured outputs, a worker's refusal of that
constraint INVALID_ARGUMENT naming ``tool_choice``). Each choice's output goes through its
own :class:`~.tools.ToolCallParser` (vLLM's hermes parser, streaming): a chunk's ``text``
is the parser's content, its ``tool_calls`` the parser's ``frontend.ToolCallDelta``
pieces (index; id and name on a call's first piece; arguments pieces), ``token_ids`` and
``logprobs`` every generated token as without tools, and the choice's last chunk's
reason the parser's (``FINISH_REASON_TOOL_CALLS`` when it streamed calls and the engine
stopped, for ``auto`` and ``required``).

API keys (:mod:`.auth`): with keys configured, both methods need the metadata
``authorization: Bearer <key>`` and answer UNAUTHENTICATED (the reason, never the key)
without a valid one, before the request is looked at; the key's tenant's cache salt goes
with the request. No keys: open.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc

from protos import common_pb2, frontend_pb2, frontend_pb2_grpc
from services.frontend import fanout, structured, tool_chat, tools, vllm_extras
from services.frontend.auth import OPEN, ApiKeys, Tenant, Unauthorized
from services.frontend.failures import REASON_KEY, RETRY_AFTER_KEY
from services.frontend.fanout import Tally
from services.frontend.openai_schema import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    ApiError,
    ParsedRequest,
    SamplingSpec,
    Structured,
    check_choices,
    with_tenant,
)
from services.frontend.pipeline import Pipeline

FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
          "abort": common_pb2.FINISH_REASON_ABORT, "error": common_pb2.FINISH_REASON_ERROR,
          "tool_calls": common_pb2.FINISH_REASON_TOOL_CALLS}
STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
          503: grpc.StatusCode.UNAVAILABLE}


def parse_proto(req: frontend_pb2.CompletionRequest) -> ParsedRequest:
    """Validates a protobuf request into a ParsedRequest (ApiError 400 when invalid)."""
    if not req.model:
        raise ApiError(400, "'model' is required", param="model")
    s = req.sampling
    if s.max_tokens < 0 or (s.max_tokens == 0 and req.WhichOneof("input") == "prompt"):
        raise ApiError(400, f"'max_tokens' must be > 0, got {s.max_tokens}", param="max_tokens")
    if s.HasField("temperature") and not 0.0 <= s.temperature <= 2.0:
        raise ApiError(400, "'temperature' must be between 0 and 2", param="temperature")
    if s.HasField("top_p") and not 0.0 <= s.top_p <= 1.0:
        raise ApiError(400, "'top_p' must be between 0 and 1", param="top_p")
    if s.HasField("repetition_penalty") and not s.repetition_penalty > 0:
        raise ApiError(400, "'repetition_penalty' must be > 0", param="repetition_penalty")
    if any(t < 0 for t in s.stop_token_ids):
        raise ApiError(400, "'stop_token_ids' must be >= 0", param="stop_token_ids")
    sampling = replace(_base_sampling(s), **_issue15_sampling(req),
                       **vllm_extras.from_proto(s))
    n = req.n or 1
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"'n' must be between 1 and {MAX_N}, got {req.n}", param="n")
    check_choices(n, 1)
    which = req.WhichOneof("input")
    rid = req.request_id or None
    interval = req.stream_interval or None
    if req.echo and which != "prompt":
        raise ApiError(400, "'echo' is for completions (a prompt), not chat", param="echo")
    if which == "prompt":
        if req.tools or req.HasField("tool_choice") or req.HasField("parallel_tool_calls"):
            field = ("tools" if req.tools else "tool_choice" if req.HasField("tool_choice")
                     else "parallel_tool_calls")
            raise ApiError(400, f"'{field}' is for chat (messages), not a prompt",
                           param=field)
        if not req.prompt:
            raise ApiError(400, "'prompt' must not be empty", param="prompt")
        return ParsedRequest("completion", req.model, sampling, stream=True, prompt=req.prompt,
                             request_id=rid, n=n, echo=req.echo, stream_interval=interval)
    if which == "messages":
        if not req.messages.messages:
            raise ApiError(400, "'messages' must be a non-empty list", param="messages")
        msgs = []
        for m in req.messages.messages:
            if m.role not in ("system", "user", "assistant", "developer", "tool"):
                raise ApiError(400, f"unknown message role {m.role!r}", param="messages")
            msgs.append(("system" if m.role == "developer" else m.role, m.content))
        tool_req, extras = _tools(req)
        return ParsedRequest("chat", req.model, sampling, stream=True, messages=tuple(msgs),
                             request_id=rid, n=n, tools=tool_req, message_extras=extras,
                             stream_interval=interval)
    raise ApiError(400, "one of 'prompt' or 'messages' is required", param="prompt")


_CHOICE_MODES = {frontend_pb2.ToolChoice.MODE_NONE: "none",
                 frontend_pb2.ToolChoice.MODE_AUTO: "auto",
                 frontend_pb2.ToolChoice.MODE_REQUIRED: "required"}
# The OpenAI parser's field names -> the proto's (the message and param of its errors).
_RENAMES = ((re.compile(r"\b(tools\[\d+\])\.function\.parameters\b"), r"\1.parameters_json"),
            (re.compile(r"\b(tools\[\d+\]|tool_calls\[\d+\])\.function\."), r"\1."),
            (re.compile(r"\btool_choice\.function\.name\b"), "tool_choice.function"),
            (re.compile(r"\bresponse_format\b"), "sampling.structured"))


def _proto_names(err: ApiError) -> ApiError:
    """``err`` of the OpenAI tool parser with the proto's field names."""
    message, param = err.message, err.param
    for pattern, repl in _RENAMES:
        message = pattern.sub(repl, message)
        param = pattern.sub(repl, param) if param is not None else None
    return replace(err, message=message, param=param)


def _tool_dict(t: frontend_pb2.Tool, i: int) -> dict[str, Any]:
    """``tools[i]`` as the OpenAI chat tool dict."""
    fn: dict[str, Any] = {"name": t.name}
    if t.HasField("description"):
        fn["description"] = t.description
    if t.parameters_json:
        try:
            fn["parameters"] = json.loads(t.parameters_json)
        except ValueError as exc:
            raise ApiError(400, f"tools[{i}].parameters_json is not JSON: {exc}",
                           param=f"tools[{i}].parameters_json") from None
    if t.HasField("strict"):
        fn["strict"] = t.strict
    return {"type": "function", "function": fn}


def _choice_value(c: frontend_pb2.ToolChoice) -> Any:
    """``tool_choice`` as the OpenAI value."""
    if c.mode == frontend_pb2.ToolChoice.MODE_FUNCTION:
        return {"type": "function", "function": {"name": c.function}}
    if c.function:
        raise ApiError(400, "'tool_choice.function' is only for MODE_FUNCTION",
                       param="tool_choice.function")
    if c.mode not in _CHOICE_MODES:
        raise ApiError(400, "'tool_choice.mode' must be MODE_NONE, MODE_AUTO, MODE_REQUIRED "
                       f"or MODE_FUNCTION, got {c.mode}", param="tool_choice.mode")
    return _CHOICE_MODES[c.mode]


def _tools(req: frontend_pb2.CompletionRequest) -> tuple[tools.ToolRequest | None,
                                                          dict[int, dict[str, Any]]]:
    """The chat request's tool request and message extras, validated by the OpenAI
    parser's functions on the equivalent dicts (module docstring)."""
    body: dict[str, Any] = {}
    try:
        if req.tools:
            body["tools"] = [_tool_dict(t, i) for i, t in enumerate(req.tools)]
        if req.HasField("tool_choice"):
            body["tool_choice"] = _choice_value(req.tool_choice)
        if req.HasField("parallel_tool_calls"):
            body["parallel_tool_calls"] = req.parallel_tool_calls
        if req.sampling.HasField("structured"):
            body["response_format"] = {"type": req.sampling.structured.WhichOneof("kind")}
        tool_req = tools.parse_tools(body)
        err = tools.conflict(tool_req, body)
        if err is not None:
            raise err
        messages: list[dict[str, Any]] = []
        for m in req.messages.messages:
            d: dict[str, Any] = {"role": m.role}
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.name, "arguments": c.arguments}} for c in m.tool_calls]
            if m.tool_call_id:
                d["tool_call_id"] = m.tool_call_id
            messages.append(d)
        return tool_req, tools.message_extras(messages)
    except ApiError as err:
        raise _proto_names(err) from None


def _call_deltas(delta: dict[str, Any]) -> list[frontend_pb2.ToolCallDelta]:
    """A parser delta's ``tool_calls`` pieces as protobuf."""
    out = []
    for d in delta.get("tool_calls") or ():
        fn = d.get("function") or {}
        out.append(frontend_pb2.ToolCallDelta(
            index=d.get("index", 0), id=d.get("id") or "", name=fn.get("name") or "",
            arguments=fn.get("arguments") or ""))
    return out


def _issue15_sampling(req: frontend_pb2.CompletionRequest) -> dict[str, Any]:
    """The log-probability, structured-output, logit_bias, min_tokens and min_p options
    of ``req.sampling`` (the same checks as the OpenAI parser's, 400 naming the field)."""
    s = req.sampling
    out: dict[str, Any] = {}
    if s.HasField("logprobs"):
        if not 0 <= s.logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"'logprobs' must be between 0 and {MAX_LOGPROBS}",
                           param="logprobs")
        out["logprobs"] = s.logprobs
        if req.echo:
            out["prompt_logprobs"] = s.logprobs
    if s.HasField("prompt_logprobs"):
        raise ApiError(400, "'prompt_logprobs' is set by 'echo' with 'logprobs'",
                       param="prompt_logprobs")
    if s.HasField("structured"):
        out["structured"] = _structured(s.structured)
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"'logit_bias' takes at most {MAX_LOGIT_BIAS} entries, got "
                       f"{len(s.logit_bias)}", param="logit_bias")
    bias = []
    for token_id, value in sorted(s.logit_bias.items()):
        if token_id < 0 or value != value:
            raise ApiError(400, f"logit_bias[{token_id}] is not a token id and a number",
                           param="logit_bias")
        bias.append((token_id, min(100.0, max(-100.0, value))))
    out["logit_bias"] = tuple(bias)
    if s.min_tokens < 0 or (s.max_tokens and s.min_tokens > s.max_tokens):
        raise ApiError(400, "'min_tokens' must be between 0 and 'max_tokens'",
                       param="min_tokens")
    out["min_tokens"] = s.min_tokens
    if s.HasField("min_p"):
        if not 0.0 <= s.min_p <= 1.0:
            raise ApiError(400, "'min_p' must be between 0 and 1", param="min_p")
        out["min_p"] = s.min_p
    return out


def _structured(so: common_pb2.StructuredOutputs) -> Structured:
    """``sampling.structured`` through the HTTP ``structured_outputs`` parser (its checks
    and sizes), errors naming the proto's fields."""
    if so.compact_json:
        raise ApiError(400, "'structured.compact_json' is not supported per request (vLLM "
                       "sets it per engine)", param="structured.compact_json")
    kind = so.WhichOneof("kind")
    value: dict[str, Any] = {}
    if kind == "json_schema":
        value["json"] = so.json_schema
    elif kind == "choice":
        value["choice"] = list(so.choice.choices)
    elif kind is not None:
        value[kind] = getattr(so, kind)
    try:
        parsed = structured.parse_structured_outputs(value)
    except ApiError as err:
        param = ("structured.json_schema" if err.param == "structured_outputs.json"
                 else (err.param or "").replace("structured_outputs", "structured"))
        message = err.message.replace("structured_outputs.json ", "structured.json_schema ")
        raise ApiError(400, message.replace("structured_outputs", "structured"),
                       param=param) from None
    assert parsed is not None
    return parsed


def _base_sampling(s: common_pb2.SamplingParams) -> SamplingSpec:
    return SamplingSpec(
        max_tokens=s.max_tokens or None,
        temperature=s.temperature if s.HasField("temperature") else None,
        top_p=s.top_p if s.HasField("top_p") else None,
        top_k=s.top_k if s.HasField("top_k") else None,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(x for x in s.stop if x),
        ignore_eos=s.ignore_eos,
        presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else None,
        frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else None,
        stop_token_ids=tuple(s.stop_token_ids),
        repetition_penalty=(s.repetition_penalty if s.HasField("repetition_penalty")
                            else None),
    )


class FrontendServicer(frontend_pb2_grpc.FrontendServicer):
    """gRPC façade over the pipeline."""

    def __init__(self, pipeline: Pipeline, keys: ApiKeys | None = None) -> None:
        self._pipeline = pipeline
        self._keys = keys or ApiKeys(())

    async def _tenant(self, context: grpc.aio.ServicerContext) -> Tenant:
        """The caller's tenant from its ``authorization`` metadata; aborts with
        UNAUTHENTICATED when the key is missing or unknown."""
        if not self._keys.enabled:
            return OPEN
        header = None
        for k, v in context.invocation_metadata() or ():
            if k == "authorization":
                header = v.decode() if isinstance(v, bytes) else str(v)
        try:
            return self._keys.check(header)
        except Unauthorized as exc:
            self._pipeline.metrics.auth_failures.labels("grpc").inc()
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        raise AssertionError("context.abort returned")  # pragma: no cover

    async def Generate(  # noqa: N802
        self, request: frontend_pb2.CompletionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[frontend_pb2.CompletionChunk]:
        who = await self._tenant(context)
        parsed: ParsedRequest | None = None
        try:
            parsed = parse_proto(request)
            fan, chunks = await fanout.run(self._pipeline, with_tenant(parsed, who.cache_salt))
            tally = Tally(fan)
            started: set[int] = set()
            try:
                tool_req = fan.req.tools
                tok = (await asyncio.to_thread(self._pipeline.catalog.tokenizer,
                                               fan.prompts[0].model)
                       if fan.req.echo or tool_req is not None else None)
                parsers = ([tools.ToolCallParser(getattr(tok, "hf", tok), tool_req)
                            for _ in fan.choices] if tool_req is not None else None)
                async for index, c in chunks:
                    tally.see(index, c)
                    out = frontend_pb2.CompletionChunk(
                        request_id=fan.request_id, text=c.text, token_ids=c.token_ids,
                        model=fan.req.model, index=index, logprobs=c.logprobs)
                    finish = c.finish_reason
                    if parsers is not None:  # chat with tools: the choice's parser
                        parser = parsers[index]
                        delta = parser.delta(c.text, finished=finish is not None) or {}
                        out.text = delta.get("content") or ""
                        out.tool_calls.extend(_call_deltas(delta))
                        if finish is not None:
                            finish = parser.stream_finish_reason(finish)
                    if fan.req.echo and c.token_ids and index not in started:
                        started.add(index)
                        job = fan.prompt_of(index)
                        prompt = job.req.prompt
                        if prompt is None and tok is not None:
                            prompt = tok.decode(job.token_ids, skip_special_tokens=False)
                        out.text = (prompt or "") + c.text
                        out.prompt_logprobs.extend(c.prompt_logprobs)
                    if finish is not None:
                        out.finish_reason = FINISH.get(finish, common_pb2.FINISH_REASON_STOP)
                        if tally.done:
                            p, done, cached = tally.usage()
                            out.usage.CopyFrom(common_pb2.Usage(
                                prompt_tokens=p, completion_tokens=done, cached_tokens=cached))
                    yield out
            finally:
                await chunks.aclose()  # type: ignore[attr-defined]
        except ApiError as err:
            if parsed is not None:  # a worker's refusal of a forced call's constraint
                err = tool_chat.explain(parsed, err)
            if err.type == "overloaded_error":
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, err.message, trailing_metadata=(
                        (RETRY_AFTER_KEY, f"{err.retry_after_s or 0.0:.3f}"),
                        (REASON_KEY, err.code or "overloaded")))
            await context.abort(STATUS.get(err.status, grpc.StatusCode.INTERNAL), err.message)

    async def ListModels(  # noqa: N802
        self, request: frontend_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.ListModelsResponse:
        await self._tenant(context)
        return frontend_pb2.ListModelsResponse(models=[
            frontend_pb2.Model(id=m.name, max_model_len=m.max_model_len,
                               num_workers=m.num_workers)
            for m in self._pipeline.catalog.all()
        ])
