"""vLLM's decoding extensions (services/frontend/vllm_extras.py): HTTP and gRPC parse
to the same SamplingSpec, the proto the workers get carries them, and the worker's
checks agree."""

from __future__ import annotations

from typing import Any

import pytest

from protos import common_pb2, frontend_pb2
from services.frontend.openai_schema import ApiError, parse_chat, parse_completion
from services.frontend.service import parse_proto
from services.frontend.vllm_extras import to_proto, vocab_problem
from workers.engines.base import MAX_BAD_WORDS, EngineError, validate_sampling
from workers.service import sampling_from_proto

BODY = {"model": "m", "prompt": "x", "max_tokens": 4}
EXTRAS: dict[str, Any] = {"bad_words": ["cat", " dog"], "allowed_token_ids": [5, 9],
                          "include_stop_str_in_output": True, "skip_special_tokens": False,
                          "spaces_between_special_tokens": False}


def test_http_and_grpc_parse_the_same_and_reach_the_worker() -> None:
    http = parse_completion({**BODY, **EXTRAS}).sampling
    assert parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                       "max_tokens": 4, **EXTRAS}).sampling == http
    grpc_req = parse_proto(frontend_pb2.CompletionRequest(
        model="m", prompt="x", sampling=common_pb2.SamplingParams(
            max_tokens=4, bad_words=["cat", " dog"], allowed_token_ids=[5, 9],
            include_stop_str_in_output=True, skip_special_tokens=False,
            spaces_between_special_tokens=False)))
    assert grpc_req.sampling == http
    p = common_pb2.SamplingParams(max_tokens=4)
    to_proto(http, p)
    worker = sampling_from_proto(p)
    assert (worker.bad_words, worker.allowed_token_ids) == (("cat", " dog"), (5, 9))
    assert worker.include_stop_str_in_output and not worker.skip_special_tokens
    assert not worker.spaces_between_special_tokens
    assert worker.features() == ["bad_words", "allowed_token_ids",
                                 "include_stop_str_in_output", "skip_special_tokens",
                                 "spaces_between_special_tokens"]
    validate_sampling(worker)


def test_defaults_set_no_feature() -> None:
    s = parse_completion(dict(BODY)).sampling
    p = common_pb2.SamplingParams(max_tokens=4)
    to_proto(s, p)
    assert not p.HasField("skip_special_tokens") and not p.bad_words
    assert sampling_from_proto(p).features() == []
    nulls = {k: None for k in EXTRAS}
    assert parse_completion({**BODY, **nulls}).sampling == s


@pytest.mark.parametrize(("extra", "param"), [
    ({"bad_words": "cat"}, "bad_words"),
    ({"bad_words": ["ok", " "]}, "bad_words[1]"),
    ({"bad_words": ["w"] * (MAX_BAD_WORDS + 1)}, "bad_words"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
])
def test_bad_extras_are_a_400_naming_the_field(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_completion({**BODY, **extra})
    assert err.value.status == 400 and err.value.param == param, err.value


def test_ids_outside_the_vocabulary() -> None:
    s = parse_completion({**BODY, "allowed_token_ids": [3, 700]}).sampling
    err = vocab_problem(s, 512)
    assert err is not None and err.param == "allowed_token_ids" and "700" in err.message
    assert vocab_problem(s, 701) is None


def test_the_worker_checks_on_its_own() -> None:
    p = common_pb2.SamplingParams(max_tokens=4, bad_words=[" "])
    with pytest.raises(EngineError, match="bad_words"):
        validate_sampling(sampling_from_proto(p))
    p = common_pb2.SamplingParams(max_tokens=4, allowed_token_ids=[-3])
    with pytest.raises(EngineError, match="allowed_token_ids"):
        validate_sampling(sampling_from_proto(p))
