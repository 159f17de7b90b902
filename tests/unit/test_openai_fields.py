"""Nothing is silently ignored: every unknown or unserved request field is a 400 naming it.

Through the real frontend app over a real (worker-less) pipeline: validation runs before
any model lookup, so a field kvmesh would drop never reaches routing; and through the
parsers, that each no-op value is accepted.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from services.frontend.http_api import create_app
from services.frontend.models import ModelCatalog
from services.frontend.openai_fields import NO_OP
from services.frontend.openai_schema import ApiError, parse_chat, parse_completion
from services.frontend.pipeline import Pipeline

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION: dict[str, Any] = {"model": "m", "prompt": "hi"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(create_app(Pipeline(ModelCatalog(), lambda: None)))


REFUSED = [
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}},
     "response_format.type", "must be one of"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}},
     "response_format.json_schema", "must be an object"),
    ("/v1/completions", {**COMPLETION, "tools": [TOOL]}, "tools", "not supported"),
    ("/v1/completions", {**COMPLETION, "tool_choice": "auto"}, "tool_choice",
     "not supported"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice",
     "needs tools"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "web_search"}]}, "tools[0].type",
     "must be 'function'"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, "tool_choice.function.name",
     "not one of the tools"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "parallel_tool_calls": 1},
     "parallel_tool_calls", "must be a boolean"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": "required",
                              "response_format": {"type": "json_object"}},
     "response_format", "cannot be combined"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}, "logprobs", "must be a boolean"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs",
     "'logprobs' must be set to true"),
    ("/v1/chat/completions", {**CHAT, "echo": True}, "echo", "not supported"),
    ("/v1/completions", {**COMPLETION, "top_logprobs": 2}, "top_logprobs", "not supported"),
    ("/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs", "between 0 and 20"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"x": 10}}, "logit_bias",
     "not a token id"),
    ("/v1/completions", {**COMPLETION, "min_p": 1.5}, "min_p", "between"),
    ("/v1/completions", {**COMPLETION, "min_tokens": 20, "max_tokens": 4}, "min_tokens",
     "less than or equal"),
    ("/v1/completions", {**COMPLETION, "best_of": 2}, "best_of", "not supported"),
    ("/v1/completions", {**COMPLETION, "kv_transfer_params": {"do_remote_decode": True}},
     "kv_transfer_params", "not supported"),
    ("/v1/completions", {**COMPLETION, "max_token": 5}, "max_token",
     "Unrecognized request argument supplied: 'max_token'"),
    ("/v1/completions", {**COMPLETION, "messages": []}, "messages",
     "belongs to the chat endpoint"),
    ("/v1/chat/completions", {**CHAT, "prompt": "x"}, "prompt",
     "belongs to the completion endpoint"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, "n", "between 1 and 128"),
    ("/v1/completions", {**COMPLETION, "prompt": ["a", 5]}, "prompt[1]", "must be a string"),
    ("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
     "messages[0].tool_calls[0].function", "must be"),
    ("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "tool", "content": "sunny"}]},
     "messages[0].tool_call_id", "required for a tool message"),
    ("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "assistant", "content": "x", "function_call": {"name": "f"}}]},
     "messages[0].function_call", "use tool_calls"),
    ("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": "hi", "name": "bob"}]},
     "messages[0].name", "participant names"),
    ("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": "hi", "colour": "red"}]},
     "messages[0].colour", "Unrecognized key"),
]


@pytest.mark.parametrize("path,body,param,words", REFUSED)
def test_unserved_fields_are_a_400_naming_the_field(client: TestClient, path: str,
                                                    body: dict[str, Any], param: str,
                                                    words: str) -> None:
    resp = client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("name", sorted(NO_OP))
def test_each_no_op_value_is_accepted(name: str) -> None:
    for value in NO_OP[name]:
        parse_completion({**COMPLETION, name: value})
        parse_chat({**CHAT, name: value})


def test_a_bool_is_no_stand_in_for_a_number() -> None:
    """``best_of: true`` is not 1, ``top_logprobs: false`` is not 0."""
    for name, value in (("best_of", True), ("top_logprobs", False), ("min_p", False)):
        with pytest.raises(ApiError) as info:
            parse_completion({**COMPLETION, name: value})
        assert info.value.param == name


def test_fields_without_effect_on_generation_are_accepted() -> None:
    extra = {"user": "u1", "metadata": {"k": "v"}, "safety_identifier": "s",
             "prompt_cache_key": "p", "stream_options": {"include_usage": True},
             "stream": True, "max_completion_tokens": 4}
    req = parse_chat({**CHAT, **extra})
    assert req.sampling.max_tokens == 4 and req.include_usage


def test_vllm_stop_token_ids_and_repetition_penalty_reach_the_worker_sampling() -> None:
    """vLLM's two extensions the worker serves are parsed, checked and sent on."""
    from protos import common_pb2, frontend_pb2
    from services.frontend.service import parse_proto

    req = parse_completion({**COMPLETION, "stop_token_ids": [7, 9],
                            "repetition_penalty": 1.3})
    assert req.sampling.stop_token_ids == (7, 9)
    assert req.sampling.repetition_penalty == pytest.approx(1.3)
    for body, param in (({"stop_token_ids": [-1]}, "stop_token_ids"),
                        ({"stop_token_ids": "7"}, "stop_token_ids"),
                        ({"repetition_penalty": 0}, "repetition_penalty")):
        with pytest.raises(ApiError) as info:
            parse_chat({**CHAT, **body})
        assert info.value.param == param
    grpc_req = parse_proto(frontend_pb2.CompletionRequest(
        model="m", prompt="hi", sampling=common_pb2.SamplingParams(
            max_tokens=3, stop_token_ids=[5], repetition_penalty=1.1)))
    assert grpc_req.sampling.stop_token_ids == (5,)
    assert grpc_req.sampling.repetition_penalty == pytest.approx(1.1)
    with pytest.raises(ApiError) as info:
        parse_proto(frontend_pb2.CompletionRequest(
            model="m", prompt="hi", sampling=common_pb2.SamplingParams(
                max_tokens=3, repetition_penalty=-1)))
    assert info.value.param == "repetition_penalty"
    from services.frontend.jobs import Job, sampling_proto
    from services.frontend.models import ModelInfo

    job = Job("r", req, ModelInfo("m", "", 64, 32, 1, 0), [1, 2], 0, "")
    sent = sampling_proto(job)
    assert list(sent.stop_token_ids) == [7, 9]
    assert sent.HasField("repetition_penalty") and sent.repetition_penalty == pytest.approx(1.3)
