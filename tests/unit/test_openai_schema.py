import pytest

from services.frontend.context_window import check_context
from services.frontend.openai_schema import (
    ApiError,
    error_body,
    parse_chat,
    parse_completion,
    with_tenant,
)


def test_completion_defaults_and_fields() -> None:
    r = parse_completion({"model": "m", "prompt": "hi", "temperature": 0, "seed": 3,
                          "stop": "\n", "stream": True, "stream_options": {"include_usage": True}})
    assert r.kind == "completion" and r.prompt == "hi" and r.sampling.max_tokens == 16
    assert r.sampling.temperature == 0.0 and r.sampling.seed == 3 and r.sampling.stop == ("\n",)
    assert r.stream and r.include_usage
    ids = parse_completion({"model": "m", "prompt": [1, 2, 3]})
    assert ids.prompt_token_ids == (1, 2, 3)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x"}, "model"),
    ({"model": 5, "prompt": "x"}, "model"),
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": 12}, "prompt"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": "m", "prompt": "x", "temperature": 9}, "temperature"),
    ({"model": "m", "prompt": "x", "stop": [1]}, "stop"),
    ({"model": "m", "prompt": "x", "n": 0}, "n"),
    ({"model": "m", "prompt": "x", "n": 129}, "n"),
    ({"model": "m", "prompt": ["x", ""]}, "prompt[1]"),
    ({"model": "m", "prompt": []}, "prompt"),
    ({"model": "m", "prompt": [1, True, 3]}, "prompt"),  # a bool is not a token id
    ({"model": "m", "prompt": [1, 2.0]}, "prompt"),
    ({"model": "m", "prompt": [1, None]}, "prompt"),
    ({"model": "m", "prompt": [1, -1]}, "prompt"),
    ({"model": "m", "prompt": [2**31]}, "prompt"),
    ({"model": "m", "prompt": [[1, 2], [3, False]]}, "prompt[1]"),
    ({"model": "m", "prompt": [[1], "x", [2**31]]}, "prompt[2]"),
    ({"model": "m", "prompt": "x", "logit_bias": {"5": "up"}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "logit_bias": {"-5": 1}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "logprobs": True}, "logprobs"),
    ({"model": "m", "prompt": "x", "echo": 1}, "echo"),
    ({"model": "m", "prompt": "x", "response_format": "json"}, "response_format"),
    ({"model": "m", "prompt": "x", "response_format": {"type": "json_object", "x": 1}},
     "response_format.x"),
    ({"model": "m", "prompt": "x", "response_format": {"type": "json_schema",
                                                       "json_schema": {"schema": []}}},
     "response_format.json_schema.schema"),
    ({"model": "m", "prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"model": "m", "prompt": "x", "min_tokens": 17}, "min_tokens"),  # over the default 16
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": "x", "stream_interval": 0}, "stream_interval"),
    ({"model": "m", "prompt": "x", "stream_interval": -2}, "stream_interval"),
    ({"model": "m", "prompt": "x", "stream_interval": 2.5}, "stream_interval"),
    ({"model": "m", "prompt": "x", "stream_interval": "4"}, "stream_interval"),
    ({"model": "m", "prompt": "x", "stream_interval": True}, "stream_interval"),
    ({"model": "m", "prompt": "x", "stream_interval": 2 ** 31}, "stream_interval"),
])
def test_completion_rejects(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_completion(body)
    assert err.value.status == 400 and err.value.param == param


def test_stream_interval_on_both_endpoints() -> None:
    """vLLM's per-request stream_interval (an integer >= 1; null or absent: the workers')."""
    assert parse_completion({"model": "m", "prompt": "x"}).stream_interval is None
    assert parse_completion({"model": "m", "prompt": "x", "stream": True,
                             "stream_interval": 8}).stream_interval == 8
    assert parse_completion({"model": "m", "prompt": "x",
                             "stream_interval": None}).stream_interval is None
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat({**chat, "stream": True, "stream_interval": 3}).stream_interval == 3
    with pytest.raises(ApiError) as err:
        parse_chat({**chat, "stream_interval": 0})
    assert err.value.status == 400 and err.value.param == "stream_interval"


def test_chat_parses_text_parts_and_rejects_bad_messages() -> None:
    r = parse_chat({"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ], "max_completion_tokens": 5})
    assert r.messages == (("system", "be brief"), ("user", "ab")) and r.sampling.max_tokens == 5
    assert r.sampling.max_tokens == 5
    for bad in ([], "hi", [{"role": "wizard", "content": "x"}], [{"role": "user", "content": 3}]):
        with pytest.raises(ApiError):
            parse_chat({"model": "m", "messages": bad})
    with pytest.raises(ApiError):
        parse_chat(["not", "an", "object"])


def test_context_length_rules() -> None:
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    filled = check_context(chat, 100, 2048)
    assert filled.sampling.max_tokens == 1948
    comp = parse_completion({"model": "m", "prompt": "x", "max_tokens": 100})
    with pytest.raises(ApiError) as err:
        check_context(comp, 2000, 2048)
    assert err.value.code == "context_length_exceeded" and "2100" in err.value.message
    with pytest.raises(ApiError):
        check_context(comp, 2048, 2048)


def test_error_body_shape() -> None:
    body = error_body(ApiError(404, "no such model", param="model", code="model_not_found"))
    assert body == {"error": {"message": "no such model", "type": "invalid_request_error",
                              "param": "model", "code": "model_not_found"}}


def test_a_client_cache_salt_splits_its_tenant_s_cache_but_never_reaches_another() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    plain = parse_chat(body)
    assert plain.client_salt == "" and with_tenant(plain, "ta").cache_salt == "ta"
    salted = parse_chat({**body, "cache_salt": "s1"})
    assert salted.client_salt == "s1"
    a1, b1 = with_tenant(salted, "ta").cache_salt, with_tenant(salted, "tb").cache_salt
    assert len({a1, b1, "ta", "tb", "s1"}) == 5  # per tenant and per client salt
    assert with_tenant(parse_completion({"model": "m", "prompt": "x", "cache_salt": "s1"}),
                       "ta").cache_salt == a1
    assert with_tenant(salted, "").cache_salt not in ("", "s1")  # open mesh: still split
    for bad in ("", 3):
        with pytest.raises(ApiError) as exc:
            parse_chat({**body, "cache_salt": bad})
        assert exc.value.param == "cache_salt" and "non-empty string" in str(exc.value)
