"""vLLM's prompt rendering options on the OpenAI endpoints: ``add_generation_prompt``,
``continue_final_message`` (chat) and ``add_special_tokens`` (both)."""

from __future__ import annotations

from typing import Any

import pytest

from services.frontend.openai_schema import ApiError, parse_chat, parse_completion

USER = {"role": "user", "content": "hi"}
ASSISTANT = {"role": "assistant", "content": "Hello, I"}


def chat(**kw: Any) -> Any:
    return parse_chat({"model": "m", "messages": [USER, ASSISTANT], **kw})


def test_defaults_are_vllms() -> None:
    req = chat()
    assert (req.add_generation_prompt, req.continue_final_message) == (True, False)
    assert req.add_special_tokens is None  # the endpoint's default: chat false
    assert parse_completion({"model": "m", "prompt": "x"}).add_special_tokens is None


def test_options_reach_the_request() -> None:
    req = chat(add_generation_prompt=False, continue_final_message=True,
               add_special_tokens=True)
    assert (req.add_generation_prompt, req.continue_final_message,
            req.add_special_tokens) == (False, True, True)
    assert parse_completion({"model": "m", "prompt": "x",
                             "add_special_tokens": False}).add_special_tokens is False


@pytest.mark.parametrize(("kw", "param"), [
    ({"continue_final_message": True}, "continue_final_message"),  # with the default gen
    ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
    ({"add_special_tokens": 1}, "add_special_tokens"),
])
def test_bad_options_are_a_400_naming_them(kw: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as err:
        chat(**kw)
    assert err.value.status == 400 and err.value.param == param, err.value


def test_continuing_needs_an_assistant_message_last() -> None:
    with pytest.raises(ApiError) as err:
        parse_chat({"model": "m", "messages": [USER], "add_generation_prompt": False,
                    "continue_final_message": True})
    assert err.value.param == "continue_final_message" and "assistant" in err.value.message
    with pytest.raises(ApiError) as err:
        parse_completion({"model": "m", "prompt": "x", "continue_final_message": True})
    assert err.value.param == "continue_final_message"  # a chat option on completions


def test_truncation_keeps_the_side_asked_for() -> None:
    from services.frontend.context_window import truncated

    req = parse_completion({"model": "m", "prompt": "x", "truncate_prompt_tokens": 3})
    assert req.truncate == (3, "left")
    ids, out = truncated(req, [1, 2, 3, 4, 5], 100)
    assert ids == [3, 4, 5] and out.prompt is None and out.prompt_token_ids == (3, 4, 5)
    right = parse_completion({"model": "m", "prompt": "x", "truncate_prompt_tokens": 2,
                              "truncation_side": "right"})
    assert truncated(right, [1, 2, 3], 100)[0] == [1, 2]
    whole = parse_chat({"model": "m", "messages": [USER], "truncate_prompt_tokens": -1})
    ids, out = truncated(whole, list(range(10)), 4)
    assert ids == [6, 7, 8, 9] and out is whole  # a chat keeps its messages
    short = truncated(req, [1, 2], 100)
    assert short[0] == [1, 2] and short[1] is req


@pytest.mark.parametrize(("kw", "param"), [
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": "3"}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 3, "truncation_side": "middle"}, "truncation_side"),
    ({"truncation_side": "left"}, "truncation_side"),
])
def test_bad_truncation_is_a_400_naming_the_field(kw: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_completion({"model": "m", "prompt": "x", **kw})
    assert err.value.param == param, err.value


def test_truncation_above_the_context_is_a_400() -> None:
    from services.frontend.context_window import truncated

    req = parse_completion({"model": "m", "prompt": "x", "truncate_prompt_tokens": 9})
    with pytest.raises(ApiError) as err:
        truncated(req, [1], 8)
    assert err.value.param == "truncate_prompt_tokens"
