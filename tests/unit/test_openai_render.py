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
