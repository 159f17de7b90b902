"""vLLM's ``structured_outputs`` field over HTTP (services/frontend/structured.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.frontend.openai_schema import (
    MAX_STRUCTURED_BYTES,
    ApiError,
    Structured,
    parse_chat,
    parse_completion,
)
from services.frontend.structured import MAX_CHOICES

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "x"}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def parsed(so: Any) -> Structured | None:
    chat = parse_chat({**CHAT, "structured_outputs": so}).sampling.structured
    assert parse_completion({**COMPLETION, "structured_outputs": so}).sampling.structured == chat
    return chat


@pytest.mark.parametrize(("so", "want"), [
    ({"regex": "[a-c]{3}"}, Structured("regex", "[a-c]{3}")),
    ({"choice": ["yes", "no"]}, Structured("choice", choices=("yes", "no"))),
    ({"grammar": 'root ::= "x"'}, Structured("grammar", 'root ::= "x"')),
    ({"json": SCHEMA}, Structured("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
    ({"json": json.dumps(SCHEMA)},
     Structured("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
    ({"json_object": True}, Structured("json_object")),
    ({"regex": "a", "json": None, "disable_any_whitespace": False,
      "structural_tag": None}, Structured("regex", "a")),
    (None, None),
])
def test_each_kind_maps_to_the_workers_constraint(so: Any, want: Structured | None) -> None:
    assert parsed(so) == want


@pytest.mark.parametrize(("so", "param", "words"), [
    ([], "structured_outputs", "must be an object"),
    ({}, "structured_outputs", "exactly one"),
    ({"regex": "a", "choice": ["b"]}, "structured_outputs", "regex, choice"),
    ({"regex": ""}, "structured_outputs.regex", "non-empty"),
    ({"regex": 3}, "structured_outputs.regex", "non-empty string"),
    ({"choice": []}, "structured_outputs.choice", "non-empty list"),
    ({"choice": ["a", 1]}, "structured_outputs.choice", "strings"),
    ({"choice": ["a"] * (MAX_CHOICES + 1)}, "structured_outputs.choice", "at most"),
    ({"json": "{no"}, "structured_outputs.json", "not JSON"),
    ({"json": [1]}, "structured_outputs.json", "schema object"),
    ({"json": {"enum": ["x" * MAX_STRUCTURED_BYTES]}}, "structured_outputs.json", "bytes"),
    ({"grammar": "x" * (MAX_STRUCTURED_BYTES + 1)}, "structured_outputs.grammar", "bytes"),
    ({"json_object": False}, "structured_outputs.json_object", "must be true"),
    ({"regex": "a", "disable_any_whitespace": True},
     "structured_outputs.disable_any_whitespace", "per engine"),
    ({"regex": "a", "whitespace_pattern": " "}, "structured_outputs.whitespace_pattern",
     "per engine"),
    ({"structural_tag": "{}"}, "structured_outputs.structural_tag", "not supported"),
    ({"regex": "a", "backend": "xgrammar"}, "structured_outputs.backend", "Unrecognized"),
])
def test_bad_constraints_are_a_400_naming_the_key(so: Any, param: str, words: str) -> None:
    for parse, body in ((parse_chat, CHAT), (parse_completion, COMPLETION)):
        with pytest.raises(ApiError) as err:
            parse({**body, "structured_outputs": so})
        assert err.value.status == 400 and err.value.param == param, err.value
        assert words in err.value.message, err.value


def test_one_constraint_per_request() -> None:
    with pytest.raises(ApiError) as err:
        parse_chat({**CHAT, "structured_outputs": {"regex": "a"},
                    "response_format": {"type": "json_object"}})
    assert err.value.param == "structured_outputs"
    # response_format text asks for nothing
    assert parse_chat({**CHAT, "structured_outputs": {"regex": "a"},
                       "response_format": {"type": "text"}}).sampling.structured == Structured(
        "regex", "a")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(ApiError) as err:
        parse_chat({**CHAT, "tools": [tool], "tool_choice": "required",
                    "structured_outputs": {"regex": "a"}})
    assert err.value.param == "structured_outputs" and "tool_choice" in err.value.message
