"""The frontend's JSON codec: decode is json.loads (values and errors alike), encode is
compact UTF-8 JSON with non-finite floats as null; the answer class."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from services.frontend.json_codec import JsonAnswer, decode, encode

SAME = [
    b'{"model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0.7}',
    b' {"a": {"b": [null, true, false, -0, 1E2, 2.5e-3, "\\u00e9\\ud83d\\ude00"]}} ',
    b'{"a": 1, "a": 2}',  # the last of a duplicate key, as json.loads
    b'{"seed": 123456789012345678901234567890}',  # a big int stays an int
    b'{"x": NaN, "y": -Infinity}',  # refused by msgspec: json.loads' floats
    b'{"x": 1e400}',  # beyond a float: json.loads' inf
    b'{"text": "\\ud800"}',  # a lone surrogate: json.loads keeps it (checked later)
    b'[' * 500 + b']' * 500,
    b'{"prompt": "\xed\xa0\x80"}',  # a UTF-8-encoded surrogate: json.loads keeps it
]


@pytest.mark.parametrize("raw", SAME)
def test_decode_is_json_loads(raw: bytes) -> None:
    got, want = decode(raw), json.loads(raw)
    assert repr(got) == repr(want)  # repr: NaN compares unequal to itself
    assert type(got) is type(want)


@pytest.mark.parametrize("raw", [b"{", b"\xff", b'{"a": "\xff"}', b'{"a": 1} x', b"",
                                 b"[1,]",
                                 b'{"a": ' + b"9" * 5000 + b"}"])
def test_decode_refuses_what_json_loads_refuses(raw: bytes) -> None:
    with pytest.raises(ValueError) as want:
        json.loads(raw)
    with pytest.raises(ValueError) as got:
        decode(raw)
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)


def test_decode_of_too_deep_nesting_raises_recursion_error() -> None:
    with pytest.raises(RecursionError):
        decode(b"[" * 100_000 + b"]" * 100_000)


def test_encode_is_compact_utf8_with_non_finite_floats_as_null() -> None:
    obj: dict[str, Any] = {"text": "é \u2028 😀", "n": [1, 2.5, None, True],
                           "lp": -9999.0, "bad": [math.nan, -math.inf]}
    out = encode(obj)
    assert out == ('{"text":"é \u2028 😀","n":[1,2.5,null,true],"lp":-9999.0,'
                   '"bad":[null,null]}').encode()
    assert json.loads(out) == {**obj, "bad": [None, None]}


def test_encode_of_a_lone_surrogate_falls_back_to_escapes() -> None:
    out = encode({"text": "a\ud800b", "n": 1})
    assert out == b'{"text":"a\\ud800b","n":1}'
    assert json.loads(out) == {"text": "a\ud800b", "n": 1}


def test_json_answer() -> None:
    answer = JsonAnswer({"a": "é"}, status_code=201)
    assert answer.body == '{"a":"é"}'.encode()
    assert answer.status_code == 201
    headers = dict(answer.raw_headers)
    assert headers[b"content-type"] == b"application/json"
    assert headers[b"content-length"] == str(len(answer.body)).encode()
